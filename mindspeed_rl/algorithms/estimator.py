"""What an advantage estimator is: one function with one call signature, declared where it
is defined (``@register_estimator`` in ``registry.py``) together with what it reads and
needs.

    fn(x: AdvantageInputs, sums: Sums, **params) -> AdvantageOutputs

``x`` holds one rank's rows, padded; ``sums`` adds per-rank numbers over every rank that
speaks for its rows (the trainer passes it in: the estimator stays a pure function, with
no torch.distributed inside); ``params`` are the config keys the estimator names. The
estimator decides its own whitening and takes the KL to the reference into its reward
when it declares ``kl_in_reward``; the trainer's one advantage phase only gathers the
columns, calls it and writes the results (docs/algorithms.md has a worked example).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mindspeed_rl.algorithms.phase_names import ADV

# Adds each of a list of per-rank numbers over the ranks (the trainer's global sums, or the
# identity for one rank): whole-batch statistics such as whitening.
Sums = Callable[[list[float]], list[float]]


def local_sums(values: list[float]) -> list[float]:
    """The sums of one rank alone (tests, single-process use)."""
    return list(values)


@dataclass(frozen=True)
class AdvantageInputs:
    """One rank's rows as an estimator reads them; per-token tensors are right-padded to R,
    the longest response here. Rows of a whole-group estimator come ordered by group, the
    ``group_size`` samples of a prompt consecutive."""

    rewards: torch.Tensor                      # [B] sequence rewards
    response_mask: torch.Tensor                # [B, R] 1 on each response token
    loss_mask: torch.Tensor                    # [B, R] 1 on the tokens the loss trains
    group_size: int = 1                        # samples per prompt (whole-group estimators)
    values: torch.Tensor | None = None         # [B, R] the critic's values
    logprobs_old: torch.Tensor | None = None   # [B, R] the actor's, before this iteration's update
    logprobs_teacher: torch.Tensor | None = None  # [B, R] on-policy distillation's teacher
    kl: torch.Tensor | None = None             # [B, R] KL to the reference, when in the reward
    kl_coef: float = 0.0                       # its coefficient (the KL controller's)

    def grouped(self, per_row: torch.Tensor) -> torch.Tensor:
        """[B] -> [B / group_size, group_size]: each prompt's samples on one row."""
        return per_row.reshape(-1, self.group_size)


@dataclass
class AdvantageOutputs:
    """An estimator's results for the rows of its inputs."""

    advantages: torch.Tensor                   # [B, R]; the update reads the response tokens
    returns: torch.Tensor | None = None        # [B, R] the critic's targets (GAE)
    metrics: dict[str, float] = field(default_factory=dict)  # already summed over the ranks

    @classmethod
    def per_sequence(cls, advantages: torch.Tensor, x: AdvantageInputs) -> AdvantageOutputs:
        """One advantage per row ([B], or [groups, n] in row order) on each of its tokens."""
        flat = advantages.reshape(-1)
        return cls(flat[:, None] * x.response_mask.to(flat.dtype))


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: a value of ``rl_config.adv_estimator`` (docs/algorithms.md
    lists them with their formulas and sources)."""

    name: str                          # the value of rl_config.adv_estimator
    algorithms: tuple[str, ...]        # the families (launchers) that run it
    phase: str                         # where it runs (phase_names.py): ``adv`` (before the
                                       # forwards, whole groups where they were generated) or
                                       # a phase after the forwards in the training layout
    formula: str                       # one line, for errors, the dry run and docs
    source: str                        # where the formula comes from
    fn: Callable[..., AdvantageOutputs]
    reads: tuple[str, ...] = ()        # dock columns it reads beyond rewards and lengths
    params: tuple[str, ...] = ()       # config keys passed to fn by their last name
                                       # ("gamma" = rl_config.gamma; "section.key")
    aliases: tuple[str, ...] = ()      # verl's names that mean the same estimator
    needs: frozenset[str] = frozenset()         # roles it reads (family.CRITIC)
    needs_phases: frozenset[str] = frozenset()  # optional phases it needs (features.py)
    min_group_size: int = 1            # smallest rl_config.n_samples_per_prompt
    kl_in_reward: bool = False         # may take the KL to the reference into its reward

    @property
    def whole_groups(self) -> bool:
        """It compares the samples of a prompt: its phase gets whole groups."""
        return self.phase == ADV

    def kwargs(self, config) -> dict:
        """``params`` read from ``config`` (a job config: ``rl_config`` unless the key names
        its section)."""
        out = {}
        for key in self.params:
            section, _, name = key.rpartition(".")
            out[name] = getattr(getattr(config, section or "rl_config"), name)
        return out
