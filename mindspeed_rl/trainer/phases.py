"""The phases of an RL iteration: each reads columns from the sample flow, computes, and
writes columns back (``mindspeed_rl/trainer/columns.py`` declares them).

A phase is ``phase(ctx) -> metrics``: it receives a `PhaseContext` (config, batch plan,
roles, data, its place in the layouts, the flow bound to its own name, the trainer's
counters and the iteration's state: ``context.py``) and returns its metrics, already
reduced over the ranks. Algorithms (``recipes.py``) are ordered lists of these phases;
the objective of each one is visible here, the tensor math is in
``mindspeed_rl.algorithms``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms import registry
from mindspeed_rl.algorithms import (gae_advantages,
                                     groups_with_reward_spread, kl_penalty, overlong_penalty,
                                     token_level_rewards, token_mean_kl_per_sequence, whiten)
from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.algorithms.masked import moments_from_sums
from mindspeed_rl.config.checks import response_limit
from mindspeed_rl.rewards import check_finite_scores, compute_rewards, retool_call_bonus
from mindspeed_rl.engine.actor import forward_logprobs
from mindspeed_rl.trainer.columns import FINISH_REASONS
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.own_layout import logprobs_in_own_layout
from mindspeed_rl.trainer.multi_turn import multi_turn_rollout
from mindspeed_rl.trainer.partial_rollout import partial_rollout
from mindspeed_rl.trainer.reductions import counts_in_train_layout, global_stats, global_sums
from mindspeed_rl.trainer.rollout_rows import SingleTurn, columns_of, fresh_rows, row_columns
from mindspeed_rl.trainer.rollout_correction import (rollout_is_batch_mean, staleness_metrics,
                                                      version_lag)
from mindspeed_rl.engine.critic import forward_scores, forward_values
from mindspeed_rl.engine.micro_batches import ROUTING, RowBatch
from mindspeed_rl.engine.router_replay import RECORD, REPLAY, RouterReplayError, replaying
from mindspeed_rl.transfer_dock import DockBatch


def _mean_of_steps(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]} if steps else {}


def _rows(batch: DockBatch | None, extras: tuple[str, ...] = ()) -> RowBatch:
    if batch is None:
        return RowBatch([], [], {})
    return RowBatch(batch["prompt_ids"], batch["response_ids"], {k: batch[k] for k in extras})


# ---------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------
def resharding_to_infer(ctx: PhaseContext) -> dict[str, float]:
    """The actor's weights from the training sharding into vLLM (allgather-swap)."""
    report = ctx.roles.resharder.to_infer()
    return {"resharding/peak_transition_bytes": report.peak_bytes,
            "resharding/bytes_moved": report.bytes_moved}


def resharding_to_train(ctx: PhaseContext) -> dict[str, float]:
    ctx.roles.resharder.to_train()
    return {}


def rollout(ctx: PhaseContext) -> dict[str, float]:
    """Sample n responses per prompt of this generation-DP rank's share of the batch; the
    first rank of each vLLM instance puts the rows (all samples of a prompt together).
    With ``partial_rollout_max_split`` > 1: passes over carried and fresh rows until the
    batch's groups are finished (``partial_rollout.py``); with ``multi_turn_enable``: the
    agent loop, tools between the model's turns (``multi_turn.py``)."""
    if ctx.rl.partial_rollout_max_split > 1:
        return partial_rollout(ctx)
    if ctx.rl.multi_turn_enable:
        return multi_turn_rollout(ctx)
    b, n, me = ctx.batch, ctx.rl.n_samples_per_prompt, ctx.ranks
    mine, first_group, seeds = ctx.take_round_prompts()
    rows = fresh_rows([ctx.train_data[i].prompt_ids for i in mine], mine, first_group, n,
                      ctx.roles.actor.weight_version, seeds)
    SingleTurn(ctx.roles.rollout, ctx.config.sampling_config,
               show_progress=me.rank == 0).fresh(rows, n, seeds)
    names = row_columns(partial=False, multi_turn=False, routing=ctx.rl.router_replay == "R3")
    ctx.flow.put_rows(columns_of(rows, names) if me.is_gen_writer else {}, group_size=n)
    lengths = [float(len(r.t.tokens)) for r in rows]
    prompt_tokens = sum(len(r.t.prompt) for r in rows) if me.is_gen_writer else 0
    response_tokens, prompt_tokens = global_sums([sum(lengths) if me.is_gen_writer else 0.0,
                                                  float(prompt_tokens)])
    return {**global_stats("response_length", lengths, me.is_gen_writer),
            "prompt_length/mean": prompt_tokens / b.responses_per_iteration,
            "tokens/response": response_tokens, "tokens/prompt": prompt_tokens}


# ---------------------------------------------------------------------------------------
# rewards and advantages
# ---------------------------------------------------------------------------------------
def reward_model(ctx: PhaseContext) -> dict[str, float]:
    """The reward model's score of every response, in the training layout."""
    batch = ctx.flow.get(["prompt_ids", "response_ids"], ctx.batch.responses_per_training_dp_rank,
                         "train")
    with ctx.roles.reward_model_swap.resident():
        scores = forward_scores(ctx.roles.reward_model, _rows(batch),
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
                response_limit(ctx.config), rl.overlong_buffer_len,
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


def _estimator(ctx: PhaseContext):
    """(rl_config.adv_estimator's Estimator, its keyword arguments from rl_config)."""
    est = registry.estimator(ctx.rl.adv_estimator)
    return est, {key: getattr(ctx.rl, key) for key in est.params}


def group_advantages(ctx: PhaseContext) -> dict[str, float]:
    """Each response's reward against its group's (the n samples of its prompt), by
    ``rl_config.adv_estimator`` (group_norm: GRPO; rloo; reinforce_plus_plus_baseline,
    whose advantages are then whitened over every response token of the batch)."""
    n = ctx.rl.n_samples_per_prompt
    est, params = _estimator(ctx)
    columns = ["rewards", "group_id", "sample_idx", "response_ids"]
    if est.whiten_batch and ctx.flow.carries("response_mask"):
        columns.append("response_mask")  # multi-turn: only the model's tokens are trained
    batch = ctx.flow.get(columns, ctx.batch.kept_responses_per_generation_dp_rank,
                         "gen_writers", whole_groups=True)
    advantages = []
    if batch is not None:
        # [groups, n] by (group_id, sample_idx): the math never relies on row order.
        group, sample = torch.stack(batch["group_id"]), torch.stack(batch["sample_idx"])
        order = torch.argsort(group * n + sample)
        group, sample = group[order].view(-1, n), sample[order].view(-1, n)
        if not ((group == group[:, :1]).all() and (sample == torch.arange(n)).all()):
            raise RuntimeError("adv: the rows delivered do not form whole groups of "
                               f"n_samples_per_prompt={n} samples")
        grouped = torch.stack(batch["rewards"])[order].view(-1, n)
        adv = torch.empty(len(order))
        adv[order] = est.fn(grouped, **params).reshape(-1)
        advantages = [a.expand(len(r)).clone() for a, r in zip(adv, batch["response_ids"])]
    if est.whiten_batch:
        masks = batch["response_mask"] if "response_mask" in columns and batch is not None \
            else [torch.ones(len(a)) for a in advantages]
        advantages = _whitened_over_batch(advantages, [m.float() for m in masks])
    ctx.flow.put(batch, {"advantages": advantages})
    return {}


def _whitened_over_batch(cells: list[torch.Tensor], masks: list[torch.Tensor],
                         counted: bool = True) -> list[torch.Tensor]:
    """Per-token cells whitened with the mean and unbiased variance of every rank's masked
    tokens (verl's masked_whiten over the whole batch); masked tokens become 0. A rank
    that holds copies of a peer's rows passes ``counted=False``."""
    sums = [sum(float((c * m).sum()) for c, m in zip(cells, masks)),
            sum(float((c.square() * m).sum()) for c, m in zip(cells, masks)),
            sum(float(m.sum()) for m in masks)]
    mean, var = moments_from_sums(*global_sums([v if counted else 0.0 for v in sums]))
    return [whiten(c, m, mean, var) for c, m in zip(cells, masks)]


def _token_rewards(ctx: PhaseContext, batch: DockBatch, mask: torch.Tensor,
                   kl_in_reward: bool) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(per-token rewards [rows, R], the KL to the reference [rows, R] or None, its
    coefficient): the sequence score on the last token, minus the KL controller's
    coefficient x the KL when ``kl_in_reward``."""
    scores = torch.stack(batch["rewards"])
    kl = None
    if kl_in_reward:
        _, logp_old = _padded(batch["logprobs_old"])  # (mask, values)
        _, logp_ref = _padded(batch["logprobs_ref"])
        kl = kl_penalty(logp_old, logp_ref, ctx.rl.kl_penalty) * mask
    beta = ctx.state.kl_ctrl.value
    return token_level_rewards(scores, mask, kl, beta), kl, beta


def _kl_metrics(ctx: PhaseContext, beta: float, s_kl: float, rows: float,
                kl_in_reward: bool) -> dict[str, float]:
    """The KL coefficient, and with the KL in the reward its per-token mean (which the
    adaptive controller follows)."""
    metrics = {"actor/kl_coef": beta}
    if kl_in_reward:
        metrics["actor/reward_kl_penalty"] = s_kl / max(rows, 1.0)  # KL per token
        ctx.state.kl_ctrl.update(s_kl / max(rows, 1.0), int(rows))
    return metrics


def discounted_returns(ctx: PhaseContext) -> dict[str, float]:
    """REINFORCE++: each token's discounted return of the per-token reward (the KL to the
    reference inside it when ``use_kl_in_reward``), whitened over the whole batch."""
    rl = ctx.rl
    est, params = _estimator(ctx)
    kl_in_reward = rl.use_kl_in_reward and ctx.roles.reference is not None
    columns = ["response_ids", "rewards"] + (
        ["logprobs_old", "logprobs_ref"] if kl_in_reward else [])
    batch = ctx.flow.get(columns, ctx.batch.responses_per_training_dp_rank, "train")
    counted = counts_in_train_layout()
    mask, _ = _padded([torch.ones(len(r)) for r in batch["response_ids"]])
    rewards, kl, beta = _token_rewards(ctx, batch, mask, kl_in_reward)
    returns = est.fn(rewards, mask, **params)
    lengths = [int(m.sum()) for m in mask]
    cells = [r[:k].clone() for r, k in zip(returns, lengths)]
    advantages = _whitened_over_batch(cells, [torch.ones(k) for k in lengths], counted)
    ctx.flow.put(batch, {"advantages": advantages})
    s_kl, rows = global_sums([
        float(token_mean_kl_per_sequence(kl, mask).sum()) if kl is not None and counted else 0.0,
        float(len(lengths)) if counted else 0.0])
    return _kl_metrics(ctx, beta, s_kl, rows, kl_in_reward)


def gae(ctx: PhaseContext) -> dict[str, float]:
    """PPO: token-level GAE on the critic's values; the KL to the reference inside the
    reward when ``use_kl_in_reward`` (its coefficient from the KL controller); advantages
    whitened over the whole batch."""
    rl = ctx.rl
    kl_in_reward = rl.use_kl_in_reward and ctx.roles.reference is not None
    columns = ["response_ids", "rewards", "values"] + (
        ["logprobs_old", "logprobs_ref"] if kl_in_reward else [])
    batch = ctx.flow.get(columns, ctx.batch.responses_per_training_dp_rank, "train")
    counted = counts_in_train_layout()
    mask, values = _padded(batch["values"])
    rewards, kl, beta = _token_rewards(ctx, batch, mask, kl_in_reward)
    scores = torch.stack(batch["rewards"])
    adv, returns = gae_advantages(rewards, values, mask, rl.gamma, rl.lam)
    # The KL controller reads each sequence's per-token mean KL, averaged over sequences.
    sums = [float((adv * mask).sum()), float((adv.square() * mask).sum()), float(mask.sum()),
            float(token_mean_kl_per_sequence(kl, mask).sum()) if kl is not None else 0.0,
            float(len(scores)), float((returns * mask).sum())]
    s_adv, s_adv2, tokens, s_kl, rows, s_ret = global_sums([v if counted else 0.0 for v in sums])
    if rl.advantage_whiten:
        mean = s_adv / max(tokens, 1.0)
        var = s_adv2 / max(tokens, 1.0) - mean ** 2
        adv = whiten(adv, mask, mean, var * tokens / max(tokens - 1.0, 1.0))
    lengths = [int(m.sum()) for m in mask]
    ctx.flow.put(batch, {"advantages": [a[:k].clone() for a, k in zip(adv, lengths)],
                         "returns": [r[:k].clone() for r, k in zip(returns, lengths)]})
    return {"critic/returns_mean": s_ret / max(tokens, 1.0),
            **_kl_metrics(ctx, beta, s_kl, rows, kl_in_reward)}


def _mark_off_policy(ctx: PhaseContext, rows: RowBatch, proximal: int) -> None:
    """Replace the rows' token versions by their ``off_policy`` mask (1 where weights other
    than the ``proximal`` version generated the token) and check the age bound."""
    versions = rows.extras.pop("token_versions")
    rows.extras["off_policy"] = [(v != proximal).float() for v in versions]
    births = rows.extras.pop("birth_iteration")
    bound = ctx.rl.partial_rollout_max_split - 1
    too_old = [int(b) for b in births if ctx.it.iteration - int(b) > bound]
    if too_old:
        raise RuntimeError(f"partial rollout: a row born in iteration {too_old[0]} reached "
                           f"the update of iteration {ctx.it.iteration}, older than "
                           f"partial_rollout_max_split - 1 = {bound} iterations")


def _padded(cells: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows, R] mask, [rows, R] values) of variable-length per-token cells."""
    padded = torch.nn.utils.rnn.pad_sequence(cells, batch_first=True) if cells else \
        torch.zeros(0, 0)
    mask = torch.zeros_like(padded)
    for i, c in enumerate(cells):
        mask[i, :len(c)] = 1.0
    return mask, padded.float()


# ---------------------------------------------------------------------------------------
# forward passes of the other roles
# ---------------------------------------------------------------------------------------
def _replayed(ctx: PhaseContext) -> tuple[str, ...]:
    """The routing column a forward pass replays (routing replay R3: the rollout's)."""
    return (ROUTING,) if ctx.rl.router_replay == "R3" else ()


def old_logprobs(ctx: PhaseContext) -> dict[str, float]:
    """The actor's log-probs before this iteration's first optimizer step; with routing
    replay R2 also the experts this pass chose (replayed by the update), with R3 this pass
    replays the rollout's."""
    mode = ctx.rl.router_replay
    batch = ctx.flow.get(["prompt_ids", "response_ids", *_replayed(ctx)],
                         ctx.batch.responses_per_training_dp_rank, "train")
    rows = _rows(batch, _replayed(ctx))
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
    roles, rows = ctx.roles, _rows(batch, _replayed(ctx))
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


def values(ctx: PhaseContext) -> dict[str, float]:
    """The critic's values of the rollout (the baseline GAE and the value clip use)."""
    batch = ctx.flow.get(["prompt_ids", "response_ids"], ctx.batch.responses_per_training_dp_rank,
                         "train")
    with ctx.roles.critic_swap.resident():
        vals = forward_values(ctx.roles.critic.model, _rows(batch),
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
                    _rows(batch, ("values", "returns")), b.micro_batching[names.CRITIC_UPDATE],
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
    rl, b, actor = ctx.rl, ctx.batch, ctx.roles.actor
    if ctx.it.iteration <= rl.critic_warmup:
        return {}
    extras = ["advantages", "logprobs_rollout", "weight_version"]
    if ctx.flow.carries("response_mask"):  # multi-turn: the loss covers the model's tokens
        extras.append("response_mask")
    if ctx.flow.carries("logprobs_old"):  # else on-policy: the update's own, detached
        extras.append("logprobs_old")
    if rl.router_replay != "none":  # the routing every micro-step replays (R2: old pass's)
        extras.append(ROUTING)
    partial = rl.partial_rollout_max_split > 1
    if partial:  # which tokens older weights generated: off-policy, importance-weighted
        extras += ["token_versions", "birth_iteration"]
    proximal = actor.weight_version  # the weights the old log-probs were computed with
    kl_coef = 0.0 if rl.use_kl_in_reward or ctx.roles.reference is None else rl.init_kl_coef
    if kl_coef:
        extras.append("logprobs_ref")
    steps, lags = [], []
    for epoch in range(rl.epochs):
        for _ in range(b.mini_batches_per_epoch):
            batch = ctx.flow.get(["prompt_ids", "response_ids", *extras],
                                 b.responses_per_mini_batch_per_training_dp_rank, "train",
                                 consumer=f"{names.UPDATE}_{epoch}")
            rows = _rows(batch, tuple(extras))
            lags.append(version_lag(rl, rows, actor.weight_version))
            if partial:
                _mark_off_policy(ctx, rows, proximal)
            steps.append(actor.update(
                rows, b.micro_batching[names.UPDATE], rl,
                kl_coef=kl_coef, vocab_size=ctx.vocab_size,
                norm_length=response_limit(ctx.config),
                temperature=ctx.temperature, is_norm=rollout_is_batch_mean(rl, rows)))
    metrics = _mean_of_steps(steps, "actor")
    metrics.update({k[len("actor/"):]: metrics.pop(k) for k in list(metrics)
                    if k.startswith(("actor/rollout_corr/", "actor/routing/"))})
    metrics.update(staleness_metrics(lags))
    if partial:
        for key in ("off_policy_token_fraction", "off_policy_is_weight_mean"):
            metrics[f"rollout/{key}"] = metrics.pop(f"actor/{key}")
        metrics["rollout/off_policy_is_weight_max"] = max(s["off_policy_is_weight_max"]
                                                          for s in steps)
        metrics.pop("actor/off_policy_is_weight_max")
    metrics["rollout/logprob_abs_diff_mean"] = metrics.pop("actor/rollout_logprob_abs_diff")
    metrics["rollout/logprob_abs_diff_max"] = max(s["rollout_logprob_abs_diff_max"]
                                                  for s in steps)
    metrics.pop("actor/rollout_logprob_abs_diff_max")
    metrics["actor/lr"] = actor.lr
    metrics["actor/skipped_steps"] = float(actor.step_guard.pop_skipped())
    return metrics
