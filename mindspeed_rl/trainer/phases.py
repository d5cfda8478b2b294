"""The phases of an RL iteration: each reads columns from the sample flow, computes, and
writes columns back (``mindspeed_rl/trainer/columns.py`` declares them).

A phase is ``phase(ctx) -> metrics``: it receives a `PhaseContext` (config and features,
batch plan, roles, data, its place in the layouts, the flow bound to its own name, the
trainer's counters and the iteration's state: ``context.py``) and returns its metrics,
already reduced over the ranks. Algorithms are ordered lists of these phases
(``mindspeed_rl/algorithms/grpo.py``, ``ppo.py``; ``recipes.py`` maps names to functions);
the objective of each is visible here, the tensor math is in ``mindspeed_rl.algorithms``
and the rollout's parts are in ``rollout_parts/``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms import (groups_with_reward_spread, kl_penalty, overlong_penalty,
                                     token_mean_kl_per_sequence)
from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.algorithms.estimator import AdvantageInputs
from mindspeed_rl.engine.actor import forward_logprobs
from mindspeed_rl.engine.critic import forward_scores, forward_values
from mindspeed_rl.engine.micro_batches import ROUTING
from mindspeed_rl.engine.router_replay import RECORD, REPLAY, RouterReplayError, replaying
from mindspeed_rl.rewards import check_finite_scores, compute_rewards, retool_call_bonus
from mindspeed_rl.trainer.columns import FINISH_REASONS
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.flow import pad_cells, row_batch
from mindspeed_rl.trainer.off_policy import (mark_off_policy, rollout_is_batch_mean,
                                             staleness_metrics, version_lag)
from mindspeed_rl.trainer.own_layout import logprobs_in_own_layout
from mindspeed_rl.trainer.reductions import (counts_in_train_layout, global_max, global_stats,
                                             global_sums)
from mindspeed_rl.trainer.rollout_parts import compose
from mindspeed_rl.transfer_dock import DockBatch


def _mean_of_steps(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]} if steps else {}


# ---------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------
def resharding_to_infer(ctx: PhaseContext) -> dict[str, float]:
    """The actor's weights from the training sharding into vLLM (allgather-swap); its floor
    is the slowest rank's bytes at that rank's measured bandwidths
    (``resharding/floor.py``)."""
    report = ctx.roles.resharder.to_infer()
    return {"resharding/peak_transition_bytes": report.peak_bytes,
            "resharding/bytes_moved": report.bytes_moved,
            "perf/resharding_to_infer_floor_s": global_max(report.floor_s)}


def resharding_to_train(ctx: PhaseContext) -> dict[str, float]:
    report = ctx.roles.resharder.to_train()
    return {"perf/resharding_to_train_floor_s": global_max(report.floor_s)}


def rollout(ctx: PhaseContext) -> dict[str, float]:
    """Responses to this generation-DP rank's share of the round's prompts, from the parts
    the job's features name (a source of rows x a continuation x a scheduler,
    ``rollout_parts/``); the first rank of each vLLM instance puts the rows (all samples
    of a prompt together)."""
    return compose(ctx).run()


# ---------------------------------------------------------------------------------------
# rewards and advantages
# ---------------------------------------------------------------------------------------
def reward_model(ctx: PhaseContext) -> dict[str, float]:
    """The reward model's score of every response, in the training layout."""
    batch = ctx.flow.get(["prompt_ids", "response_ids"], ctx.batch.responses_per_training_dp_rank,
                         "train")
    with ctx.roles.reward_model_swap.resident():
        scores = forward_scores(ctx.roles.reward_model, row_batch(batch),
                                ctx.batch.micro_batching[names.REWARD_MODEL])
    ctx.flow.put(batch, {"rm_scores": scores})
    return global_stats("reward_model/score", [float(s) for s in scores],
                        counts_in_train_layout())


def reward(ctx: PhaseContext) -> dict[str, float]:
    """Rule verifiers on the decoded responses (+ the weighted reward-model score)."""
    rl = ctx.rl
    columns = ["response_ids", "prompt_index", "finish_reason"]
    if ctx.roles.reward_model is not None:
        columns.append("rm_scores")
    if ctx.flow.carries("tool_calls"):
        columns.append("tool_calls")
    batch = ctx.flow.get(columns, ctx.batch.responses_per_generation_dp_rank, "gen_writers")
    totals, per_verifier, truncated, overlong = [], {}, [], []
    if batch is not None:
        texts = [ctx.tokenizer.decode(r, skip_special_tokens=True)
                 for r in batch["response_ids"]]
        items = [ctx.train_data[int(i)] for i in batch["prompt_index"]]
        answers, rows = ([item.answer for item in items],
                         [f"{item.source_file} row {item.source_row}" for item in items])
        total, per_verifier = compute_rewards(texts, answers, rl.verifier_function,
                                              rl.verifier_weight, row_labels=rows,
                                              pool=ctx.reward_pool)
        if "tool_calls" in columns and "retool_reward" in rl.verifier_function:
            total = total + _retool_call_bonus(per_verifier, batch["tool_calls"], rl)
        if "rm_scores" in columns:
            rm_scores = torch.stack(batch["rm_scores"])
            check_finite_scores(rm_scores, "the reward model", "check its weights "
                                "(reward_config.load) and dtype", texts, answers, rows)
            total = total + ctx.config.reward_config.weight * rm_scores
        if rl.overlong_buffer_len:  # DAPO: long responses lose up to the penalty factor
            penalty = overlong_penalty(
                torch.tensor([len(r) for r in batch["response_ids"]]),
                ctx.features.response_limit, rl.overlong_buffer_len,
                rl.overlong_penalty_factor)
            total, overlong = total + penalty, penalty.tolist()
        totals = total.tolist()
        truncated = [float(int(f) == FINISH_REASONS.index("length"))
                     for f in batch["finish_reason"]]
        if any(int(f) == FINISH_REASONS.index("partial") for f in batch["finish_reason"]):
            raise RuntimeError("reward: an unfinished (partial) response reached the reward; "
                               "a partial rollout releases finished groups only")
        scores = torch.stack([per_verifier[v] for v in rl.verifier_function], dim=1) \
            if rl.verifier_function else torch.zeros(len(totals), 0)
        ctx.flow.put(batch, {"rewards": list(total.float().unbind()),
                             "verifier_scores": list(scores.float().unbind())})
    else:
        ctx.flow.put(None, {})
    writer = batch is not None
    metrics = global_stats("reward", totals, writer)
    for name in rl.verifier_function:
        scores = per_verifier[name].tolist() if writer else []
        metrics[f"reward/{name}"] = global_stats("v", scores, writer)["v/mean"]
    # Verifier calls that ran past their time limit or raised (scored as failed, logged).
    # Calls whose worker did not even take the request (stopped, frozen) are counted apart.
    failed = ctx.reward_pool.take_counts() if ctx.reward_pool is not None else (0, 0, 0)
    (metrics["reward/timeouts"], metrics["reward/errors"],
     metrics["reward/unresponsive_workers"]) = global_sums(list(map(float, failed)))
    metrics["response/truncated_fraction"] = global_stats("f", truncated, writer)["f/mean"]
    if rl.overlong_buffer_len:
        metrics["reward/overlong_penalty"] = global_stats("p", overlong, writer)["p/mean"]
    return metrics


def _retool_call_bonus(per_verifier: dict, tool_calls: list, rl) -> torch.Tensor:
    """MindSpeed-RL's retool_reward: a wrong answer gains 0.1 per tool call, up to 0; the
    verifier's scores are updated in place, the weighted change is returned."""
    scores = per_verifier["retool_reward"]
    bonused = retool_call_bonus(scores, torch.stack(tool_calls).float())
    per_verifier["retool_reward"] = bonused
    return rl.verifier_weight[rl.verifier_function.index("retool_reward")] * (bonused - scores)


def dynamic_sampling(ctx: PhaseContext) -> dict[str, float]:
    """DAPO, closing each generation round: drop the groups whose filter metric is equal
    for all their samples (zero advantage, no signal); while fewer than
    ``global_batch_size`` informative groups are in the dock, ask for another round on
    fresh prompts (after ``max_num_gen_batches`` rounds: stop, or fill with uninformative
    groups and say so).

    The dropped rows leave the TransferDock; so do informative groups beyond the batch.
    """
    rl, gbs = ctx.rl, ctx.batch.prompts_per_iteration
    # [(group_id, [row ids])] in generation order, the same on every rank, across rounds
    seen = ctx.it.groups
    new = _classify_new_groups(ctx)
    seen.generated += len(new)
    seen.kept += [(g, rows) for g, rows, informative in new if informative]
    seen.dropped += [(g, rows) for g, rows, informative in new if not informative]
    kept, dropped, rounds = seen.kept, seen.dropped, ctx.it.generation_round + 1
    if len(kept) < gbs:
        if not (rl.max_num_gen_batches and rounds >= rl.max_num_gen_batches):
            ctx.it.batch_ready = False  # another round on fresh prompts
            return {}
        kept, dropped = _fill_shortfall(ctx, kept, dropped, rounds)
    kept, extra = kept[:gbs], kept[gbs:]
    ctx.flow.retire(sorted(r for _, rows in dropped + extra for r in rows))
    ctx.flow.note("dynamic_sampling/kept", sorted(r for _, rows in kept for r in rows))
    return {"dynamic_sampling/num_gen_batches": float(rounds),
            "dynamic_sampling/kept_group_fraction":
                min(len(kept), gbs) / max(seen.generated, 1)}


def _fill_shortfall(ctx: PhaseContext, kept: list, dropped: list, rounds: int
                    ) -> tuple[list, list]:
    """The rounds ran out: stop (``filter_groups_shortfall: error``) or complete the batch
    with the last uninformative groups (``fill``)."""
    rl, gbs = ctx.rl, ctx.batch.prompts_per_iteration
    message = (f"dynamic sampling: {len(kept)} of {gbs} informative groups after "
               f"max_num_gen_batches={rl.max_num_gen_batches} rounds of "
               f"{ctx.batch.prompts_per_generation_round} prompts")
    if rl.filter_groups_shortfall == "error":
        raise ValueError(f"{message} (rl_config.filter_groups_shortfall: error); raise "
                         "max_num_gen_batches, or set filter_groups_shortfall: fill")
    fill = gbs - len(kept)
    if ctx.ranks.rank == 0:
        print(f"{message}: continuing with {fill} uninformative groups (zero "
              "advantage; rl_config.filter_groups_shortfall: fill)", flush=True)
    return kept + dropped[-fill:], dropped[:-fill]


def _classify_new_groups(ctx: PhaseContext) -> list[tuple[int, list[int], bool]]:
    """(group_id, row ids, informative) of the groups generated since the last call, every
    rank's, ordered by group id."""
    rl, n = ctx.rl, ctx.rl.n_samples_per_prompt
    by_reward = rl.filter_groups_metric == "reward"
    column = "rewards" if by_reward else "verifier_scores"
    batch = ctx.flow.get([column, "group_id"], ctx.batch.responses_per_generation_dp_rank,
                         "gen_writers", whole_groups=True)
    mine = []
    if batch is not None:
        values = torch.stack(batch[column])
        if not by_reward:
            values = values[:, list(rl.verifier_function).index(rl.filter_groups_metric)]
        groups = torch.stack(batch["group_id"])
        order = torch.argsort(groups, stable=True)  # whole groups: n rows per group id
        informative = groups_with_reward_spread(values[order], n).tolist()
        rows = torch.tensor(batch.rows)[order].view(-1, n).tolist()
        mine = [(int(g), r, f) for g, r, f in zip(groups[order][::n].tolist(), rows, informative)]
    everyone = [None] * ctx.ranks.world
    dist.all_gather_object(everyone, mine)
    return sorted(g for part in everyone for g in part)


def advantages(ctx: PhaseContext) -> dict[str, float]:
    """The job's estimator (``rl_config.adv_estimator``, ``mindspeed_rl/algorithms/``) on
    the columns it reads: before the forwards, on whole groups where they were generated
    (the ``adv`` phase), or after them in the training layout (its own phase). The
    estimator decides its whitening and takes the KL into its reward when it declares
    ``kl_in_reward``; this phase gathers its inputs, passes the cross-rank sums in and
    writes its results."""
    est, kl_in_reward = ctx.estimator, ctx.features.kl_in_reward
    columns = ["response_ids", "rewards", *est.reads]
    if ctx.flow.carries("response_mask"):  # multi-turn: the model's own tokens
        columns.append("response_mask")
    if kl_in_reward:
        columns += [c for c in ("logprobs_old", "logprobs_ref") if c not in columns]
    if est.whole_groups:
        batch = ctx.flow.get(columns + ["group_id", "sample_idx"],
                             ctx.batch.kept_responses_per_generation_dp_rank, "gen_writers",
                             whole_groups=True)
        counted = batch is not None
    else:
        batch = ctx.flow.get(columns, ctx.batch.responses_per_training_dp_rank, "train")
        counted = counts_in_train_layout()
    order = _row_order(batch, ctx.rl.n_samples_per_prompt, est.whole_groups)
    x = _advantage_inputs(ctx, batch, order, kl_in_reward)

    def sums(values: list[float]) -> list[float]:
        return global_sums([v if counted else 0.0 for v in values])

    out = est.fn(x, sums, **est.kwargs(ctx.config))
    results = {"advantages": out.advantages}
    if out.returns is not None:
        results["returns"] = out.returns
    if batch is None:
        ctx.flow.put(None, {})
    else:  # back in the batch's row order, each cut to its response
        at = torch.argsort(order).tolist()
        lengths = [len(r) for r in batch["response_ids"]]
        ctx.flow.put(batch, {name: [values[at[i]][:n].clone() for i, n in enumerate(lengths)]
                             for name, values in results.items()})
    metrics = dict(out.metrics)
    if est.kl_in_reward:  # it may take the KL into its reward: its coefficient is logged
        metrics.update(_kl_metrics(ctx, x, sums))
    return metrics


def _row_order(batch: DockBatch | None, n: int, whole_groups: bool) -> torch.Tensor:
    """The order the estimator reads the batch's rows in: by (group_id, sample_idx) for a
    whole-group estimator (its math never relies on the dock's row order), else as
    delivered."""
    if batch is None:
        return torch.zeros(0, dtype=torch.int64)
    if not whole_groups:
        return torch.arange(len(batch))
    group, sample = torch.stack(batch["group_id"]), torch.stack(batch["sample_idx"])
    order = torch.argsort(group * n + sample)
    group, sample = group[order].view(-1, n), sample[order].view(-1, n)
    if not ((group == group[:, :1]).all() and (sample == torch.arange(n)).all()):
        raise RuntimeError("adv: the rows delivered do not form whole groups of "
                           f"n_samples_per_prompt={n} samples")
    return order


def _advantage_inputs(ctx: PhaseContext, batch: DockBatch | None, order: torch.Tensor,
                      kl_in_reward: bool) -> AdvantageInputs:
    """The estimator's view of the rows (in ``order``), padded to the longest response; a
    rank without rows passes empty ones (it still takes part in the sums)."""
    n = ctx.rl.n_samples_per_prompt
    if batch is None:
        empty = torch.zeros(0, 0)
        return AdvantageInputs(torch.zeros(0), empty, empty, n, kl_coef=ctx.state.kl_ctrl.value)

    def padded(column: str) -> torch.Tensor | None:
        if column not in batch.columns:
            return None
        return pad_cells([batch[column][i].float() for i in order.tolist()])[1]

    response_mask = pad_cells([torch.ones(len(batch["response_ids"][i]))
                               for i in order.tolist()])[0]
    loss_mask = padded("response_mask")
    old, ref = padded("logprobs_old"), padded("logprobs_ref")
    kl = kl_penalty(old, ref, ctx.rl.kl_penalty) * response_mask if kl_in_reward else None
    return AdvantageInputs(
        rewards=torch.stack([batch["rewards"][i] for i in order.tolist()]),
        response_mask=response_mask,
        loss_mask=response_mask if loss_mask is None else loss_mask, group_size=n,
        values=padded("values"), logprobs_old=old, logprobs_teacher=padded("logprobs_teacher"),
        kl=kl, kl_coef=ctx.state.kl_ctrl.value)


def _kl_metrics(ctx: PhaseContext, x: AdvantageInputs, sums) -> dict[str, float]:
    """The KL coefficient, and with the KL in the reward its per-token mean (each
    sequence's token mean, averaged over the sequences), which the adaptive controller
    follows."""
    metrics = {"actor/kl_coef": x.kl_coef}
    if x.kl is not None:
        s_kl, rows = sums([float(token_mean_kl_per_sequence(x.kl, x.response_mask).sum()),
                           float(len(x.rewards))])
        metrics["actor/reward_kl_penalty"] = s_kl / max(rows, 1.0)
        ctx.state.kl_ctrl.update(s_kl / max(rows, 1.0), int(rows))
    return metrics


# ---------------------------------------------------------------------------------------
# forward passes of the other roles
# ---------------------------------------------------------------------------------------
def _replayed(ctx: PhaseContext) -> tuple[str, ...]:
    """The routing column a forward pass replays (routing replay R3: the rollout's)."""
    return (ROUTING,) if ctx.features.replays_rollout_routing else ()


def old_logprobs(ctx: PhaseContext) -> dict[str, float]:
    """The actor's log-probs before this iteration's first optimizer step; with routing
    replay R2 also the experts this pass chose (replayed by the update), with R3 this pass
    replays the rollout's."""
    mode = ctx.features.router_replay
    batch = ctx.flow.get(["prompt_ids", "response_ids", *_replayed(ctx)],
                         ctx.batch.responses_per_training_dp_rank, "train")
    rows = row_batch(batch, _replayed(ctx))
    with replaying(ctx.roles.actor.model, {"R2": RECORD, "R3": REPLAY}.get(mode)) as routing:
        logp, _ = forward_logprobs(ctx.roles.actor.model, rows,
                                   ctx.batch.micro_batching[names.OLD_LOG_P], ctx.vocab_size,
                                   temperature=ctx.temperature, routing=routing)
    out = {"logprobs_old": logp}
    if mode == "R2":
        out[ROUTING] = routing.recorded(len(rows))
    ctx.flow.put(batch, out)
    return {}


def reference_logprobs(ctx: PhaseContext) -> dict[str, float]:
    """The frozen reference's log-probs (the KL anchor), onloaded for this phase only."""
    batch = ctx.flow.get(["prompt_ids", "response_ids", *_replayed(ctx)],
                         ctx.batch.responses_per_training_dp_rank, "train")
    roles, rows = ctx.roles, row_batch(batch, _replayed(ctx))
    if roles.reference_layout is not None:  # ref_config's own TP x PP
        if _replayed(ctx):
            raise RouterReplayError("rl_config.router_replay=R3 replays the rollout's routing "
                                    "in the reference's training layout only; remove "
                                    "ref_config's own parallel sizes")
        logp = logprobs_in_own_layout(ctx, roles.reference, roles.reference_swap,
                                      roles.reference_layout, ctx.vocab_size, rows)
    else:
        with roles.reference_swap.resident(), \
                replaying(roles.reference, REPLAY if _replayed(ctx) else None) as routing:
            logp, _ = forward_logprobs(roles.reference, rows,
                                       ctx.batch.micro_batching[names.REFERENCE_MODEL],
                                       ctx.vocab_size, temperature=ctx.temperature,
                                       routing=routing)
    ctx.flow.put(batch, {"logprobs_ref": logp})
    return {}


def teacher_logprobs(ctx: PhaseContext) -> dict[str, float]:
    """On-policy distillation: the frozen teacher's log-probs of the student's sampled
    tokens, at the sampling temperature, through the same packed forward as the reference;
    onloaded for this phase only. In a layout of its own the rows of every training-DP
    rank are shared out over the teacher's DP ranks and the log-probs brought back
    (``own_layout.py``)."""
    batch = ctx.flow.get(["prompt_ids", "response_ids"],
                         ctx.batch.responses_per_training_dp_rank, "train")
    teacher = ctx.roles.teacher
    if teacher.layout is None:
        with teacher.swap.resident():
            logp, _ = forward_logprobs(teacher.model, row_batch(batch),
                                       ctx.batch.micro_batching[names.REFERENCE_MODEL],
                                       teacher.vocab_size, temperature=ctx.temperature)
    else:
        logp = logprobs_in_own_layout(ctx, teacher.model, teacher.swap, teacher.layout,
                                      teacher.vocab_size, row_batch(batch))
    ctx.flow.put(batch, {"logprobs_teacher": logp})
    return {}


def values(ctx: PhaseContext) -> dict[str, float]:
    """The critic's values of the rollout (the baseline GAE and the value clip use)."""
    batch = ctx.flow.get(["prompt_ids", "response_ids"], ctx.batch.responses_per_training_dp_rank,
                         "train")
    with ctx.roles.critic_swap.resident():
        vals = forward_values(ctx.roles.critic.model, row_batch(batch),
                              ctx.batch.micro_batching[names.VALUES])
    ctx.flow.put(batch, {"values": vals})
    return {}


# ---------------------------------------------------------------------------------------
# updates
# ---------------------------------------------------------------------------------------
def critic_update(ctx: PhaseContext) -> dict[str, float]:
    """``epochs`` passes of mini-batches of the clipped value loss on the GAE returns."""
    rl, b, critic = ctx.rl, ctx.batch, ctx.roles.critic
    steps = []
    with ctx.roles.critic_swap.resident():
        for epoch in range(rl.epochs):
            for _ in range(b.mini_batches_per_epoch):
                batch = ctx.flow.get(["prompt_ids", "response_ids", "values", "returns"],
                                     b.responses_per_mini_batch_per_training_dp_rank, "train",
                                     consumer=f"{names.CRITIC_UPDATE}_{epoch}")
                steps.append(critic.update(
                    row_batch(batch, ("values", "returns")), b.micro_batching[names.CRITIC_UPDATE],
                    cliprange_value=rl.cliprange_value))
    metrics = _mean_of_steps(steps, "critic")
    # over the mini-batches where it is defined (NaN when the returns of none varied)
    defined = [s["explained_variance"] for s in steps if not math.isnan(s["explained_variance"])]
    metrics["critic/explained_variance"] = sum(defined) / len(defined) if defined else math.nan
    metrics["critic/lr"] = critic.lr
    metrics["critic/skipped_steps"] = float(critic.step_guard.pop_skipped())
    return metrics


def actor_update(ctx: PhaseContext) -> dict[str, float]:
    """``epochs`` passes of mini-batches of the clipped policy loss (+ KL, entropy); one
    optimizer step per mini-batch. PPO's actor waits ``critic_warmup`` iterations."""
    rl, b, actor, features = ctx.rl, ctx.batch, ctx.roles.actor, ctx.features
    if ctx.it.iteration <= rl.critic_warmup:
        return {}
    extras = ["advantages", "logprobs_rollout", "weight_version"]
    if ctx.flow.carries("response_mask"):  # multi-turn: the loss covers the model's tokens
        extras.append("response_mask")
    if ctx.flow.carries("logprobs_old"):  # else on-policy: the update's own, detached
        extras.append("logprobs_old")
    if features.router_replay:  # the routing every micro-step replays (R2: old pass's)
        extras.append(ROUTING)
    if features.partial_rollout:  # which tokens older weights generated: importance-weighted
        extras += ["token_versions", "birth_iteration"]
    if features.kl_loss_coef:
        extras.append("logprobs_ref")
    proximal = actor.weight_version  # the weights the old log-probs were computed with
    steps, lags = [], []
    for epoch in range(rl.epochs):
        for _ in range(b.mini_batches_per_epoch):
            batch = ctx.flow.get(["prompt_ids", "response_ids", *extras],
                                 b.responses_per_mini_batch_per_training_dp_rank, "train",
                                 consumer=f"{names.UPDATE}_{epoch}")
            rows = row_batch(batch, tuple(extras))
            lags.append(version_lag(rl, rows, actor.weight_version))
            if features.partial_rollout:
                mark_off_policy(rows, proximal, ctx.it.iteration,
                                features.partial_rollout_max_split)
            steps.append(actor.update(
                rows, b.micro_batching[names.UPDATE], rl,
                kl_coef=features.kl_loss_coef, vocab_size=ctx.vocab_size,
                norm_length=features.response_limit, temperature=ctx.temperature,
                is_norm=rollout_is_batch_mean(rl, rows),
                replay_routing=features.router_replay is not None,
                off_policy=features.partial_rollout))
    return _actor_metrics(ctx, steps, lags)


def _actor_metrics(ctx: PhaseContext, steps: list[dict[str, float]], lags: list) -> dict:
    """The update's statistics over its optimizer steps, under their namespaces."""
    metrics = _mean_of_steps(steps, "actor")
    metrics.update({k[len("actor/"):]: metrics.pop(k) for k in list(metrics)
                    if k.startswith(("actor/rollout_corr/", "actor/routing/"))})
    metrics.update(staleness_metrics(lags))
    if ctx.features.partial_rollout:
        for key in ("off_policy_token_fraction", "off_policy_is_weight_mean"):
            metrics[f"rollout/{key}"] = metrics.pop(f"actor/{key}")
        metrics["rollout/off_policy_is_weight_max"] = max(s["off_policy_is_weight_max"]
                                                          for s in steps)
        metrics.pop("actor/off_policy_is_weight_max")
    metrics["rollout/logprob_abs_diff_mean"] = metrics.pop("actor/rollout_logprob_abs_diff")
    metrics["rollout/logprob_abs_diff_max"] = max(s["rollout_logprob_abs_diff_max"]
                                                  for s in steps)
    metrics.pop("actor/rollout_logprob_abs_diff_max")
    metrics["actor/lr"] = ctx.roles.actor.lr
    metrics["actor/skipped_steps"] = float(ctx.roles.actor.step_guard.pop_skipped())
    return metrics
