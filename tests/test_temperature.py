"""Training evaluates the policy that sampled: logits / temperature in every log-prob.

At TP=2 (vocabulary-parallel, padded vocabulary columns), PP=2 and DP=2 (fp32, gloo,
2 ranks), with padded and packed micro-batches, at temperature T = 0.5:

* the old/ref log-prob forward and its entropies equal transformers'
  ``log_softmax(logits / T)`` and its entropy;
* an update whose old and reference log-probs come from that forward (on-policy, the
  reference = the policy) sees ratio 1 and KL 0, and reports the entropy at T: an
  update that ignored T would see a ratio p_1 / p_T != 1 and a non-zero KL.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.config.batch_plan import MicroBatching
from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

T = 0.5
LAYOUTS = [(2, 1), (1, 2), (1, 1)]  # (TP, PP); the rest is DP
VARIANTS = {"padded": MicroBatching(micro_batch_size=3),
            "packed": MicroBatching(micro_batch_size=3, packed=True)}


def _rows(dp_rank: int):
    from mindspeed_rl.engine.micro_batches import RowBatch

    g = torch.Generator().manual_seed(40 + dp_rank)
    prompts = [torch.randint(3, 380, (int(k),), generator=g) for k in (4, 7, 5, 9, 3, 6)]
    responses = [torch.randint(3, 380, (int(k),), generator=g) for k in (1, 8, 3, 11, 6, 2)]
    return RowBatch(prompts, responses, {})


@torch.no_grad()
def _transformers_at_temperature(hf_dir: str, batch, temperature: float):
    """Per row: log_softmax(logits / T) at the response tokens, and the entropy there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    logps, ents = [], []
    for prompt, response in zip(batch.prompts, batch.responses):
        tokens = torch.cat([prompt, response])[None]
        logits = model(input_ids=tokens).logits[0, len(prompt) - 1:-1] / temperature  # [R, V]
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logps.append(logp_all.gather(1, response[:, None])[:, 0])
        ents.append(-(logp_all.exp() * logp_all).sum(-1))
    return logps, ents


def _worker(hf_dir: str):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.config.schema import ActorConfig, RLConfig
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.engine.actor import MegatronActor, forward_logprobs
    from mindspeed_rl.engine.micro_batches import RowBatch

    setup_platform()
    arch = describe_hf_dir(hf_dir)

    def worst(a, b):
        local = max(float((x - y).abs().max()) if len(x) else 0.0 for x, y in zip(a, b))
        t = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    out = {}
    for tp, pp in LAYOUTS:
        initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), tp, pp), seed=1234)
        try:
            batch = _rows(ps.get_data_parallel_rank())
            ref_logp, ref_ent = _transformers_at_temperature(hf_dir, batch, T)
            raw_logp, _ = _transformers_at_temperature(hf_dir, batch, 1.0)

            def policy():
                model = build_gpt_model(arch, build_transformer_config(
                    arch, calculate_per_token_loss=True))
                load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
                return model

            model = policy()
            for name, spec in VARIANTS.items():
                logp, ent = forward_logprobs(model, batch, spec, arch.vocab_size,
                                             with_entropy=True, temperature=T)
                g = torch.Generator().manual_seed(5)
                adv = [torch.randn((), generator=g).expand(len(r)).clone()
                       for r in batch.responses]
                actor = MegatronActor(policy(), ActorConfig(lr=1e-3, weight_decay=0.0,
                                                            clip_grad=0.0),
                                      total_steps=2, use_distributed_optimizer=False, bf16=False)
                rows = RowBatch(batch.prompts, batch.responses,
                                {"advantages": adv, "logprobs_old": logp, "logprobs_ref": logp,
                                 "logprobs_rollout": ref_logp})
                rl = RLConfig(entropy_coeff=0.01, clip_ratio=0.2, kl_penalty="k3")
                stats = actor.update(rows, spec, rl, kl_coef=0.1, vocab_size=arch.vocab_size,
                                     temperature=T)
                # the token mean over every rank's rows (TP/PP peers add equal copies)
                sums = torch.tensor([sum(float(e.sum()) for e in ref_ent),
                                     float(sum(len(r) for r in batch.responses))],
                                    dtype=torch.float64)
                dist.all_reduce(sums)
                out[(tp, pp, name)] = {
                    "logp": worst(logp, ref_logp), "entropy": worst(ent, ref_ent),
                    "raw_gap": worst(ref_logp, raw_logp),
                    "ppo_kl": abs(stats["ppo_kl"]), "kl_loss": abs(stats["kl_loss"]),
                    "pg_clipfrac": stats["pg_clipfrac"],
                    "update_entropy": abs(stats["entropy"] - float(sums[0] / sums[1])),
                    "rollout_diff": stats["rollout_logprob_abs_diff_max"],
                }
        finally:
            destroy_megatron_parallel()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir = make_tiny_hf_dir("qwen2", tmp_path_factory.mktemp("temperature") / "qwen2", seed=4)
    return run_on_ranks(_worker, 2, str(hf_dir), timeout=900)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "pp2", "dp2"])
def test_forward_logprobs_and_entropy_are_those_at_the_temperature(results, layout, variant):
    r = results[(*layout, variant)]
    assert r["logp"] < 1e-4 and r["entropy"] < 1e-4, r
    assert r["raw_gap"] > 0.05  # T really changes the numbers compared


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "pp2", "dp2"])
def test_update_ratio_kl_and_entropy_use_the_temperature(results, layout, variant):
    """Old and reference log-probs from the forward at T: the update's ratio is 1 and its
    KL 0 only if it also evaluates the policy at T; its entropy is the entropy at T; its
    mismatch metric against log-probs at T is at the forward's precision."""
    r = results[(*layout, variant)]
    assert r["ppo_kl"] < 1e-6 and r["kl_loss"] < 1e-6 and r["pg_clipfrac"] == 0.0, r
    assert r["update_entropy"] < 1e-4, r
    assert r["rollout_diff"] < 1e-4, r
