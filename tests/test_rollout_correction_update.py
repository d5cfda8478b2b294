"""verl's rollout correction inside the actor's update (megatron-core, 2 gloo ranks, DP=2).

One launch, several updates of the same tiny Qwen2 from the same weights, on a batch whose
rollout log-probs differ from the training engine's by noise (and one catastrophic token):

* ``rollout_is: token`` gives the gradients of the older ``rollout_is_threshold`` path;
* ``rollout_rs`` (IcePop's two-sided band) gives the gradients of the same batch whose loss
  mask is the rejection mask computed by the pure function: the rejected tokens leave the
  loss and its token count;
* ``rollout_is_batch_normalize`` makes the IS weights average 1 over the mini-batch of
  both ranks (pg_loss = -1 with advantages 1 at ratio 1; -mean(w) without);
* the veto removes the sequence holding the catastrophic token;
* the ``rollout_corr/*`` diagnostics equal the pure functions' over both ranks' rows;
* ``staleness/*`` reduce the lag in weight versions over the ranks and the steps.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

ROWS = 6


def _worker(hf_dir: str):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.algorithms import rollout_correction as rc
    from mindspeed_rl.config.batch_plan import MicroBatching
    from mindspeed_rl.config.schema import ActorConfig, RLConfig
    from mindspeed_rl.engine.actor import MegatronActor, forward_logprobs
    from mindspeed_rl.engine.micro_batches import RowBatch
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.trainer.off_policy import (rollout_is_batch_mean,
                                                          staleness_metrics, version_lag)

    setup_platform()
    arch = describe_hf_dir(hf_dir)
    initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), 1, 1), seed=1234)
    try:
        dp = ps.get_data_parallel_rank()
        g = torch.Generator().manual_seed(50 + dp)
        prompts = [torch.randint(3, 300, (5,), generator=g) for _ in range(ROWS)]
        responses = [torch.randint(3, 300, (3 + k,), generator=g) for k in range(ROWS)]

        def policy():
            model = build_gpt_model(arch, build_transformer_config(
                arch, calculate_per_token_loss=True))
            load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
            return model

        spec = MicroBatching(micro_batch_size=2)
        old, _ = forward_logprobs(policy(), RowBatch(prompts, responses, {}), spec,
                                  arch.vocab_size)
        rollout = [o + 0.4 * torch.randn(o.shape, generator=g) for o in old]
        rollout[1][2] = old[1][2] + 15.0  # a catastrophic token: ratio e^-15
        adv = [torch.randn(len(r), generator=g) for r in responses]

        def update(rl, extras=None, advantages=None, is_norm=None):
            actor = MegatronActor(policy(), ActorConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0),
                                  total_steps=2, use_distributed_optimizer=False, bf16=False)
            cols = {"advantages": advantages or adv, "logprobs_old": old,
                    "logprobs_rollout": rollout, **(extras or {})}
            stats = actor.update(RowBatch(prompts, responses, cols), spec, rl, kl_coef=0.0,
                                 vocab_size=arch.vocab_size, is_norm=is_norm)
            return [p.main_grad.detach().clone() for p in actor.model.parameters()], stats

        def grad_diff(a, b):
            t = torch.tensor([max(float((x - y).abs().max()) for x, y in zip(a, b))])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        out = {}
        base = dict(clip_ratio=0.2, entropy_coeff=0.0)
        g_old, _ = update(RLConfig(rollout_is_threshold=2.0, **base))
        g_new, s_new = update(RLConfig(rollout_is="token", rollout_is_threshold=2.0, **base))
        out["token_is_vs_threshold"] = grad_diff(g_old, g_new)
        # rejection (IcePop band) = the same loss over the rejection mask
        keep = [rc.rejection_mask(o[None], r[None], torch.ones(1, len(o)), "token", 1.5, 0.6)[0]
                for o, r in zip(old, rollout)]
        g_rs, s_rs = update(RLConfig(rollout_rs="token", rollout_rs_threshold=1.5,
                                     rollout_rs_threshold_lower=0.6, **base))
        g_mask, s_mask = update(RLConfig(**base), {"response_mask": keep})
        g_plain, _ = update(RLConfig(**base))
        out["rs_vs_mask"] = grad_diff(g_rs, g_mask)
        out["rs_vs_plain"] = grad_diff(g_rs, g_plain)
        out["rs_loss_tokens"] = (s_rs["loss_tokens"], s_mask["loss_tokens"])
        out["rs_masked_fraction"] = s_rs["rollout_corr/rs_masked_fraction"]
        local = torch.tensor([float(sum(k.sum() for k in keep)), float(sum(len(k) for k in keep))])
        dist.all_reduce(local)
        out["rs_expected_fraction"] = 1 - float(local[0] / local[1])
        # batch normalisation: advantages 1, ratio 1 -> pg_loss = -mean(w)
        ones = [torch.ones(len(r)) for r in responses]
        rows = RowBatch(prompts, responses, {"logprobs_old": old, "logprobs_rollout": rollout})
        for level in ("token", "sequence"):
            rl = RLConfig(rollout_is=level, rollout_is_batch_normalize=True, **base)
            mean = rollout_is_batch_mean(rl, rows)
            _, s_norm = update(rl, advantages=ones, is_norm=mean)
            _, s_raw = update(rl, advantages=ones)
            out[f"norm_{level}"] = (s_norm["pg_loss"], s_raw["pg_loss"], mean)
        # veto: the row with the catastrophic token leaves the loss
        _, s_veto = update(RLConfig(rollout_token_veto_threshold=1e-4, **base))
        out["veto"] = (s_veto["rollout_corr/veto_seq_fraction"], s_veto["loss_tokens"],
                       s_new["loss_tokens"], len(responses[1]))
        # diagnostics over both ranks' rows
        R = max(len(r) for r in responses)
        pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, R - len(x))) for x in xs])
        mask = pad([torch.ones(len(r)) for r in responses])
        sums = rc.mismatch_sums(pad(old), pad(rollout), mask, 2.0)
        t = torch.tensor([sums[k] for k in rc.MISMATCH_SUM_KEYS], dtype=torch.float64)
        dist.all_reduce(t)
        expected = rc.mismatch_metrics(dict(zip(rc.MISMATCH_SUM_KEYS, t.tolist())))
        out["diagnostics"] = ({k: s_new[f"rollout_corr/{k}"] for k in expected}, expected)
        # staleness over both ranks: rank r's rows from weights v r, trained at v 3
        versions = RowBatch(prompts, responses, {"weight_version": [torch.tensor(dp)] * ROWS})
        lag = version_lag(RLConfig(max_weight_version_lag=2), versions, 3)
        out["staleness"] = staleness_metrics([lag, lag])
        return out
    finally:
        destroy_megatron_parallel()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir = make_tiny_hf_dir("qwen2", tmp_path_factory.mktemp("rc") / "qwen2", seed=3)
    return run_on_ranks(_worker, 2, str(hf_dir), timeout=900)[0]


def test_token_is_equals_the_threshold_path(results):
    assert results["token_is_vs_threshold"] == 0.0


def test_rejection_acts_on_the_loss_mask(results):
    assert results["rs_vs_mask"] < 1e-7
    assert results["rs_vs_plain"] > 1e-4  # rejection really changed the gradient
    tokens_rs, tokens_mask = results["rs_loss_tokens"]
    assert tokens_rs == tokens_mask
    assert results["rs_masked_fraction"] == pytest.approx(results["rs_expected_fraction"])
    assert 0 < results["rs_masked_fraction"] < 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalisation_over_both_ranks(results, level):
    normed, raw, mean = results[f"norm_{level}"]
    if level == "token":  # every token weighs w / mean(w): the token mean is exactly 1
        assert normed == pytest.approx(-1.0, abs=1e-5)
    assert raw == pytest.approx(normed * mean, rel=1e-5)
    assert abs(mean - 1.0) > 1e-3


def test_veto_removes_the_catastrophic_sequence(results):
    seq_fraction, tokens_veto, tokens_all, vetoed_len = results["veto"]
    assert seq_fraction == pytest.approx(2 / (2 * ROWS))  # row 1 of each rank
    assert tokens_all - tokens_veto == 2 * vetoed_len


def test_diagnostics_equal_the_pure_functions(results):
    got, expected = results["diagnostics"]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert got["kl_k3"] > 0 and got["ess_token"] < 1


def test_staleness_metrics_over_ranks_and_steps(results):
    m = results["staleness"]
    assert m["staleness/version_lag_token_mean"] == pytest.approx(2.5)  # lags 3 and 2
    assert m["staleness/version_lag_row_mean"] == pytest.approx(2.5)
    assert m["staleness/version_lag_max"] == 3
    assert m["staleness/over_bound_token_fraction"] == pytest.approx(0.5)  # rank 0's
