"""Checks of verl's rollout-correction keys and of the weight-version lag.

Importance weights (``rollout_is*``), rejection sampling (``rollout_rs*``) and the token veto;
and how many versions a trained token's weights may lag the trained ones
(``max_weight_version_lag``) against the optimizer steps of one iteration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.config.config_error import require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_rollout_correction(config: RLJobConfig) -> None:
    """verl's rollout-correction keys: each threshold pair in order, nothing set that its
    switch leaves unused."""
    rl = config.rl_config
    upper = 2.0 if rl.rollout_is_threshold is None else rl.rollout_is_threshold
    for key in ("rollout_is_threshold_lower", "rollout_is_batch_normalize"):
        require(not getattr(rl, key) or rl.rollout_is is not None, f"rl_config.{key}",
                getattr(rl, key), "only acts on rollout_is weights, and rollout_is is null",
                "set rollout_is: token or sequence, or remove the key")
    low = rl.rollout_is_threshold_lower
    require(low is None or 0 <= low < upper, "rl_config.rollout_is_threshold_lower", low,
            f"must lie in [0, rollout_is_threshold={upper}): lower >= upper truncates every "
            "weight to one value", f"use e.g. {upper / 4:g}, or null")
    rs, rs_up, rs_low = rl.rollout_rs, rl.rollout_rs_threshold, rl.rollout_rs_threshold_lower
    for key, value in (("rollout_rs_threshold", rs_up), ("rollout_rs_threshold_lower", rs_low)):
        require(value is None or rs is not None, f"rl_config.{key}", value,
                "bounds the band of rollout_rs, and rollout_rs is null",
                "set rollout_rs: token, sequence or geometric, or remove the key")
    if rs is not None:
        require(rs_up is not None and rs_up > 0, "rl_config.rollout_rs_threshold", rs_up,
                f"rollout_rs={rs} needs a positive upper bound of the kept ratio",
                "use e.g. 2.0 (IcePop's band is 0.5 .. 2.0)")
        lower = 1.0 / rs_up if rs_low is None else rs_low
        require(0 <= lower < rs_up, "rl_config.rollout_rs_threshold_lower", rs_low,
                f"must lie in [0, rollout_rs_threshold={rs_up}): with lower >= upper every "
                "token is rejected", f"use e.g. {1.0 / rs_up:g}, or null (1 / upper)")
    veto = rl.rollout_token_veto_threshold
    require(veto is None or 0 < veto < 1, "rl_config.rollout_token_veto_threshold", veto,
            "must lie in (0, 1): a token ratio below it vetoes its sequence",
            "use e.g. 1e-4, or null")
    lag = rl.max_weight_version_lag
    require(lag is None or lag >= 0, "rl_config.max_weight_version_lag", lag,
            "must be >= 0 (versions a trained token's weights may lag the trained ones)",
            "use e.g. 1 for one-step off-policy, or null")
    mini = rl.mini_batch_size or config.megatron_training.global_batch_size
    steps = max(config.megatron_training.global_batch_size // max(mini, 1), 1) * rl.epochs
    require(lag is None or lag >= steps - 1, "rl_config.max_weight_version_lag", lag,
            f"is below the {steps - 1} versions the last of the iteration's {steps} optimizer "
            "steps (global_batch_size / mini_batch_size x epochs) lags its own fresh rows: "
            "every iteration would drop them", f"use at least {steps - 1}, or fewer "
            "optimizer steps per iteration")
