"""The sample-flow contract: every TransferDock column, who writes it and who reads it.

One table, read by the trainer (a phase may only put the columns it produces and
get the columns it consumes), by the contract check below, and by
``benchmarks/bench_transfer_dock.py``, which replays exactly these columns. The
row metadata a later partial rollout needs is already here: the rollout
log-probs, the ``finish_reason``, the ``weight_version`` that generated each row
and its ``group_id`` / ``sample_idx``.

Shapes are per row: ``[P]`` prompt tokens, ``[R]`` response tokens, ``[V]`` one value per
verifier, ``[]`` one value, ``[T, L, k]`` for each of the row's first T = P + R - 1 tokens,
each MoE layer, the top-k experts. A column tagged with a feature
(``mindspeed_rl/config/features.py``) is stored only when the job has it on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.config.features import MULTI_TURN, PARTIAL_ROLLOUT, ROUTER_REPLAY


class ContractError(RuntimeError):
    """A phase or an algorithm that breaks the column contract."""


@dataclass(frozen=True)
class Column:
    name: str
    dtype: torch.dtype
    shape: str  # "[P]", "[R]", "[V]", "[]" or "[T, L, k]"
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    doc: str
    feature: str = ""  # stored only when this feature is on (e.g. "partial_rollout")
    other_dtypes: tuple[torch.dtype, ...] = ()  # also accepted (a larger integer type)

    @property
    def ndim(self) -> int:
        return 0 if self.shape == "[]" else self.shape.count(",") + 1

    def accepts(self, dtype: torch.dtype) -> bool:
        return dtype == self.dtype or dtype in self.other_dtypes


# finish_reason codes (vLLM's finish reasons; "partial" is reserved for rows whose
# generation stopped at a token budget and continues in a later iteration).
FINISH_REASONS = ("stop", "length", "abort", "partial")

_FORWARDS = (names.REWARD_MODEL, names.VALUES, names.OLD_LOG_P, names.REFERENCE_MODEL,
             names.TEACHER_MODEL)
# A rollout that carries rows (partial rollout) reads back the unfinished rows it wrote.
_R = (names.ROLLOUT,)
_PAIRS = (names.PAIRS,)  # DPO: the pairs of the data set, two rows per pair
COLUMNS: dict[str, Column] = {c.name: c for c in (
    Column("prompt_ids", torch.int64, "[P]", _R + _PAIRS,
           _R + _FORWARDS + (names.CRITIC_UPDATE, names.UPDATE, names.PREFERENCE_UPDATE),
           "prompt token ids"),
    Column("response_ids", torch.int64, "[R]", _R + _PAIRS,
           _R + (names.REWARD, names.ADV, names.DISCOUNTED_RETURNS, names.GAE, names.DISTILL_ADV)
           + _FORWARDS
           + (names.CRITIC_UPDATE, names.UPDATE, names.PREFERENCE_UPDATE),
           "response token ids (the reward decodes them; the advantage phases take their "
           "length; DPO: the chosen or the rejected response)"),
    Column("logprobs_rollout", torch.float32, "[R]", _R, _R + (names.UPDATE,),
           "the rollout engine's log-prob of each sampled token: the behaviour policy "
           "(rollout-training mismatch, off-policy correction)"),
    Column("token_versions", torch.int64, "[R]", _R, _R + (names.UPDATE,),
           "partial rollout: the weight version that generated each response token (a "
           "response continued across iterations mixes versions)", PARTIAL_ROLLOUT),
    Column("response_mask", torch.int64, "[R]", _R,
           _R + (names.ADV, names.DISTILL_ADV, names.UPDATE),
           "multi-turn: 1 on the model's own tokens, 0 on tool responses and template glue "
           "(the loss, its token counts, KL and entropy cover only the 1s)", MULTI_TURN),
    Column("routed_experts", torch.uint8, "[T, L, k]", _R + (names.OLD_LOG_P,),
           _R + (names.OLD_LOG_P, names.REFERENCE_MODEL, names.UPDATE),
           "routing replay: the experts each token was routed to in each MoE layer (R3: by "
           "vLLM during rollout, carried across partial-rollout segments and turns; R2: by "
           "the old-log-prob pass), replayed by the passes that read it; uint8, or int16 / "
           "int32 for more than 256 experts", ROUTER_REPLAY, (torch.int16, torch.int32)),
    Column("tool_calls", torch.int64, "[]", _R, _R + (names.REWARD,),
           "multi-turn: tool calls the trajectory made (retool_reward's bonus)", MULTI_TURN),
    Column("prompt_index", torch.int64, "[]", _R, _R + (names.REWARD,),
           "the prompt's index in the training dataset (its gold answer for the verifiers)"),
    Column("finish_reason", torch.int64, "[]", _R, _R + (names.REWARD,),
           f"index into {FINISH_REASONS} (truncated responses are counted)"),
    Column("weight_version", torch.int64, "[]", _R, _R + (names.UPDATE,),
           "actor optimizer steps when the row's first token was generated (on-policy check)"),
    Column("birth_iteration", torch.int64, "[]", _R, _R + (names.UPDATE,),
           "partial rollout: the iteration whose rollout started the row (its age when "
           "trained)", PARTIAL_ROLLOUT),
    Column("num_segments", torch.int64, "[]", _R, _R + (names.UPDATE,),
           "partial rollout: rollout passes that generated the row's tokens", PARTIAL_ROLLOUT),
    Column("group_id", torch.int64, "[]", _R + _PAIRS,
           _R + (names.DYNAMIC_SAMPLING, names.ADV, names.PREFERENCE_UPDATE),
           "unique id of the prompt's group of n samples (grows across iterations; DPO: "
           "of the pair)"),
    Column("sample_idx", torch.int64, "[]", _R + _PAIRS, _R + (names.ADV,
                                                               names.PREFERENCE_UPDATE),
           "which of the n samples of its group the row is (DPO: 0 chosen, 1 rejected)"),
    Column("rm_scores", torch.float32, "[]", (names.REWARD_MODEL,), (names.REWARD,),
           "the reward model's score of the whole response"),
    Column("rewards", torch.float32, "[]", (names.REWARD,),
           (names.DYNAMIC_SAMPLING, names.ADV, names.DISCOUNTED_RETURNS, names.GAE,
            names.DISTILL_ADV),
           "sequence reward: weighted verifiers (+ weighted reward-model score, overlong "
           "penalty)"),
    Column("verifier_scores", torch.float32, "[V]", (names.REWARD,), (names.DYNAMIC_SAMPLING,),
           "each rl_config.verifier_function's unweighted score"),
    Column("values", torch.float32, "[R]", (names.VALUES,), (names.GAE, names.CRITIC_UPDATE),
           "the critic's value before each response token"),
    Column("logprobs_old", torch.float32, "[R]", (names.OLD_LOG_P,),
           (names.DISCOUNTED_RETURNS, names.GAE, names.DISTILL_ADV, names.UPDATE),
           "the actor's log-probs before this iteration's first optimizer step"),
    Column("logprobs_ref", torch.float32, "[R]", (names.REFERENCE_MODEL,),
           (names.DISCOUNTED_RETURNS, names.GAE, names.UPDATE, names.PREFERENCE_UPDATE),
           "the reference model's log-probs (KL; DPO's reference term)"),
    Column("logprobs_teacher", torch.float32, "[R]", (names.TEACHER_MODEL,), (names.DISTILL_ADV,),
           "on-policy distillation: the teacher's log-probs of the sampled tokens"),
    Column("advantages", torch.float32, "[R]", (names.ADV, names.DISCOUNTED_RETURNS, names.GAE,
                                                names.DISTILL_ADV),
           (names.UPDATE,),
           "per-token advantages"),
    Column("returns", torch.float32, "[R]", (names.GAE,), (names.CRITIC_UPDATE,),
           "the critic's regression targets (GAE returns)"),
)}


def check_contract(phases_per_algorithm: dict[str, Sequence[str]],
                   columns: Iterable[Column] = COLUMNS.values()) -> None:
    """Refuse a contract with a column nobody writes or reads, a phase name no algorithm
    runs, or an algorithm in which a phase reads a column only a later phase writes."""
    columns = list(columns)
    known = {p for phases in phases_per_algorithm.values() for p in phases}
    for col in columns:
        if not col.producers:
            raise ContractError(f"column {col.name!r} has no producer phase")
        if not col.consumers:
            raise ContractError(f"column {col.name!r} has no consumer phase: nothing reads it")
        unknown = sorted(set(col.producers + col.consumers) - known)
        if unknown:
            raise ContractError(f"column {col.name!r} names phases {unknown} that no algorithm "
                                "runs")
    for algorithm, phases in phases_per_algorithm.items():
        order = {p: i for i, p in enumerate(phases)}
        for col in columns:
            written = [order[p] for p in col.producers if p in order]
            read = [p for p in col.consumers if p in order]
            # a phase may read back what it wrote itself (a partial rollout's later passes)
            read = [p for p in read if p not in col.producers]
            if written and read and min(order[p] for p in read) <= min(written):
                first = min(read, key=order.get)
                raise ContractError(f"{algorithm}: phase {first!r} reads column {col.name!r} "
                                    "before any phase writes it")


def active_columns(phases: Sequence[str], columns: dict[str, Column] = COLUMNS,
                   features: Sequence[str] = ()) -> set[str]:
    """The columns an algorithm stores: written by one of its phases and read by another.
    With the ``partial_rollout`` feature on, the rollout also reads back what it wrote,
    and the columns of a feature are stored only when it is on."""
    running = set(phases)
    rereads = set(_R) if PARTIAL_ROLLOUT in features else set()
    return {name for name, col in columns.items()
            if (not col.feature or col.feature in features)
            and running & set(col.producers)
            and running & (set(col.consumers) - (set(col.producers) - rereads))}


def markdown_table(columns: dict[str, Column] = COLUMNS) -> str:
    """The contract as the markdown table of docs/trainer.md (a test keeps them equal)."""
    lines = ["| column | dtype, shape per row | producers | consumers | what |",
             "| --- | --- | --- | --- | --- |"]
    for col in columns.values():
        dtype = str(col.dtype).removeprefix("torch.")
        lines.append(f"| `{col.name}` | {dtype} {col.shape} | {', '.join(col.producers)} | "
                     f"{', '.join(col.consumers)} | {col.doc} |")
    return "\n".join(lines) + "\n"
