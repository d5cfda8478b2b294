"""Every RL role of this rank, built from its config section.

All roles live on every rank (co-located SPMD): the actor (megatron training
engine + vLLM rollout engine + the resharder between them), and, as the config
asks, the frozen reference, the PPO critic and a reward model, all in the
actor's training layout. Roles that are idle sit on the host; one byte ledger
(the resharder's) counts every role's device bytes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from mindspeed_rl.resharding.swap import StateSwapper, training_state_tensors
from mindspeed_rl.trainer.actor import MegatronActor, build_policy_model
from mindspeed_rl.trainer.critic import MegatronCritic


class RoleSwap:
    """Keeps a role's tensors on the host except inside :meth:`resident`.

    ``collect()`` returns the role's tensors by kind (e.g. params, grads, optimizer
    state); it is called again after each residency, since Adam creates its
    moments at the first step.
    """

    def __init__(self, name: str, collect: Callable[[], dict[str, list[torch.Tensor]]], ledger,
                 pin_memory: bool) -> None:
        self.name, self.collect = name, collect
        self.swapper = StateSwapper(ledger, pin_memory=pin_memory)
        self._refresh_and_offload()

    def _refresh_and_offload(self) -> None:
        tensors = {f"{self.name}_{kind}": t for kind, t in self.collect().items()}
        self.swapper.refresh(tensors)
        self.roles = list(tensors)
        self.swapper.offload(self.roles)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        self.swapper.onload(self.roles)
        try:
            yield
        finally:
            self._refresh_and_offload()


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
        self.rollout.shutdown()


def build_roles(config, plan, platform, arch, model_dir: str, *, start) -> Roles:
    """Build this rank's roles for ``config`` (megatron's parallel state must exist).

    ``start`` is the actor's initial `WeightSource` (``weight_source.actor_start``), or
    None when the run resumes from a trainer checkpoint (loaded afterwards by the trainer).
    """
    from mindspeed_rl.checkpoint import weight_source
    from mindspeed_rl.models.training_options import training_model_options
    from mindspeed_rl.resharding import Resharder
    from mindspeed_rl.rollout import RolloutEngine

    mt, rl, gen = config.megatron_training, config.rl_config, config.generate_config
    dtype = torch.bfloat16 if mt.bf16 else torch.float32
    b = plan.batch
    trainable = dict(use_distributed_optimizer=mt.use_distributed_optimizer, bf16=mt.bf16,
                     max_consecutive_skipped_steps=rl.max_consecutive_skipped_steps)
    model_options = dict(params_dtype=dtype, sequence_parallel=mt.sequence_parallel,
                         **training_model_options(config))
    pin = platform.device_type != "cpu"

    policy = build_policy_model(arch, **model_options)
    if start is not None:
        weight_source.load_weights(policy, arch, start)
    actor = MegatronActor(policy, config.actor_config,
                          total_steps=mt.train_iters * b.optimizer_steps_per_iteration,
                          **trainable)
    rollout = RolloutEngine.from_config(config, model_dir, device_type=platform.device_type)
    resharder = Resharder(
        model=policy, model_chunks=actor.chunks, optimizer=actor.optimizer, engine=rollout,
        weight_map=arch.weight_map, bucket_bytes=int(gen.resharding_bucket_mb * 2**20),
        platform=platform, offload_train_param=gen.offload_train_param,
        offload_train_grad=gen.offload_train_grad,
        offload_train_optimizer=gen.offload_train_optimizer)
    roles = Roles(actor=actor, rollout=rollout, resharder=resharder)
    ledger = resharder.ledger

    if rl.init_kl_coef:
        # The reference stays the policy the run started from, also when it resumes
        # (ref_config.load, else the start recorded in the checkpoint).
        ref = build_policy_model(arch, **model_options)
        roles.reference_source = weight_source.reference_start(
            config.ref_config.load, start,
            weight_source.recorded_start(config.actor_config.load) if start is None else None)
        if roles.reference_source is start:
            with torch.no_grad():
                for p_ref, p in zip(ref.parameters(), policy.parameters()):
                    p_ref.copy_(p)
        else:
            weight_source.load_weights(ref, arch, roles.reference_source)
        ref.requires_grad_(False)
        roles.reference = ref
        roles.reference_swap = RoleSwap("ref", lambda: {"param": list(ref.parameters())},
                                        ledger, pin)

    if config.critic_config is not None:
        from mindspeed_rl.checkpoint.weight_source import load_value_weights

        cc = config.critic_config
        value_model = _scalar_head_model(arch, model_options, seed=mt.seed,
                                         head_std=cc.value_head_init_std)
        if start is not None:
            if cc.load is None and start.kind == weight_source.LEGACY:
                raise ValueError(f"critic_config.load: the critic cannot start from the legacy "
                                 f"Megatron checkpoint {start.path}; convert it "
                                 "(tools/convert_ckpt.py) or set critic_config.load")
            load_value_weights(value_model, arch, cc.load or start.path,
                               require_score_head=False)
        critic = MegatronCritic(value_model, cc,
                                total_steps=mt.train_iters * b.optimizer_steps_per_iteration,
                                **trainable)
        roles.critic = critic
        roles.critic_swap = RoleSwap(
            "critic", lambda: training_state_tensors(critic.chunks, critic.optimizer), ledger,
            pin)

    if config.reward_config is not None:
        from mindspeed_rl.checkpoint.weight_source import load_value_weights

        rc = config.reward_config
        rm_arch = reward_model_architecture(rc.load, arch, model_dir)
        rm = _scalar_head_model(rm_arch, model_options, seed=mt.seed)
        load_value_weights(rm, rm_arch, rc.load, require_score_head=True)
        rm.requires_grad_(False)
        roles.reward_model = rm
        roles.reward_model_swap = RoleSwap("reward_model",
                                           lambda: {"param": list(rm.parameters())}, ledger, pin)
    return roles


def _scalar_head_model(arch, model_options: dict, seed: int, head_std: float | None = None):
    """A GPT whose last stage outputs one value per position (critic, reward model)."""
    from mindspeed_rl.models.builder import build_transformer_config
    from mindspeed_rl.models.value_head import build_value_model

    config = build_transformer_config(arch, calculate_per_token_loss=True, **model_options)
    return build_value_model(arch, config, head_seed=seed, head_std=head_std)


def reward_model_architecture(rm_dir: str, actor_arch, actor_dir: str):
    """The reward model's architecture, refused when its vocabulary or tokenizer differs
    from the actor's (its scores would read other tokens than the policy wrote)."""
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
    return rm_arch
