"""Context parallelism changes no number: CP 2 and 4, ring and Ulysses, equal CP 1 (fp32).

One 4-rank gloo launch runs a tiny qwen2 (8 query heads over 4 KV heads) at TP 1, TP 2,
TP 2 with sequence parallelism and PP 2, first without CP and then with CP 2 (ring,
Ulysses; ring only with SP) and, at TP 1, CP 4 (ring, Ulysses). The global batch is the same in every layout (DP rank d takes rows d, d + DP,
...): ragged rows (prompts of 3-9 tokens, responses of 1-12) whose lengths are not
multiples of the chunk size. Checked within 1e-5 against the same TP/PP without CP:

* per-token log-probs and entropies of every row (old/ref log-prob forward);
* one actor update (clipped policy loss + KL + entropy) with each loss_agg_mode (token-mean,
  seq-mean-token-mean, seq-mean-token-sum-norm) and with GSPO's sequence ratio: the loss
  statistics, the grad norm and every rank's gradients (reduced over DP x CP).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.parallel.context_parallel import RING, ULYSSES
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

WORLD, ROWS, MAX_RESPONSE = 4, 16, 12
TOL = 1e-5
# (TP, PP, sequence parallel) -> the CP layouts compared with CP 1 at that TP/PP/SP
LAYOUTS = {(1, 1, False): [(2, RING), (2, ULYSSES), (4, RING), (4, ULYSSES)],
           (2, 1, False): [(2, RING), (2, ULYSSES)],
           (2, 1, True): [(2, RING)],
           (1, 2, False): [(2, RING), (2, ULYSSES)]}
AGG_CASES = [("token-mean", "vanilla"), ("seq-mean-token-mean", "vanilla"),
             ("seq-mean-token-sum-norm", "vanilla"), ("seq-mean-token-mean", "gspo")]
STATS = ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm")


def _global_batch():
    """Every row of the global batch, with its per-token extras (same on every rank)."""
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 300, (int(torch.randint(3, 10, (1,), generator=g)),),
                             generator=g) for _ in range(ROWS)]
    responses = [torch.randint(3, 300, (int(torch.randint(1, MAX_RESPONSE + 1, (1,),
                                                          generator=g)),), generator=g)
                 for _ in range(ROWS)]
    extras = {"advantages": [torch.randn((), generator=g).expand(len(r)).clone()
                             for r in responses],
              "logprobs_old": [-torch.rand(len(r), generator=g) * 6 for r in responses],
              "logprobs_ref": [-torch.rand(len(r), generator=g) * 6 for r in responses]}
    extras["logprobs_rollout"] = extras["logprobs_ref"]
    return prompts, responses, extras


def _share(dp_rank: int, dp_size: int, with_extras: bool):
    from mindspeed_rl.engine.micro_batches import RowBatch

    prompts, responses, extras = _global_batch()
    ids = list(range(dp_rank, ROWS, dp_size))
    return ids, RowBatch([prompts[i] for i in ids], [responses[i] for i in ids],
                         {k: [v[i] for i in ids] for k, v in extras.items()} if with_extras
                         else {})


def _max_world(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(hf_dir: str):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.config.batch_plan import MicroBatching
    from mindspeed_rl.config.schema import ActorConfig, RLConfig
    from mindspeed_rl.engine.actor import MegatronActor, forward_logprobs
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    arch = describe_hf_dir(hf_dir)
    spec = MicroBatching(max_tokens=48, packed=True)
    out = {}
    for (tp, pp, sp), cps in LAYOUTS.items():
        baseline = {}
        for cp, algo in [(1, RING)] + cps:
            initialize_megatron_parallel(ParallelLayout(WORLD, tp, pp, context_parallel_size=cp,
                                                        sequence_parallel=sp), seed=1234)
            try:
                def policy():
                    model = build_gpt_model(arch, build_transformer_config(
                        arch, calculate_per_token_loss=True, context_parallel_algo=algo,
                        sequence_parallel=sp))
                    load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
                    return model

                dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
                ids, batch = _share(dp_rank, dp_size, with_extras=False)
                logp, ent = forward_logprobs(policy(), batch, spec, arch.vocab_size,
                                             with_entropy=True)
                mine = {i: (lp, e) for i, lp, e in zip(ids, logp, ent)}
                rows = [None] * dist.get_world_size()
                dist.all_gather_object(rows, mine)
                every = {i: v for r in rows for i, v in r.items()}
                result = {}
                if cp == 1:
                    baseline["rows"] = every
                else:
                    result["logp"] = max(float((every[i][0] - baseline["rows"][i][0]).abs().max())
                                         for i in range(ROWS))
                    result["entropy"] = max(float((every[i][1] -
                                                   baseline["rows"][i][1]).abs().max())
                                            for i in range(ROWS))
                for mode, loss_kind in AGG_CASES:
                    rl = RLConfig(entropy_coeff=0.01, clip_ratio=0.2, clip_ratio_high=0.28,
                                  kl_penalty="low_var_kl", loss_agg_mode=mode,
                                  policy_loss=loss_kind, rollout_is_threshold=2.0)
                    actor = MegatronActor(policy(), ActorConfig(lr=1e-2, weight_decay=0.0,
                                                                clip_grad=0.0),
                                          total_steps=2, use_distributed_optimizer=False,
                                          bf16=False)
                    _, rows_x = _share(dp_rank, dp_size, with_extras=True)
                    stats = actor.update(rows_x, spec, rl, kl_coef=0.1, vocab_size=arch.vocab_size,
                                         norm_length=MAX_RESPONSE)
                    grads = [p.main_grad.detach().clone() for p in actor.model.parameters()]
                    key = (mode, loss_kind)
                    if cp == 1:
                        baseline[key] = (stats, grads)
                    else:
                        s0, g0 = baseline[key]
                        result[key] = {
                            "stats": max(abs(stats[k] - s0[k]) for k in STATS),
                            "grads": _max_world(max(float((a - b).abs().max())
                                                    for a, b in zip(grads, g0))),
                            "grad_norm": stats["grad_norm"]}
                if cp > 1:
                    out[(tp, pp, sp, cp, algo)] = result
            finally:
                destroy_megatron_parallel()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir = make_tiny_hf_dir("qwen2", tmp_path_factory.mktemp("cp") / "qwen2", seed=5,
                              num_attention_heads=8, num_key_value_heads=4)
    return run_on_ranks(_worker, WORLD, str(hf_dir), timeout=1500)[0]


CASES = [(tp, pp, sp, cp, algo) for (tp, pp, sp), cps in LAYOUTS.items() for cp, algo in cps]


@pytest.mark.parametrize("tp,pp,sp,cp,algo", CASES,
                         ids=[f"tp{t}{'sp' if s else ''}pp{p}cp{c}-"
                              f"{'ring' if a == RING else 'ulysses'}" for t, p, s, c, a in CASES])
def test_context_parallel_gives_the_cp1_numbers(results, tp, pp, sp, cp, algo):
    r = results[(tp, pp, sp, cp, algo)]
    assert r["logp"] < TOL and r["entropy"] < TOL, r
    for case in AGG_CASES:
        diffs = r[case]
        assert diffs["stats"] < TOL and diffs["grads"] < TOL, (case, diffs)
        assert diffs["grad_norm"] > 1e-3, case  # the update really moved something
