"""What a phase receives: a small context, not the trainer.

A phase is ``phase(ctx: PhaseContext) -> metrics``. The context holds the job's config
and batch plan, the roles, the data, this rank's place in the two layouts, the sample
flow bound to the phase's own name, the trainer's persistent counters and the
iteration's mutable state. A phase changes nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from mindspeed_rl.algorithms import KLController
from mindspeed_rl.data import PromptDataset, slice_per_dp_rank
from mindspeed_rl.transfer_dock import DockBatch

if TYPE_CHECKING:  # types only: importing them here would load megatron and transformers
    from transformers import PreTrainedTokenizerBase

    from mindspeed_rl.config import RLJobConfig
    from mindspeed_rl.config.plan import Plan
    from mindspeed_rl.rewards import RewardPool
    from mindspeed_rl.trainer.roles import Roles


@dataclass
class TrainerState:
    """What the trainer itself counts across iterations (models and data keep their own
    state); saved in every checkpoint."""

    iteration: int = 0  # iterations completed
    groups_generated: int = 0  # prompts rolled out so far: the next group_id
    kl_ctrl: KLController = field(default_factory=lambda: KLController(0.0))


@dataclass
class IterationState:
    """One iteration's mutable state, shared by its phases.

    Generation runs in rounds: the skeleton repeats the algorithm's round phases
    (reshard, rollout, reward, ...) until the batch is ready. A round-closing phase (DAPO's
    dynamic sampling) sets ``batch_ready = False`` to ask for another round on fresh
    prompts and tallies the groups of the rounds so far in ``groups``.
    """

    iteration: int
    generation_round: int = 0
    batch_ready: bool = True
    groups: RoundGroups = field(default_factory=lambda: RoundGroups())


@dataclass
class RoundGroups:
    """The groups the generation rounds of one iteration produced, in generation order and
    the same on every rank: ``(group_id, row ids)`` kept for training or dropped."""

    kept: list[tuple[int, list[int]]] = field(default_factory=list)
    dropped: list[tuple[int, list[int]]] = field(default_factory=list)
    generated: int = 0


@dataclass(frozen=True)
class Ranks:
    """This rank in the world and in the generation layout."""

    rank: int
    world: int
    gen_dp_rank: int  # which vLLM instance
    is_gen_writer: bool  # the first rank of its vLLM instance: it puts the rollout's rows


class BoundFlow:
    """The sample flow as one phase sees it: gets and puts under the phase's own name
    (checked against the column contract by ``SampleFlow``)."""

    def __init__(self, flow, phase: str) -> None:
        self._flow, self.phase = flow, phase

    def get(self, columns: Sequence[str], rows_per_dp_rank: int, layout: str, *,
            consumer: str | None = None, whole_groups: bool = False,
            candidates: Sequence[int] | None = None) -> DockBatch | None:
        return self._flow.get(self.phase, columns, rows_per_dp_rank, layout, consumer=consumer,
                              whole_groups=whole_groups, candidates=candidates)

    def put(self, batch: DockBatch | None, columns) -> None:
        self._flow.put(self.phase, batch, columns)

    def put_rows(self, columns, *, group_size: int, held: bool = False,
                 tags=None) -> list[int]:
        return self._flow.put_rows(self.phase, columns, group_size=group_size, held=held,
                                   tags=tags)

    def next_row_id(self) -> int:
        """The id the dock's next new row gets (the same on every rank)."""
        return self._flow.dock.next_row_id

    def rows(self, *, held: bool | None = None):
        """The dock's rows (replicated metadata): all, or only those held (``held=True``:
        partial rollout's carried rows) or not held."""
        return self._flow.dock.rows(held=held)

    def tags(self, tag: str, rows):
        """A per-row tag of ``rows`` (replicated metadata: group, birth pass, ...)."""
        return self._flow.dock.tags(tag, rows)

    def release(self, rows: Sequence[int]) -> None:
        """Held rows become visible to their consumers (partial rollout: finished groups)."""
        self._flow.dock.release(rows)

    def carries(self, column: str) -> bool:
        """Whether this algorithm's flow keeps ``column`` (some phase writes it and another
        reads it)."""
        return column in self._flow.active

    def retire(self, rows: Sequence[int]) -> None:
        self._flow.retire(rows)

    def note(self, key: str, rows: Sequence[int]) -> None:
        """Record ``rows`` under ``key`` in the sample-flow trace (when tracing)."""
        if self._flow.trace is not None:
            self._flow.trace[key] = list(rows)


@dataclass(frozen=True)
class PhaseContext:
    """Everything a phase may read, and the two states it may change."""

    config: RLJobConfig
    plan: Plan  # layout and batch sizes
    roles: Roles
    train_data: PromptDataset
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    ranks: Ranks
    flow: BoundFlow
    state: TrainerState
    it: IterationState
    reward_pool: RewardPool | None = None  # the verifiers' worker processes

    @property
    def rl(self):
        return self.config.rl_config

    @property
    def features(self):
        """The optional parts of the loop this job runs (``config/features.py``)."""
        return self.config.features

    @property
    def estimator(self):
        """The job's advantage estimator (``rl_config.adv_estimator``)."""
        from mindspeed_rl.algorithms import registry

        return registry.estimator(self.rl.adv_estimator)

    @property
    def batch(self):
        """The batch plan: rows per DP rank, mini-batches, micro-batching per phase."""
        return self.plan.batch

    @property
    def temperature(self) -> float:
        """The sampling temperature of the policy that generated the rows."""
        return self.config.sampling_config.policy_temperature

    def take_round_prompts(self) -> tuple[list[int], int, list[int]]:
        """This generation-DP rank's share of the round's fresh prompts: (dataset indices,
        the group id of the first, one seed per prompt). One seed per (iteration,
        generation round, prompt of the batch): a resumed run samples what the
        uninterrupted run sampled. Advances the data and the group counter."""
        me, dp_g = self.ranks, self.plan.layout.infer_data_parallel_size
        indices = self.train_data.next_indices(self.batch.prompts_per_generation_round)
        mine = slice_per_dp_rank(indices, me.gen_dp_rank, dp_g)
        first = me.gen_dp_rank * len(mine)  # this rank's first prompt within the batch
        first_group = self.state.groups_generated + first
        self.state.groups_generated += len(indices)
        seed = self.config.megatron_training.seed
        seeds = [(seed * 1_000_003 + self.it.iteration * 10_007
                  + self.it.generation_round * 1_000_033 + first + i) % 2**31
                 for i in range(len(mine))]
        return mine, first_group, seeds
