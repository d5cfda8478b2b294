"""The policy (and the frozen reference) as megatron-core models in the training sharding.

`build_policy_model` builds this rank's GPTModel shard; `MegatronActor` is a
`TrainableModel` whose loss is the clipped policy loss with KL and entropy
terms; `forward_logprobs` computes response log-probs with any policy-shaped
model (actor or reference). Only response positions go through the vocabulary
projection.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import rollout_correction as rc_fn
from mindspeed_rl.algorithms import (OFF_POLICY_IS_THRESHOLD, agg_loss,
                                     entropy_from_vocab_parallel_logits, kl_penalty,
                                     default_loss_agg_mode, logprobs_from_vocab_parallel_logits,
                                     off_policy_is_weights, policy_loss, truncated_is_weights)
from mindspeed_rl.engine.cp_micro_batch import ContextParallelOutputs
from mindspeed_rl.engine.micro_batches import ROUTING, MicroBatch, MicroBatching, RowBatch
from mindspeed_rl.engine.optim import TrainableModel
from mindspeed_rl.engine.router_replay import REPLAY, replaying, routing_metrics
from mindspeed_rl.engine.schedule import (forward_rows, micro_batches_for,
                                           reduce_sums_once_per_dp_rank, run_schedule,
                                           tp_reductions)

# Padded vocabulary columns get this logit: exp() underflows to exactly 0 and, unlike
# -inf, 0 * logit stays 0 in the entropy.
_MASKED_LOGIT = -1e9

_STAT_KEYS = ["pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl",
              "rollout_logprob_abs_diff", "off_policy_tokens", "off_policy_is_weight", "tokens",
              "units", *rc_fn.MISMATCH_SUM_KEYS]
_PER_UNIT = ("pg_loss", "kl_loss", "entropy")


def build_policy_model(arch, *, params_dtype: torch.dtype, sequence_parallel: bool,
                       calculate_per_token_loss: bool = True, **transformer_options):
    """This rank's GPTModel shard of ``arch`` (weights random until loaded).

    ``transformer_options``: further TransformerConfig fields (recompute, uneven pipeline
    stages; `mindspeed_rl.models.training_options`)."""
    from mindspeed_rl.models.builder import build_gpt_model, build_transformer_config

    config = build_transformer_config(arch, params_dtype=params_dtype,
                                      sequence_parallel=sequence_parallel,
                                      calculate_per_token_loss=calculate_per_token_loss,
                                      **transformer_options)
    return build_gpt_model(arch, config)


class MegatronActor(TrainableModel):
    """The trainable policy. ``weight_version`` counts its optimizer steps: rows generated
    with the current weights carry the same number (the on-policy check)."""

    weight_version = 0

    def update(self, batch: RowBatch, micro_batch_size: int | MicroBatching, rl, *,
               kl_coef: float, vocab_size: int, norm_length: float | None = None,
               temperature: float = 1.0, is_norm: float | None = None,
               replay_routing: bool = False, off_policy: bool = False) -> dict[str, float]:
        """One optimizer step on ``batch`` (this DP rank's share of a mini-batch).

        ``rl`` is the ``rl_config`` section: clip ranges (``clip_ratio``, clip-higher's
        ``clip_ratio_low/high``, dual-clip ``clip_ratio_c``), ``policy_loss`` (vanilla or
        GSPO), ``loss_agg_mode``, the KL estimator, the entropy coefficient and the
        truncated-IS threshold; ``kl_coef`` the KL loss coefficient (0 when the KL is in
        the reward); ``norm_length`` Dr. GRPO's constant length (max_tokens);
        ``temperature`` the rollout's sampling temperature: the log-probs, the ratio, the
        KL and the entropy are those of the policy that sampled (logits / temperature).

        Exact over micro-batches and DP ranks: each micro-batch returns the sum of its
        terms and its count of units (tokens for token-mean, sequences otherwise);
        megatron divides the gradients by the units of the whole mini-batch (all DP
        ranks, ``calculate_per_token_loss``). Rows without ``logprobs_old`` take this
        forward's, detached (one optimizer step per iteration: these are the weights the
        iteration started with); such rows must come from the current weights, or mark
        the tokens older weights generated (``off_policy``), which the loss weighs by
        proximal over behaviour. ``is_norm``: the mini-batch mean of the rollout-correction
        weights (``rollout_is_batch_normalize``), which divides them. ``replay_routing``:
        every micro-step replays the routes of the ``routed_experts`` column (MoE routing
        replay); ``off_policy``: the run may train tokens of older weights (partial
        rollout), whose share and weights are reported. Both are the job's features, the
        same on every rank (the metrics are collectives).
        """
        self._check_on_policy(batch)
        objective = PolicyObjective(rl, kl_coef=kl_coef, vocab_size=vocab_size,
                                    norm_length=norm_length, temperature=temperature,
                                    is_norm=is_norm, off_policy=off_policy)
        micro = micro_batches_for(self.model, batch, micro_batch_size)
        if ROUTING in batch.extras and not replay_routing:
            raise ValueError("the routed_experts column reached an update with "
                             "rl_config.router_replay: none")
        with replaying(self.model, REPLAY if replay_routing else None) as routing:
            out = self.step(lambda: run_schedule(self.ddp, self.model, micro, objective.loss,
                                                 forward_only=False, routing=routing),
                            objective.sums.values)
        self.weight_version += int(out["update_ok"])  # a skipped step leaves the weights
        stats = objective.reduced()
        stats.update(out)
        if routing is not None:
            stats.update(routing_metrics(routing))
        return stats

    def _check_on_policy(self, batch: RowBatch) -> None:
        """Rows without old log-probs must come from the current weights, unless their
        older tokens are marked off-policy (importance-weighted against this forward)."""
        if "logprobs_old" not in batch.extras and "off_policy" not in batch.extras:
            stale = [int(v) for v in batch.extras.pop("weight_version", []) if
                     int(v) != self.weight_version]
            if stale:
                raise RuntimeError(
                    f"{len(stale)} rows generated by weights v{stale[0]} reached the update "
                    f"of weights v{self.weight_version} without old log-probs; an off-policy "
                    "row needs the old_log_p phase")
        batch.extras.pop("weight_version", None)


class PolicyObjective:
    """The actor's loss on one micro-batch's logits (clipped policy loss + KL + entropy),
    and the statistics it accumulates over the micro-batches of one optimizer step."""

    def __init__(self, rl, *, kl_coef: float, vocab_size: int, norm_length: float | None,
                 temperature: float, is_norm: float | None = None,
                 off_policy: bool = False) -> None:
        self.rl, self.kl_coef, self.vocab_size = rl, kl_coef, vocab_size
        self.off_policy = off_policy  # report the off-policy tokens (partial rollout)
        self.rc, self.is_norm = rc_fn.RolloutCorrection.from_rl(rl), is_norm
        self.rc_weights: torch.Tensor | None = None  # this micro-batch's, rollout_is only
        self.norm_length, self.temperature = norm_length, temperature
        self.mode = rl.loss_agg_mode or default_loss_agg_mode(rl.policy_loss)
        self.low = rl.clip_ratio if rl.clip_ratio_low is None else rl.clip_ratio_low
        self.high = rl.clip_ratio if rl.clip_ratio_high is None else rl.clip_ratio_high
        self.level = "sequence" if rl.policy_loss == "gspo" else "token"
        self.sums: dict[str, float] = {}
        self.max_diff = torch.zeros(())
        self.max_is_weight = torch.zeros(())

    def loss(self, logits, mb: MicroBatch):
        """megatron's ``(loss, units, reported)`` for one micro-batch."""
        rl, mask = self.rl, mb.mask
        logp = response_logprobs(logits, mb, self.vocab_size, self.temperature)
        logp_old = mb.extras["logprobs_old"] if "logprobs_old" in mb.extras else logp.detach()
        # Each term is this micro-batch's sum over its units; megatron divides by all units.
        agg = dict(loss_agg_mode=self.mode, num_tokens_global=1.0, num_seqs_global=1.0,
                   norm_length=self.norm_length, segment_ids=segment_ids(mb))
        is_weights, off = self.is_weights(mb, logp_old)
        mask = self.rollout_correction(mb, logp_old, agg["segment_ids"])
        if self.rc.is_level is not None:
            is_weights = self.rc_weights
        if off.any():
            self.max_is_weight = torch.maximum(self.max_is_weight,
                                               (is_weights * off).max().detach())
        pg_sum, stats = policy_loss(logp, logp_old, mb.extras["advantages"], mask, self.low,
                                    self.high, clip_ratio_dual=rl.clip_ratio_c,
                                    ratio_level=self.level, is_weights=is_weights, **agg)
        loss = pg_sum
        kl_sum = torch.zeros(())
        if self.kl_coef:
            kl_sum = agg_loss(kl_penalty(logp, mb.extras["logprobs_ref"], rl.kl_penalty),
                              mask, **agg)
            loss = loss + self.kl_coef * kl_sum
        with torch.set_grad_enabled(rl.entropy_coeff != 0 and torch.is_grad_enabled()):
            ent_sum = agg_loss(response_entropy(logits, self.vocab_size, self.temperature),
                               mask, **agg)
        if rl.entropy_coeff:
            loss = loss - rl.entropy_coeff * ent_sum
        n = mask.sum()
        units = n if self.mode == "token-mean" else torch.tensor(
            float(sum(1 for _, _, length in mb.spans if length > 0)))
        # vLLM's log-probs against the training engine's, for the same weights.
        diff = torch.zeros_like(mask)
        if "logprobs_rollout" in mb.extras:
            diff = (mb.extras["logprobs_rollout"] - logp_old.detach()).abs() * mask
            self.max_diff = torch.maximum(self.max_diff, diff.max())
        for key, value in (("pg_loss", pg_sum), ("kl_loss", kl_sum), ("entropy", ent_sum),
                           ("pg_clipfrac", stats["pg_clipfrac"] * n),
                           ("ppo_kl", stats["approx_kl"] * n),
                           ("rollout_logprob_abs_diff", diff.sum()),
                           ("off_policy_tokens", off.sum()),
                           ("off_policy_is_weight",
                            (is_weights * off).sum() if off.any() else off.sum()),
                           ("tokens", n),
                           ("units", units)):
            self.sums[key] = self.sums.get(key, 0.0) + float(value.detach())
        return loss, units.to(torch.int), {"loss": loss.detach().clone()}

    def is_weights(self, mb: MicroBatch, logp_old: torch.Tensor
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(per-token importance weights of ``mb``, or None; its off-policy token mask).

        The rollout engine's samples against the old log-probs (``rollout_is_threshold``),
        and a partial rollout's tokens of older weights (``off_policy``): proximal (the
        old log-probs) over behaviour (the rollout log-probs), truncated."""
        rl, mask = self.rl, mb.mask
        weights = None
        if rl.rollout_is_threshold is not None:
            weights = truncated_is_weights(logp_old, mb.extras["logprobs_rollout"],
                                           rl.rollout_is_threshold)
        off = torch.zeros_like(mask)
        if "off_policy" in mb.extras:
            off = mb.extras["off_policy"] * mask
            weights = off_policy_is_weights(logp_old, mb.extras["logprobs_rollout"], off,
                                            rl.rollout_is_threshold or OFF_POLICY_IS_THRESHOLD,
                                            weights)
        return weights, off

    def rollout_correction(self, mb: MicroBatch, logp_old: torch.Tensor,
                           seg: torch.Tensor) -> torch.Tensor:
        """The loss mask after verl's rejection and veto (``mb.mask`` when they are off),
        as ``rollout_correction.correct`` applies them; sets ``rc_weights`` (``rollout_is``:
        every token's, on-policy and off-policy alike, over ``is_norm`` when given) and adds
        the mismatch diagnostics' sums."""
        self.rc_weights = None
        if "logprobs_rollout" not in mb.extras:
            return mb.mask
        rollout, rc, mask = mb.extras["logprobs_rollout"], self.rc, mb.mask
        if rc.is_level is not None:
            weights = rc_fn.rollout_is_weights(logp_old, rollout, mask, rc.is_level,
                                               rc.is_threshold, rc.is_threshold_lower, seg)
            self.rc_weights = weights if not self.is_norm else \
                rc_fn.normalize_weights(weights, self.is_norm, 1.0)
        keep_rs = rc_fn.rejection_mask(logp_old, rollout, mask, rc.rs_level, rc.rs_threshold,
                                       rc.rs_threshold_lower, seg) \
            if rc.rs_level is not None else None
        keep_veto = rc_fn.veto_mask(logp_old, rollout, mask, rc.veto_threshold, seg) \
            if rc.veto_threshold is not None else None
        sums = rc_fn.mismatch_sums(logp_old, rollout, mask,
                                   self.rl.rollout_is_threshold or rc_fn.DEFAULT_IS_THRESHOLD,
                                   rc.is_threshold_lower, seg, keep_rs, keep_veto)
        for key, value in sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        for keep in (keep_rs, keep_veto):
            mask = mask if keep is None else mask * keep
        return mask

    def reduced(self) -> dict[str, float]:
        """The step's statistics over every DP rank: the loss terms per unit of the
        aggregation, the rest per token."""
        totals = reduce_sums_once_per_dp_rank(self.sums, _STAT_KEYS)
        loss_tokens = totals.pop("tokens")
        tokens, units = max(loss_tokens, 1.0), max(totals.pop("units"), 1.0)
        off_tokens = totals.pop("off_policy_tokens")
        off_weights = totals.pop("off_policy_is_weight")
        mismatch = {k: totals.pop(k) for k in rc_fn.MISMATCH_SUM_KEYS}
        stats = {k: v / (units if k in _PER_UNIT else tokens) for k, v in totals.items()}
        if mismatch["mm_tokens"] > 0:
            stats.update({f"rollout_corr/{k}": v
                          for k, v in rc_fn.mismatch_metrics(mismatch).items()})
        stats["loss_tokens"] = loss_tokens  # the response tokens the loss covered (all DP ranks)
        stats["rollout_logprob_abs_diff_max"] = max_over_world(float(self.max_diff))
        if self.off_policy:  # tokens of older weights (partial rollout)
            stats["off_policy_token_fraction"] = off_tokens / tokens
            stats["off_policy_is_weight_mean"] = off_weights / max(off_tokens, 1.0)
            stats["off_policy_is_weight_max"] = max_over_world(float(self.max_is_weight))
        return stats


def segment_ids(mb: MicroBatch) -> torch.Tensor:
    """``[b, R]`` int64: which of the micro-batch's rows each response position belongs to
    (0 on padding), so sequence-level losses group a packed sequence's rows correctly."""
    ids = torch.zeros_like(mb.response_ids)
    for k, (j, start, length) in enumerate(mb.spans):
        ids[j, start:start + length] = k
    return ids


def max_over_world(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ---------------------------------------------------------------------------------------
# log-probs and entropy from vocabulary-parallel logits
# ---------------------------------------------------------------------------------------
def policy_logits(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """The logits of the distribution that sampled: float32, the padded vocabulary columns
    masked (megatron pads the vocabulary to a multiple of 128; vLLM and HF never sample
    pads), divided by the sampling ``temperature`` as vLLM does before it samples.

    logits: [b, R, V/tp] this rank's vocabulary shard -> [b, R, V/tp]
    """
    _, _, tp_rank = tp_reductions()
    shard = logits.size(-1)
    start = tp_rank * shard
    logits = logits.float()
    if start + shard > vocab_size:
        cols = torch.arange(start, start + shard)
        logits = logits.masked_fill(cols >= vocab_size, _MASKED_LOGIT)
    # At 1 no division at all, so temperature-1 runs stay bit-identical to raw logits.
    return logits if temperature == 1.0 else logits / temperature


def response_logprobs(logits: "torch.Tensor | ContextParallelOutputs", mb: MicroBatch,
                      vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """[b, R] log-probs of the response tokens, from their positions' logits ``[b, R, V/tp]``
    (or, under context parallelism, this CP rank's positions, gathered)."""
    if isinstance(logits, ContextParallelOutputs):
        return logits.response_values(
            lambda local, ids: _token_logprobs(local, ids, vocab_size, temperature))
    return _token_logprobs(logits, mb.response_ids, vocab_size, temperature)


def _token_logprobs(logits, ids, vocab_size: int, temperature: float) -> torch.Tensor:
    all_max, all_sum, tp_rank = tp_reductions()
    logits = policy_logits(logits, vocab_size, temperature)
    return logprobs_from_vocab_parallel_logits(logits, ids, tp_rank * logits.size(-1),
                                               all_max, all_sum)  # [b, R]


def response_entropy(logits: "torch.Tensor | ContextParallelOutputs", vocab_size: int,
                     temperature: float = 1.0) -> torch.Tensor:
    if isinstance(logits, ContextParallelOutputs):
        return logits.response_values(
            lambda local, _: response_entropy(local, vocab_size, temperature))
    all_max, all_sum, _ = tp_reductions()
    return entropy_from_vocab_parallel_logits(policy_logits(logits, vocab_size, temperature),
                                              all_max, all_sum)  # [b, R]


def forward_logprobs(model, batch: RowBatch, micro_batch_size: int | MicroBatching,
                     vocab_size: int, with_entropy: bool = False, *,
                     temperature: float = 1.0,
                     routing=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-row response log-probs (and entropies) on every rank of the model's DP group,
    of the policy at ``temperature`` (the rollout's sampling temperature). ``routing``: a
    ``RouterReplayer`` recording or replaying the MoE routing (``engine/router_replay.py``).

    Returns ``([R_i] per row, [R_i] per row)`` (entropies are zeros unless ``with_entropy``).
    """
    def per_token(logits, mb):
        logp = response_logprobs(logits, mb, vocab_size, temperature)
        ent = (response_entropy(logits, vocab_size, temperature) if with_entropy
               else torch.zeros_like(logp))
        return logp, ent

    out = forward_rows(model, batch, micro_batch_size, ("logp", "entropy"), per_token,
                       routing=routing)
    return out["logp"], out["entropy"]
