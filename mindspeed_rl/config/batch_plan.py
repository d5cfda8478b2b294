"""The runtime batch plan: the sizes one iteration has on each data-parallel rank, and how
each phase groups its rows into micro-batches.

The trainer and the engines read their sizes from here (`BatchPlan`, `MicroBatching`); the
dry run prints them (`config/plan.py`). `packing_budgets` names the phases of a job that
run megatron micro-batches, and the ``rl_config`` token budget each one reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.config.schema import RLJobConfig
from mindspeed_rl.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class MicroBatching:
    """How one phase groups its rows into micro-batches (``rl_config.use_dynamic_bsz``,
    ``max_packing_token_size``, ``dynamic_max_batch_size``, ``use_remove_padding``).

    Args:
        micro_batch_size: rows per micro-batch when ``max_tokens`` is None.
        max_tokens: the token budget of one micro-batch (``use_dynamic_bsz``): packed,
            the sum of its rows' lengths; padded, rows x its longest row. None = fixed
            ``micro_batch_size`` rows, padded to the longest row of the batch.
        max_rows: at most this many rows in a token-budget micro-batch; None = no cap.
        packed: concatenate each micro-batch's rows into one sequence.
        similar_lengths: with ``packed`` and a token budget, group rows of similar length
            (the padded plan's groups) instead of balancing real tokens: where attention
            lays a packed sequence's rows side by side, padded to its longest row (the
            ``rows`` backend, e.g. on CPU), one long row among many short ones costs as
            many rows of its length. Set by the schedule from the model, not by a key.
    """

    micro_batch_size: int = 1
    max_tokens: int | None = None
    max_rows: int | None = None
    packed: bool = False
    similar_lengths: bool = False

    @property
    def dynamic(self) -> bool:
        return self.max_tokens is not None

    @classmethod
    def of(cls, micro_batching: "int | MicroBatching") -> "MicroBatching":
        """A plain int means the fixed layout with that ``micro_batch_size``."""
        if isinstance(micro_batching, MicroBatching):
            return micro_batching
        return cls(micro_batch_size=int(micro_batching))

    def describe(self) -> str:
        if self.dynamic:
            text = f"<= {self.max_tokens:,} tokens"
            if self.max_rows:
                text += f", <= {self.max_rows} rows"
        else:
            text = f"{self.micro_batch_size} rows"
        return text + (", packed" if self.packed else ", padded")


# (phase, rl_config prefix of its token budget and row cap)
_MICRO_BATCH_PHASES = ((names.UPDATE, "update_"), (names.PREFERENCE_UPDATE, "update_"),
                       (names.OLD_LOG_P, "actor_"),
                       (names.REFERENCE_MODEL, "ref_"), (names.CRITIC_UPDATE, "update_"),
                       (names.VALUES, ""), (names.REWARD_MODEL, ""))


def micro_batchings(config: RLJobConfig) -> dict[str, MicroBatching]:
    """Each phase's :class:`MicroBatching` (only the phases the job can run)."""
    rl, critic, reward = config.rl_config, config.critic_config, config.reward_config
    rows = {names.UPDATE: config.actor_config.micro_batch_size,
            # DPO: micro_batch_size pairs (the engine keeps each pair's two rows together)
            names.PREFERENCE_UPDATE: config.actor_config.micro_batch_size,
            names.OLD_LOG_P: rl.actor_forward_micro_batch_size,
            names.REFERENCE_MODEL: rl.ref_forward_micro_batch_size}
    if critic is not None:
        rows.update({names.CRITIC_UPDATE: critic.micro_batch_size,
                     names.VALUES: rl.critic_forward_micro_batch_size})
    if reward is not None:
        rows[names.REWARD_MODEL] = reward.micro_batch_size
    out = {}
    for phase, prefix in _MICRO_BATCH_PHASES:
        if phase not in rows:
            continue
        budget = getattr(rl, f"{prefix}max_packing_token_size") or rl.max_packing_token_size
        cap = getattr(rl, f"{prefix}dynamic_max_batch_size") or rl.dynamic_max_batch_size
        out[phase] = MicroBatching(micro_batch_size=rows[phase],
                                   max_tokens=budget if rl.use_dynamic_bsz else None,
                                   max_rows=cap if rl.use_dynamic_bsz else None,
                                   packed=rl.use_remove_padding)
    return out


def longest_prompt(config: RLJobConfig) -> tuple[str, int]:
    """The longest prompt a rollout gets and the key that bounds it: rl_config.
    max_prompt_length, or megatron_training.seq_length when shorter (prompts are cut to it,
    as MindSpeed-RL reads its prompt data)."""
    seq, prompt = config.megatron_training.seq_length, config.rl_config.max_prompt_length
    if 0 < seq < prompt:
        return "megatron_training.seq_length", seq
    return "rl_config.max_prompt_length", prompt


def longest_row(config: RLJobConfig) -> int:
    """Tokens of the longest rollout row: the longest prompt + the response limit, at most
    generate_config.max_model_len (vLLM stops a response there)."""
    return min(longest_prompt(config)[1] + config.features.response_limit,
               config.generate_config.max_model_len)


def packing_budgets(config: RLJobConfig) -> dict[str, str]:
    """The phases that run megatron micro-batches in this job -> the prefix of their
    ``rl_config.<prefix>max_packing_token_size`` ("" = the base budget only): the actor's
    update (and the critic's), the old log-prob forward when it runs, the reference forward
    when there is a reference model, the critic's values and the reward model."""
    runs = config.features.phases
    return {phase: prefix for phase, prefix in _MICRO_BATCH_PHASES if phase in runs}


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of one iteration, for every phase (exact counts).

    The trainer reads its sizes from here and nowhere else; ``--dry-run`` prints them.
    "Responses" are rows of the TransferDock (one prompt's sample each).
    """

    prompts_per_iteration: int                # trained on (global_batch_size)
    responses_per_iteration: int
    prompts_per_generation_round: int         # generated per round (rl_config.gen_batch_size)
    prompts_per_generation_dp_rank: int       # per round
    responses_per_generation_dp_rank: int     # per round
    kept_responses_per_generation_dp_rank: int  # after dynamic sampling (the trained rows)
    responses_per_training_dp_rank: int
    mini_batches_per_epoch: int
    optimizer_steps_per_iteration: int
    responses_per_mini_batch_per_training_dp_rank: int
    micro_batches_per_mini_batch: int
    old_logprob_micro_batches_per_training_dp_rank: int
    ref_logprob_micro_batches_per_training_dp_rank: int
    critic_micro_batches_per_mini_batch: int            # 0 without a critic
    value_micro_batches_per_training_dp_rank: int       # 0 without a critic
    # phase -> its micro-batch layout; with use_dynamic_bsz the counts above are the
    # fixed-size ones and the real counts depend on the rows' lengths.
    micro_batching: dict[str, MicroBatching] = field(default_factory=dict)

    @classmethod
    def of(cls, config: RLJobConfig, layout: ParallelLayout) -> "BatchPlan":
        mt, rl = config.megatron_training, config.rl_config
        gbs, n, mini = mt.global_batch_size, rl.n_samples_per_prompt, rl.mini_batch_size
        dp, dp_g = layout.data_parallel_size, layout.infer_data_parallel_size
        per_dp = gbs * n // dp
        critic = config.critic_config
        gen = rl.gen_batch_size or gbs
        return cls(
            prompts_per_iteration=gbs,
            responses_per_iteration=gbs * n,
            prompts_per_generation_round=gen,
            prompts_per_generation_dp_rank=gen // dp_g,
            responses_per_generation_dp_rank=gen // dp_g * n,
            kept_responses_per_generation_dp_rank=gbs // dp_g * n,
            responses_per_training_dp_rank=per_dp,
            mini_batches_per_epoch=gbs // mini,
            optimizer_steps_per_iteration=gbs // mini * rl.epochs,
            responses_per_mini_batch_per_training_dp_rank=mini * n // dp,
            # DPO's micro_batch_size counts pairs (two rows each)
            micro_batches_per_mini_batch=mini * n // (
                dp * config.actor_config.micro_batch_size * (n if config.features.pairs else 1)),
            old_logprob_micro_batches_per_training_dp_rank=-(
                -per_dp // rl.actor_forward_micro_batch_size),
            ref_logprob_micro_batches_per_training_dp_rank=-(
                -per_dp // rl.ref_forward_micro_batch_size),
            critic_micro_batches_per_mini_batch=(
                mini * n // (dp * critic.micro_batch_size) if critic else 0),
            value_micro_batches_per_training_dp_rank=(
                -(-per_dp // rl.critic_forward_micro_batch_size) if critic else 0),
            micro_batching=micro_batchings(config),
        )

    @property
    def needs_old_logprobs(self) -> bool:
        """More than one optimizer step per iteration: after the first step the policy is no
        longer the one that generated the rows, so the update needs their old log-probs."""
        return self.optimizer_steps_per_iteration > 1
