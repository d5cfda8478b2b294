"""Every RL role of this rank, built from its config section.

All roles live on every rank (co-located SPMD): the actor (megatron training
engine + vLLM rollout engine + the resharder between them), and, as the config
asks, the frozen reference, the PPO critic and a reward model, all in the
actor's training layout. Roles that are idle sit on the host; one byte ledger
(the resharder's) counts every role's device bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from mindspeed_rl.resharding.swap import RoleSwap, training_state_tensors
from mindspeed_rl.engine.actor import MegatronActor, build_policy_model
from mindspeed_rl.engine.critic import MegatronCritic


class SharedBackbone:
    """``rl_config.share_backbone``: the reference is the actor's own model with its LoRA
    adapters switched off (MindSpeed-RL's ``disable_adapter``), so no reference weights are
    built, loaded or offloaded; ``resident()`` is where the reference exists."""

    def __init__(self, model) -> None:
        self.model = model

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        from mindspeed_rl.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            yield


@dataclass
class Roles:
    actor: MegatronActor
    rollout: "RolloutEngine"  # noqa: F821 - vLLM is imported lazily
    resharder: "Resharder"  # noqa: F821
    reference: torch.nn.Module | None = None
    reference_swap: RoleSwap | None = None
    critic: MegatronCritic | None = None
    critic_swap: RoleSwap | None = None
    reward_model: torch.nn.Module | None = None
    reward_model_swap: RoleSwap | None = None
    reference_source: object = None  # weight_source.WeightSource of the reference
    reference_layout: object = None  # parallel.second_layout.SecondLayout: its own, or None
    teacher: object = None  # teacher_role.Teacher: on-policy distillation's
    agent: object = None  # rollout_parts.agent.Agent: the tool turns' tools (built lazily)

    @property
    def trainables(self) -> dict:
        """The roles whose state a checkpoint saves (the actor first)."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}

    @contextlib.contextmanager
    def trainables_resident(self) -> Iterator[dict]:
        """Every trainable role on the device (a checkpoint reads and writes its storage)."""
        with contextlib.ExitStack() as stack:
            if self.critic_swap is not None:
                stack.enter_context(self.critic_swap.resident())
            yield self.trainables

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.rollout is not None:
            self.rollout.shutdown()


@dataclass(frozen=True)
class RoleEnv:
    """What every role's build shares: the architecture, the megatron model options of the
    run, the trainable-model options, the byte ledger and the device."""

    arch: object
    model_options: dict
    trainable: dict
    total_steps: int
    seed: int
    pin: bool
    ledger: object = None


def build_roles(config, plan, platform, arch, model_dir: str, *, start) -> Roles:
    """Build this rank's roles for ``config`` (megatron's parallel state must exist): one
    build per role, each from its own config section.

    ``start`` is the actor's initial `WeightSource` (``weight_source.actor_start``), or
    None when the run resumes from a trainer checkpoint (loaded afterwards by the trainer).
    """
    from mindspeed_rl.models.training_options import training_model_options

    mt, rl, features = config.megatron_training, config.rl_config, config.features
    env = RoleEnv(
        arch=arch, seed=mt.seed, pin=platform.device_type != "cpu",
        model_options=dict(params_dtype=torch.bfloat16 if mt.bf16 else torch.float32,
                           sequence_parallel=mt.sequence_parallel,
                           **training_model_options(config)),
        trainable=dict(use_distributed_optimizer=mt.use_distributed_optimizer, bf16=mt.bf16,
                       max_consecutive_skipped_steps=rl.max_consecutive_skipped_steps),
        total_steps=mt.train_iters * plan.batch.optimizer_steps_per_iteration)
    rm_arch = None
    if features.reward_model:  # refused from its files, before any model is built
        rm_arch = reward_model_architecture(config.reward_config.load, arch, model_dir)
    actor = build_actor(config.actor_config, env, start)
    rollout = build_rollout(config, model_dir, platform) if features.engine else None
    resharder = build_resharder(config.generate_config, actor, rollout, env, platform)
    roles = Roles(actor=actor, rollout=rollout, resharder=resharder)
    env = dataclasses.replace(env, ledger=resharder.ledger)
    if features.reference and rl.share_backbone:
        roles.reference, roles.reference_swap = actor.model, SharedBackbone(actor.model)
    elif features.reference:
        (roles.reference, roles.reference_swap, roles.reference_source,
         roles.reference_layout) = build_reference(
            config.ref_config, env, actor.model, start, config.actor_config.load,
            timeout_s=rl.collective_timeout_s)
    if config.critic_config is not None:
        roles.critic, roles.critic_swap = build_critic(config.critic_config, env, start)
    if features.reward_model:
        roles.reward_model, roles.reward_model_swap = build_reward_model(
            config.reward_config, env, rm_arch)
    if features.teacher:
        from mindspeed_rl.trainer.teacher_role import build_teacher

        roles.teacher = build_teacher(config, env, arch)
    return roles


def build_actor(section, env: RoleEnv, start) -> MegatronActor:
    """The policy (``actor_config``): this rank's GPT shard, its weights from ``start``
    (none when resuming), DDP and the optimizer."""
    from mindspeed_rl.checkpoint import weight_source

    policy = build_policy_model(env.arch, **env.model_options)
    if section.lora_target_modules:
        from mindspeed_rl.models.lora import add_lora_adapters

        add_lora_adapters(policy, section.lora_target_modules, section.lora_r,
                          section.lora_alpha, seed=env.seed)
    if start is not None:
        weight_source.load_weights(policy, env.arch, start)
    elif section.lora_target_modules and section.lora_ckpt_filter:
        # An adapter-only checkpoint: the backbone is the base model the run recorded.
        weight_source.load_weights(policy, env.arch, weight_source.WeightSource.from_dict(
            weight_source.recorded_start(section.load)))
    actor = MegatronActor(policy, section, total_steps=env.total_steps, **env.trainable)
    actor.checkpoint_adapters_only = bool(section.lora_target_modules and
                                          section.lora_ckpt_filter)
    return actor


def build_rollout(config, model_dir: str, platform) -> "RolloutEngine":  # noqa: F821
    """vLLM on this rank (``generate_config`` and ``sampling_config``), placeholder weights."""
    from mindspeed_rl.rollout import RolloutEngine

    return RolloutEngine.from_config(config, model_dir, device_type=platform.device_type)


def build_resharder(section, actor: MegatronActor, rollout, env: RoleEnv,
                    platform) -> "Resharder":  # noqa: F821
    """The allgather-swap between the actor's training shards and vLLM
    (``generate_config``: bucket size and what is offloaded while generating)."""
    from mindspeed_rl.resharding import Resharder

    return Resharder(
        model=actor.model, model_chunks=actor.chunks, optimizer=actor.optimizer, engine=rollout,
        weight_map=env.arch.weight_map, bucket_bytes=int(section.resharding_bucket_mb * 2**20),
        platform=platform, offload_train_param=section.offload_train_param,
        offload_train_grad=section.offload_train_grad,
        offload_train_optimizer=section.offload_train_optimizer)


def build_reference(section, env: RoleEnv, policy, start, actor_load, *, timeout_s: float):
    """The frozen reference (``ref_config``): the policy the run started from, also when it
    resumes (``ref_config.load``, else the start recorded in the checkpoint); offloaded
    to the host between its phases. Returns (model, swap, its weight source, its own
    layout or None)."""
    from mindspeed_rl.checkpoint import weight_source

    source = weight_source.reference_start(
        section.load, start, weight_source.recorded_start(actor_load) if start is None else None)
    layout = reference_layout(section, timeout_s)
    if layout is not None:  # MindSpeed-RL's separate-worker reference: a layout of its own
        with layout.current():
            ref = build_policy_model(env.arch, **{**env.model_options,
                                                  "sequence_parallel": False})
            weight_source.load_weights(ref, env.arch, source)
    else:
        ref = build_policy_model(env.arch, **env.model_options)
        if source is start:  # parameters and weight buffers (DeepSeek-V3's router bias)
            from mindspeed_rl.models.builder import copy_model_weights

            copy_model_weights(ref, policy)
        else:
            weight_source.load_weights(ref, env.arch, source)
    ref.requires_grad_(False)
    swap = RoleSwap("ref", lambda: {"param": list(ref.parameters())}, env.ledger, env.pin)
    return ref, swap, source, layout


def reference_layout(section, timeout_s: float):
    """The reference's own megatron groups (``ref_config``'s TP x PP when they differ from
    the actor's: MindSpeed-RL's separate-worker format), else None."""
    from megatron.core import parallel_state as ps

    from mindspeed_rl.parallel.second_layout import SecondLayout

    tp = section.tensor_model_parallel_size or ps.get_tensor_model_parallel_world_size()
    pp = section.pipeline_model_parallel_size or ps.get_pipeline_model_parallel_world_size()
    if (tp, pp) == (ps.get_tensor_model_parallel_world_size(),
                    ps.get_pipeline_model_parallel_world_size()):
        return None
    return SecondLayout(tp, pp, timeout_s=timeout_s)


def build_critic(section, env: RoleEnv, start) -> tuple[MegatronCritic, RoleSwap]:
    """The PPO critic (``critic_config``): the policy's body with a scalar value head,
    from ``critic_config.load`` or the actor's start; offloaded between its phases."""
    from mindspeed_rl.checkpoint import weight_source
    from mindspeed_rl.checkpoint.weight_source import load_value_weights

    value_model = _scalar_head_model(env.arch, env.model_options, seed=env.seed,
                                     head_std=section.value_head_init_std)
    if start is not None:
        if section.load is None and start.kind == weight_source.LEGACY:
            raise ValueError(f"critic_config.load: the critic cannot start from the legacy "
                             f"Megatron checkpoint {start.path}; convert it "
                             "(tools/convert_ckpt.py) or set critic_config.load")
        load_value_weights(value_model, env.arch, section.load or start.path,
                           require_score_head=False)
    critic = MegatronCritic(value_model, section, total_steps=env.total_steps, **env.trainable)
    swap = RoleSwap("critic", lambda: training_state_tensors(critic.chunks, critic.optimizer),
                    env.ledger, env.pin)
    return critic, swap


def build_reward_model(section, env: RoleEnv, rm_arch):
    """A frozen scalar-head reward model (``reward_config``) of ``rm_arch``
    (`reward_model_architecture`); offloaded between its phases. Returns (model, swap)."""
    from mindspeed_rl.checkpoint.weight_source import load_value_weights

    rm = _scalar_head_model(rm_arch, env.model_options, seed=env.seed)
    load_value_weights(rm, rm_arch, section.load, require_score_head=True)
    rm.requires_grad_(False)
    swap = RoleSwap("reward_model", lambda: {"param": list(rm.parameters())}, env.ledger,
                    env.pin)
    return rm, swap


def _scalar_head_model(arch, model_options: dict, seed: int, head_std: float | None = None):
    """A GPT whose last stage outputs one value per position (critic, reward model)."""
    from mindspeed_rl.models.builder import build_transformer_config
    from mindspeed_rl.models.value_head import build_value_model

    config = build_transformer_config(arch, calculate_per_token_loss=True, **model_options)
    return build_value_model(arch, config, head_seed=seed, head_std=head_std)


def reward_model_architecture(rm_dir: str, actor_arch, actor_dir: str):
    """The reward model's architecture, refused when its vocabulary or tokenizer differs
    from the actor's (its scores would read other tokens than the policy wrote) or its
    checkpoint holds no scalar score head. Reads files only (config, tokenizers, tensor
    headers), so a bad reward model is refused before vLLM and the actor are built."""
    from mindspeed_rl.checkpoint.weight_source import check_score_head
    from mindspeed_rl.models.builder import describe_hf_dir

    if not os.path.isfile(os.path.join(rm_dir, "config.json")):
        raise ValueError(f"reward_config.load={rm_dir}: no config.json; point it to an HF "
                         "*ForSequenceClassification directory or a checkpoint converted "
                         "from one by tools/convert_ckpt.py")
    rm_arch = describe_hf_dir(rm_dir)
    if rm_arch.vocab_size != actor_arch.vocab_size:
        raise ValueError(
            f"reward_config.load={rm_dir}: vocabulary of {rm_arch.vocab_size} tokens, but the "
            f"actor's has {actor_arch.vocab_size}; the reward model must share the actor's "
            "tokenizer")
    if any(Path(rm_dir).glob("tokenizer*")):
        from transformers import AutoTokenizer

        if AutoTokenizer.from_pretrained(rm_dir).get_vocab() != \
                AutoTokenizer.from_pretrained(actor_dir).get_vocab():
            raise ValueError(f"reward_config.load={rm_dir}: its tokenizer maps tokens to other "
                             f"ids than the actor's ({actor_dir}); use a reward model trained "
                             "with the actor's tokenizer")
    check_score_head(rm_dir, rm_arch.transformer_config_kwargs["hidden_size"])
    return rm_arch
