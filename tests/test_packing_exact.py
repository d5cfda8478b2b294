"""Token-budget and packed micro-batches give today's numbers (fp32, gloo, 2 ranks).

For TP=2, PP=2 and DP=2 layouts, a batch whose responses run from 1 to
``max_tokens`` tokens goes through the fixed layout (``micro_batch_size`` rows
padded to the batch's longest row: today's path) and through token-budget,
packed, and token-budget + packed micro-batches:

* per-token log-probs and entropies (old/ref log-prob forward), critic values and
  reward-model scores match within 1e-5;
* one actor update (clipped policy loss + KL + entropy) and one critic update give
  the same loss statistics, grad norm and gradients within 1e-5. (Not the updated
  weights: Adam's first step is about lr x sign(grad), so a 1e-8 difference in a
  near-zero gradient element moves that weight by up to 2 lr.)
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.config.batch_plan import MicroBatching
from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

WORLD = 2
MAX_TOKENS = 12  # responses of 1 .. MAX_TOKENS tokens
LAYOUTS = [(2, 1), (1, 2), (1, 1)]  # (TP, PP); the rest is DP
VARIANTS = {
    "fixed": MicroBatching(micro_batch_size=4),
    "budget": MicroBatching(max_tokens=48),
    "packed": MicroBatching(micro_batch_size=4, packed=True),
    "budget_packed": MicroBatching(max_tokens=48, packed=True),
    "budget_packed_cap": MicroBatching(max_tokens=64, max_rows=3, packed=True),
}
TOL = 1e-5
AGG_CASES = [("seq-mean-token-mean", "vanilla"), ("seq-mean-token-sum-norm", "vanilla"),
             ("seq-mean-token-mean", "gspo")]


def _rows(dp_rank: int):
    """MAX_TOKENS rows on this DP rank: responses of every length 1 .. MAX_TOKENS."""
    from mindspeed_rl.engine.micro_batches import RowBatch

    g = torch.Generator().manual_seed(100 + dp_rank)
    order = torch.randperm(MAX_TOKENS, generator=g).tolist()
    prompts = [torch.randint(3, 300, (int(torch.randint(3, 10, (1,), generator=g)),),
                             generator=g) for _ in order]
    responses = [torch.randint(3, 300, (k + 1,), generator=g) for k in order]
    return RowBatch(prompts, responses, {})


def _max_world(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rows_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return _max_world(max(float((x - y).abs().max()) if len(x) else 0.0 for x, y in zip(a, b)))


def _worker(hf_dir: str):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.checkpoint.weight_source import load_value_weights
    from mindspeed_rl.config.schema import ActorConfig, CriticConfig, RLConfig
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.models.value_head import build_value_model
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.engine.actor import MegatronActor, forward_logprobs
    from mindspeed_rl.engine.critic import MegatronCritic, forward_scores, forward_values
    from mindspeed_rl.engine.efficiency import take_counts

    setup_platform()
    arch = describe_hf_dir(hf_dir)
    out = {}
    for tp, pp in LAYOUTS:
        initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), tp, pp), seed=1234)
        try:
            batch = _rows(ps.get_data_parallel_rank())

            def policy():
                model = build_gpt_model(arch, build_transformer_config(
                    arch, calculate_per_token_loss=True))
                load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
                return model

            def critic_model():
                model = build_value_model(arch, build_transformer_config(
                    arch, calculate_per_token_loss=True), head_seed=7)
                load_value_weights(model, arch, hf_dir)
                return model

            # ---- forwards -------------------------------------------------------------
            model, values_model = policy(), critic_model()
            from mindspeed_rl.engine.packing import packing_notice

            out[(tp, pp, "notice")] = packing_notice(model)
            from dataclasses import replace

            from mindspeed_rl.engine.micro_batches import plan_micro_batches
            from mindspeed_rl.engine.schedule import micro_batches_for

            spec = VARIANTS["budget_packed"]
            used = [sorted(mb.rows) for mb in micro_batches_for(model, batch, spec)]
            out[(tp, pp, "groups")] = {
                "used": used,
                "similar": [sorted(g) for g in plan_micro_batches(batch.lengths(), replace(
                    spec, similar_lengths=True))],
                "balanced": [sorted(g) for g in plan_micro_batches(batch.lengths(), spec,
                                                                   len(used))],
                "lengths": batch.lengths()}
            fwd = {}
            for name, spec in VARIANTS.items():
                take_counts()
                logp, ent = forward_logprobs(model, batch, spec, arch.vocab_size,
                                             with_entropy=True)
                counts = take_counts()
                fwd[name] = {"logp": logp, "entropy": ent,
                             "values": forward_values(values_model, batch, spec),
                             "scores": forward_scores(values_model, batch, spec),
                             "efficiency": counts.real / counts.computed}
            # ---- one update of each role ------------------------------------------------
            base = fwd["fixed"]["logp"]
            g = torch.Generator().manual_seed(7)
            adv = [torch.randn((), generator=g).expand(len(r)).clone() for r in batch.responses]
            old = [lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in base]
            ref = [lp - 0.2 * torch.randn(lp.shape, generator=g) for lp in base]
            returns = [torch.randn(len(r), generator=g) for r in batch.responses]
            old_values = [v + 0.4 * torch.randn(v.shape, generator=g)
                          for v in fwd["fixed"]["values"]]
            rl = RLConfig(entropy_coeff=0.01, clip_ratio=0.2, kl_penalty="low_var_kl")
            upd = {}
            for name, spec in VARIANTS.items():
                from mindspeed_rl.engine.micro_batches import RowBatch

                actor = MegatronActor(policy(), ActorConfig(lr=1e-2, weight_decay=0.0,
                                                            clip_grad=0.0),
                                      total_steps=2, use_distributed_optimizer=False, bf16=False)
                rows = RowBatch(batch.prompts, batch.responses,
                                {"advantages": adv, "logprobs_old": old, "logprobs_ref": ref})
                stats = actor.update(rows, spec, rl, kl_coef=0.1, vocab_size=arch.vocab_size)
                critic = MegatronCritic(critic_model(), CriticConfig(lr=1e-2, weight_decay=0.0,
                                                                     clip_grad=0.0),
                                        total_steps=2, use_distributed_optimizer=False,
                                        bf16=False)
                crows = RowBatch(batch.prompts, batch.responses,
                                 {"values": old_values, "returns": returns})
                cstats = critic.update(crows, spec, cliprange_value=0.2)
                upd[name] = {
                    "stats": {k: stats[k] for k in ("pg_loss", "kl_loss", "entropy",
                                                    "pg_clipfrac", "ppo_kl", "grad_norm")},
                    "cstats": {k: cstats[k] for k in ("vf_loss", "vf_clipfrac", "grad_norm")},
                    "grads": [p.main_grad.detach().clone() for p in actor.model.parameters()],
                    "cgrads": [p.main_grad.detach().clone() for p in critic.model.parameters()],
                }
            # ---- DAPO / Dr.GRPO / GSPO aggregation: the same gradients in every layout ----
            for mode, loss_kind in AGG_CASES:
                rl_mode = RLConfig(entropy_coeff=0.01, clip_ratio=0.2, clip_ratio_high=0.28,
                                   clip_ratio_c=3.0, rollout_is_threshold=2.0,
                                   kl_penalty="low_var_kl", loss_agg_mode=mode,
                                   policy_loss=loss_kind)
                grads = {}
                for name in ("fixed", "budget", "budget_packed"):
                    actor = MegatronActor(policy(), ActorConfig(lr=1e-2, weight_decay=0.0,
                                                                clip_grad=0.0),
                                          total_steps=2, use_distributed_optimizer=False,
                                          bf16=False)
                    rows = RowBatch(batch.prompts, batch.responses,
                                    {"advantages": adv, "logprobs_old": old, "logprobs_ref": ref,
                                     "logprobs_rollout": ref})
                    stats = actor.update(rows, VARIANTS[name], rl_mode, kl_coef=0.1,
                                         vocab_size=arch.vocab_size, norm_length=MAX_TOKENS)
                    grads[name] = ([p.main_grad.detach().clone()
                                    for p in actor.model.parameters()], stats)
                g0, s0 = grads["fixed"]
                out[(tp, pp, mode, loss_kind)] = {
                    name: (_max_world(max(float((x - y).abs().max()) for x, y in zip(g, g0))),
                           max(abs(s[k] - s0[k]) for k in ("pg_loss", "kl_loss", "entropy")),
                           s["grad_norm"])
                    for name, (g, s) in grads.items()}
            for name in VARIANTS:
                f, u, f0, u0 = fwd[name], upd[name], fwd["fixed"], upd["fixed"]
                tensors = lambda a, b: _max_world(max(float((x - y).abs().max())  # noqa: E731
                                                      for x, y in zip(a, b)))
                out[(tp, pp, name)] = {
                    "logp": _rows_diff(f["logp"], f0["logp"]),
                    "entropy": _rows_diff(f["entropy"], f0["entropy"]),
                    "values": _rows_diff(f["values"], f0["values"]),
                    "scores": _max_world(max(abs(float(a - b)) for a, b in
                                             zip(f["scores"], f0["scores"]))),
                    "loss": max(abs(u["stats"][k] - u0["stats"][k]) for k in u["stats"]),
                    "critic_loss": max(abs(u["cstats"][k] - u0["cstats"][k]) for k in u["cstats"]),
                    "grads": tensors(u["grads"], u0["grads"]),
                    "critic_grads": tensors(u["cgrads"], u0["cgrads"]),
                    "grad_norm": u["stats"]["grad_norm"],
                    "efficiency": f["efficiency"],
                }
        finally:
            destroy_megatron_parallel()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir = make_tiny_hf_dir("qwen2", tmp_path_factory.mktemp("packing") / "qwen2", seed=3)
    return run_on_ranks(_worker, WORLD, str(hf_dir), timeout=1500)[0]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "fixed"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "pp2", "dp2"])
def test_same_numbers_as_the_padded_path(results, layout, variant):
    r = results[(*layout, variant)]
    diffs = {k: r[k] for k in ("logp", "entropy", "values", "scores", "loss", "critic_loss",
                               "grads", "critic_grads")}
    over = {k: v for k, v in diffs.items() if not v < TOL}
    assert not over, over
    assert r["grad_norm"] > 1e-3  # the update really moved something


@pytest.mark.parametrize("case", AGG_CASES, ids=["seq_mean_token_mean", "dr_grpo", "gspo"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "pp2", "dp2"])
def test_sequence_level_losses_are_exact_in_every_layout(results, layout, case):
    """Clip-higher + dual-clip + truncated IS, with each sequence-level aggregation (and
    GSPO's sequence ratio): token-budget and packed micro-batches give the fixed layout's
    loss and gradients (the units megatron divides by are sequences, counted globally)."""
    r = results[(*layout, *case)]
    for name, (grad_diff, loss_diff, grad_norm) in r.items():
        assert grad_diff < TOL and loss_diff < TOL, (name, grad_diff, loss_diff)
        assert grad_norm > 1e-4, name


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "pp2", "dp2"])
def test_the_layouts_really_differ(results, layout):
    """The comparison is not of one layout with itself: the fixed path computes padding."""
    eff = {v: results[(*layout, v)]["efficiency"] for v in VARIANTS}
    assert eff["fixed"] < 0.85
    assert eff["budget_packed"] == eff["packed"] == 1.0
    assert eff["fixed"] < eff["budget"] < 1.0


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "pp2", "dp2"])
def test_start_up_notice_names_thd(results, layout):
    """Our core attention (SDPA on CPU) takes PackedSeqParams: packed rows reach it as THD
    (megatron's local attention, which cannot, is covered in tests/test_attention.py)."""
    notice = results[(*layout, "notice")]
    assert notice.startswith("use_remove_padding: packed sequences through megatron "
                             "PackedSeqParams (THD) in SDPAttention"), notice


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "pp2", "dp2"])
def test_thd_packing_balances_real_tokens(results, layout):
    """With THD packing no row is padded inside attention, so the token-budget plan balances
    real tokens over the micro-batches (it groups rows of similar length only for the
    side-by-side fallback of megatron's local attention)."""
    r = results[(*layout, "groups")]
    assert r["used"] == r["balanced"] != r["similar"]
