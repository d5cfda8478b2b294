"""KL coefficient controllers for a KL penalty inside the reward (PPO, ``use_kl_in_reward``).

- fixed: beta stays at ``init_kl_coef``;
- adaptive (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
  Preferences", section 2.2): after each batch of ``n_steps`` samples with KL
  ``kl``,
      e     = clip(kl / kl_target - 1, -0.2, 0.2)
      beta *= 1 + e * n_steps / horizon
  so beta grows while the policy drifts further than the target and shrinks
  while it stays closer.

``kl`` is what verl's and MindSpeed-RL's controllers read: each sequence's mean
per-token KL, averaged over the sequences of the batch
(`token_mean_kl_per_sequence`, then a mean), so a ``kl_target`` from their
configs means the same here.

Pure: no config objects, no torch.distributed; the caller passes the batch's
(globally reduced) KL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_mean_kl_per_sequence(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean KL per response token (0 for an empty one).

    kl, mask: [batch, resp_len] -> [batch]
    """
    mask_f = mask.to(kl.dtype)
    return (kl * mask_f).sum(dim=-1) / mask_f.sum(dim=-1).clamp(min=1.0)


@dataclass
class KLController:
    """``kind`` is ``fixed`` or ``adaptive``; ``value`` is the current coefficient beta."""

    value: float
    kind: str = "fixed"
    target: float = 6.0
    horizon: int = 10000

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "adaptive"):
            raise ValueError(f"unknown KL controller {self.kind!r}; use fixed or adaptive "
                             "(rl_config.kl_ctrl_type)")
        if self.kind == "adaptive" and (self.target <= 0 or self.horizon <= 0):
            raise ValueError(f"the adaptive KL controller needs kl_target > 0 and kl_horizon > 0 "
                             f"(got {self.target}, {self.horizon})")

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt beta to the batch just seen; returns the new value."""
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
