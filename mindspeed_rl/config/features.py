"""The optional parts of the RL loop a job runs, decided once from its config.

Code that behaves differently when a feature is on asks ``config.features`` (a `Features`,
computed by :func:`features`) instead of reading the switches again: the sample flow and
the column contract (which columns are stored), the trainer (which phases run, how the
rollout is composed), the engines and the checks. Each feature is declared here once:
the keys that turn it on, and the optional phases it needs.

| feature | turned on by | adds |
| --- | --- | --- |
| ``partial_rollout`` | ``rl_config.partial_rollout_max_split`` N > 1 | rows carried in the dock across iterations |
| ``multi_turn`` | ``rl_config.multi_turn_enable`` | tool turns between the model's turns |
| ``stepwise`` | ``rl_config.async_engine`` (with partial rollout or tools) | step-wise decoding |
| ``router_replay`` | ``rl_config.router_replay`` R2 / R3 | the routes column, replayed by the passes |
| ``dynamic_sampling`` | ``rl_config.filter_groups_enable`` | the dynamic_sampling phase |
| ``reward_model`` | a ``reward_config`` section | the reward_model phase |
| ``reference`` | ``rl_config.init_kl_coef`` != 0, or the family (DPO) | the reference_model phase |
| ``kl_in_reward`` | ``rl_config.use_kl_in_reward`` (with a reference) | old_log_p: the KL in the reward |
| ``multi_step`` | ``mini_batch_size`` < ``global_batch_size`` or ``epochs`` > 1 | old_log_p |
| ``rollout_is_batch_normalize`` | ``rl_config.rollout_is_batch_normalize`` | old_log_p |
| ``pairs`` | the family (DPO) | rows are preference pairs read from the data, no rollout |

The phases an algorithm runs are its family's list (``mindspeed_rl/algorithms/``), with
its estimator's advantage phase, less the optional phases (``OPTIONAL_PHASES``) that
neither a feature nor the estimator asks for (:attr:`Features.phases`).

Pure Python: reads the config and the algorithm registry only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.algorithms import registry

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig

# Column tags (``trainer/columns.py``): a column of a feature is stored only when it is on.
PARTIAL_ROLLOUT = "partial_rollout"
MULTI_TURN = "multi_turn"
ROUTER_REPLAY = "router_replay"

# The optional phases each feature needs. A phase in OPTIONAL_PHASES runs only when a
# feature of the job (or its estimator, ``Estimator.needs_phases``) asks for it.
NEEDS: dict[str, tuple[str, ...]] = {
    "reward_model": (names.REWARD_MODEL,),
    "dynamic_sampling": (names.DYNAMIC_SAMPLING,),
    "reference": (names.REFERENCE_MODEL,),
    # After the first optimizer step the policy is no longer the one that generated the
    # rows: the update needs their log-probs at the iteration's start.
    "multi_step": (names.OLD_LOG_P,),
    # The per-token reward reads the KL of the old log-probs to the reference.
    "kl_in_reward": (names.OLD_LOG_P,),
    # The batch mean of the IS weights is taken before the update's first step.
    "rollout_is_batch_normalize": (names.OLD_LOG_P,),
    # R2: the old-log-prob pass records the routes every update micro-step replays.
    "router_replay_r2": (names.OLD_LOG_P,),
}
OPTIONAL_PHASES = frozenset({names.REWARD_MODEL, names.DYNAMIC_SAMPLING, names.OLD_LOG_P,
                             names.REFERENCE_MODEL, names.TEACHER_MODEL})

FRESH, CARRIED = "fresh prompts", "carried rows"
SINGLE_TURN, TOOL_TURNS = "single turn", "tool turns"
ONE_PASS, TOKEN_BUDGET, STEPWISE = "one pass", "per-pass token budget", "step-wise"


@dataclass(frozen=True)
class RolloutComposition:
    """How the rollout phase is composed: a source of rows x a continuation x a scheduler
    (``mindspeed_rl/trainer/rollout_parts/`` builds one part of each from these names).

    - source: ``fresh prompts`` (the round's prompts, n rows each, released after the
      pass) or ``carried rows`` (partial rollout: a pool of rows held in the dock,
      continued pass after pass, released as whole finished groups);
    - continuation: ``single turn`` (one model turn) or ``tool turns`` (the agent loop);
    - scheduler: ``one pass`` (every row to its end), ``per-pass token budget`` (at most
      ``pass_tokens`` new model tokens per row and pass) or ``step-wise`` (decoded step by
      step; with carried rows a pass stops once enough whole groups are finished).
    """

    source: str
    continuation: str
    scheduler: str
    max_split: int = 1           # partial_rollout_max_split (carried rows)
    pass_tokens: int | None = None  # per-pass token budget
    note: str = ""               # why the scheduler is what it is, when a key was overridden

    def describe(self) -> str:
        """One line for the plan, e.g. ``rollout: carried rows (N = 2: ...) x tool turns x
        a per-pass budget of 64 tokens``."""
        source = self.source
        if self.source == CARRIED:
            source += (f" (partial_rollout_max_split N = {self.max_split}: a row finishes "
                       f"within {self.max_split} passes and is trained at most "
                       f"{self.max_split - 1} iteration(s) after its first token)")
        scheduler = (f"a per-pass budget of {self.pass_tokens} tokens"
                     if self.scheduler == TOKEN_BUDGET else self.scheduler)
        if self.scheduler == STEPWISE and self.source == CARRIED:
            scheduler += " (a pass stops once enough whole groups are finished)"
        if self.continuation == TOOL_TURNS:
            scheduler += (" (each trajectory continues as soon as its own tool calls are back)"
                          if self.scheduler == STEPWISE else
                          " (batch-wide turns: each waits for its turn's slowest tool call)")
        line = f"rollout: {source} x {self.continuation} x {scheduler}"
        return line + (f"; {self.note}" if self.note else "")


@dataclass(frozen=True)
class Features:
    """Which optional parts of the RL loop a job runs (module docstring lists them)."""

    algorithm: str                       # the launcher's family
    estimator: str                       # rl_config.adv_estimator, resolved
    partial_rollout_max_split: int       # N; 1 = off
    multi_turn: bool
    stepwise: bool                       # the step-wise engine acts (see rollout)
    router_replay: str | None            # "R2", "R3" or None
    dynamic_sampling: bool
    reward_model: bool
    reference: bool                      # a reference model and its forward
    kl_in_reward: bool                   # the KL to the reference in the per-token reward
    kl_loss_coef: float                  # the KL's coefficient in the loss (0: none there)
    teacher: bool                        # on-policy distillation's teacher
    multi_step: bool                     # more than one optimizer step per iteration
    rollout_is_batch_normalize: bool
    response_limit: int                  # tokens of the longest response
    rollout: RolloutComposition
    pairs: bool = False                  # rows are preference pairs from the data (DPO)
    engine: bool = True                  # a vLLM engine (rollout, or a DPO job's evaluation)

    @property
    def partial_rollout(self) -> bool:
        return self.partial_rollout_max_split > 1

    @property
    def on(self) -> frozenset[str]:
        """The names of the features that are on (``NEEDS``' keys and the column tags)."""
        flags = {PARTIAL_ROLLOUT: self.partial_rollout, MULTI_TURN: self.multi_turn,
                 "stepwise": self.stepwise, ROUTER_REPLAY: self.router_replay is not None,
                 "router_replay_r2": self.router_replay == "R2",
                 "router_replay_r3": self.router_replay == "R3",
                 "dynamic_sampling": self.dynamic_sampling, "reward_model": self.reward_model,
                 "reference": self.reference, "kl_in_reward": self.kl_in_reward,
                 "teacher": self.teacher, "multi_step": self.multi_step,
                 "rollout_is_batch_normalize": self.rollout_is_batch_normalize}
        return frozenset(name for name, value in flags.items() if value)

    @property
    def needed_phases(self) -> frozenset[str]:
        """The optional phases this job runs: those its features and its estimator need."""
        needed = {p for name in self.on for p in NEEDS.get(name, ())}
        estimator = registry.estimator(self.estimator)
        return frozenset(needed | set(estimator.needs_phases if estimator else ()))

    @property
    def phases(self) -> tuple[str, ...]:
        """The phase names the job runs, in order."""
        every = registry.phases(self.algorithm, self.estimator)
        needed = self.needed_phases
        return tuple(p for p in every if p not in OPTIONAL_PHASES or p in needed)

    @property
    def replays_rollout_routing(self) -> bool:
        """R3: vLLM records the routes during rollout; the training passes replay them."""
        return self.router_replay == "R3"


def features(config: RLJobConfig) -> Features:
    """The features of ``config`` (also ``config.features``)."""
    rl, mt = config.rl_config, config.megatron_training
    multi_turn = rl.multi_turn_enable
    estimator = registry.estimator(rl.adv_estimator or "")
    kl = rl.init_kl_coef != 0  # a KL to the reference (in the loss or in the reward)
    reference = kl or "reference" in registry.algorithm(config.algorithm).always
    kl_in_reward = bool(rl.use_kl_in_reward and kl and estimator is not None
                        and estimator.kl_in_reward)
    mini = rl.mini_batch_size or mt.global_batch_size
    limit = (rl.max_total_response_length or config.sampling_config.max_tokens) if multi_turn \
        else config.sampling_config.max_tokens
    rollout = _rollout(config, limit)
    pairs = "pairs" in registry.algorithm(config.algorithm).always
    return Features(
        algorithm=config.algorithm,
        estimator=estimator.name if estimator is not None else str(rl.adv_estimator),
        partial_rollout_max_split=rl.partial_rollout_max_split,
        multi_turn=multi_turn,
        stepwise=rollout.scheduler == STEPWISE,
        router_replay=None if rl.router_replay == "none" else rl.router_replay,
        dynamic_sampling=rl.filter_groups_enable,
        reward_model=config.reward_config is not None,
        reference=reference,
        kl_in_reward=kl_in_reward,
        kl_loss_coef=rl.init_kl_coef if kl and not rl.use_kl_in_reward else 0.0,
        teacher=config.teacher_config is not None,
        multi_step=mt.global_batch_size // max(mini, 1) * rl.epochs > 1,
        rollout_is_batch_normalize=rl.rollout_is is not None and rl.rollout_is_batch_normalize,
        response_limit=limit,
        rollout=rollout,
        pairs=pairs,
        engine=not pairs or mt.test_data_path is not None,
    )


def family_supports(config: RLJobConfig, feature: str) -> bool:
    """Whether the job's algorithm family is built for ``feature`` (its rows, its phases):
    the family's ``supports`` (``mindspeed_rl/algorithms/``)."""
    return feature in registry.algorithm(config.algorithm).supports


def _rollout(config: RLJobConfig, limit: int) -> RolloutComposition:
    """The rollout's parts. ``async_engine`` acts where there is something to decode step
    by step: a pass that may stop early (carried rows), or tool turns that may continue on
    their own (vLLM TP 1: with TP > 1 an instance's ranks must add requests together)."""
    rl = config.rl_config
    split, tools = rl.partial_rollout_max_split, rl.multi_turn_enable
    source = CARRIED if split > 1 else FRESH
    continuation = TOOL_TURNS if tools else SINGLE_TURN
    tp_g = config.generate_config.infer_tensor_parallel_size
    stepwise = rl.async_engine and (split > 1 or tools) and not (tools and tp_g > 1)
    note = ""
    if rl.async_engine and tools and tp_g > 1:
        note = ("rl_config.async_engine: turns stay batch-wide with "
                "infer_tensor_parallel_size > 1 (an instance's ranks add requests together)")
    elif rl.async_engine and not stepwise:
        note = "rl_config.async_engine changes nothing without partial rollout or tools"
    if stepwise:
        scheduler = STEPWISE
    elif split > 1:
        scheduler = TOKEN_BUDGET
    else:
        scheduler = ONE_PASS
    return RolloutComposition(source, continuation, scheduler, max_split=split,
                              pass_tokens=math.ceil(limit / split) if scheduler == TOKEN_BUDGET
                              else None, note=note)
