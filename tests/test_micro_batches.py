"""Micro-batch planning and layout (pure: no megatron, no processes).

The exactness of the layouts through megatron (TP=2, PP=2) is in
``tests/test_packing_exact.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from mindspeed_rl.config.batch_plan import MicroBatching
from mindspeed_rl.engine.micro_batches import (RowBatch, build_micro_batch, make_micro_batches,
                                                min_micro_batches, plan_micro_batches)
from mindspeed_rl.testing import run_on_ranks


def ragged_lengths(n=64, seed=0, prompt=(37, 39), longest=48, mean=12):
    """Prompt + response lengths like the demo after a few iterations (mean 12, max 48)."""
    rng = random.Random(seed)
    responses = [min(longest, max(1, int(rng.expovariate(1 / mean)))) for _ in range(n - 1)]
    return [rng.randint(*prompt) + r for r in responses + [longest]]


def rows(lengths_pr, extras=True):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 100, (p,), generator=g) for p, _ in lengths_pr]
    responses = [torch.randint(1, 100, (r,), generator=g) for _, r in lengths_pr]
    ex = {"advantages": [torch.tensor(float(i)) for i in range(len(lengths_pr))],
          "logprobs_old": [torch.arange(r, dtype=torch.float32) + 100 * i
                           for i, (_, r) in enumerate(lengths_pr)]} if extras else {}
    return RowBatch(prompts, responses, ex)


SPECS = [MicroBatching(max_tokens=300, packed=True), MicroBatching(max_tokens=300),
         MicroBatching(max_tokens=300, max_rows=3, packed=True),
         MicroBatching(max_tokens=300, max_rows=3),
         MicroBatching(max_tokens=300, packed=True, similar_lengths=True)]


@pytest.mark.parametrize("spec", SPECS, ids=["packed", "padded", "packed_cap", "padded_cap",
                                             "packed_similar"])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_every_row_once_within_budget(spec, extra):
    lengths = ragged_lengths()
    fewest = min_micro_batches(lengths, spec)
    groups = plan_micro_batches(lengths, spec, fewest + extra)
    assert len(groups) == fewest + extra
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        cost = (sum(lengths[i] for i in g) if spec.packed
                else len(g) * max((lengths[i] for i in g), default=0))
        assert cost <= spec.max_tokens
        assert spec.max_rows is None or len(g) <= spec.max_rows


def test_packed_groups_hold_about_the_same_real_tokens():
    lengths = ragged_lengths()
    spec = MicroBatching(max_tokens=600, packed=True)
    groups = plan_micro_batches(lengths, spec)
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert len(groups) == min_micro_batches(lengths, spec) == -(-sum(lengths) // 600)
    assert max(sums) - min(sums) <= max(lengths)


def test_packed_rows_of_similar_length_are_the_padded_plans_groups():
    """similar_lengths (packed rows side by side in attention): the padded plan's groups,
    which on a long tail lay out far fewer padded attention rows than balancing tokens."""
    lengths = [30 + (400 if i % 16 == 0 else i % 7) for i in range(64)]
    balanced = MicroBatching(max_tokens=1200, packed=True)
    similar = MicroBatching(max_tokens=1200, packed=True, similar_lengths=True)
    count = min_micro_batches(lengths, similar)
    assert count >= min_micro_batches(lengths, balanced)
    groups = plan_micro_batches(lengths, similar, count)
    assert groups == plan_micro_batches(lengths, MicroBatching(max_tokens=1200), count)

    def side_by_side(groups):
        return sum(len(g) * max((lengths[i] for i in g), default=0) for g in groups)

    assert side_by_side(groups) < 0.5 * side_by_side(plan_micro_batches(lengths, balanced, count))


def test_padded_groups_follow_length_and_waste_little():
    lengths = ragged_lengths()
    spec = MicroBatching(max_tokens=600)
    groups = plan_micro_batches(lengths, spec)
    computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    # Today's layout: every row padded to the batch's longest.
    assert sum(lengths) / computed >= 0.9 > sum(lengths) / (len(lengths) * max(lengths))


def test_row_longer_than_budget_is_refused_naming_both_numbers():
    with pytest.raises(ValueError, match=r"row of 87 tokens.*max_packing_token_size=80"):
        min_micro_batches([10, 87, 5], MicroBatching(max_tokens=80, packed=True))


def test_fewer_micro_batches_than_needed_is_refused():
    with pytest.raises(ValueError, match="at least"):
        plan_micro_batches([50, 50, 50], MicroBatching(max_tokens=100, packed=True), 1)


def test_more_micro_batches_than_rows_gives_empty_ones():
    groups = plan_micro_batches([5, 7], MicroBatching(max_tokens=100, packed=True), 4)
    assert sorted(len(g) for g in groups) == [0, 0, 1, 1]
    batch = rows([(3, 2), (4, 3)])
    mbs = make_micro_batches(batch, MicroBatching(max_tokens=100, packed=True), 4)
    empty = [m for m in mbs if not m.rows]
    assert len(empty) == 2 and all(m.mask.sum() == 0 and m.tokens.numel() == 1 for m in empty)


def test_fixed_layout_is_todays():
    batch = rows([(3, 1), (5, 4), (2, 6)])
    mbs = make_micro_batches(batch, 2)
    assert [m.rows for m in mbs] == [[0, 1], [2]]
    assert all(m.tokens.shape == (2, 9) and m.mask.shape == (2, 6) for m in mbs)
    assert mbs[1].num_real_rows == 1 and mbs[1].mask[1].sum() == 0


def test_packed_layout_indexes_each_row_in_the_one_sequence():
    pr = [(3, 1), (5, 4), (2, 6)]
    batch = rows(pr)
    mb = build_micro_batch(batch, [0, 1, 2], packed=True, pad_multiple=4)
    assert mb.tokens.shape == (1, 24) and mb.segments == [4, 9, 8, 3]
    assert mb.positions[0].tolist() == [0, 1, 2, 3] + list(range(9)) + list(range(8)) + [0, 1, 2]
    assert mb.real_tokens == 21 and mb.computed_tokens == 24 and mb.num_tokens == 11
    # Position response_index[t] holds the token before response token t (the one that
    # predicts it): the last prompt token for t = 0, else the previous response token.
    seq = mb.tokens[0]
    for row, (j, start, n) in zip(mb.rows, mb.spans):
        r = batch.responses[row]
        assert torch.equal(mb.response_ids[j, start:start + n], r)
        idx = mb.response_index[j, start:start + n]
        assert torch.equal(seq[idx[1:]], r[:-1])
        assert seq[idx[0]] == batch.prompts[row][-1]
        assert torch.equal(mb.extras["logprobs_old"][j, start:start + n],
                           batch.extras["logprobs_old"][row])
        assert torch.all(mb.extras["advantages"][j, start:start + n] == float(row))


def test_rope_sees_positions_restarting_per_packed_row():
    """The rows backend's hook on megatron's RotaryEmbedding gives every token the angle
    of its position inside its own row."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.engine.packing import ROWS, PackedInputs

    setup_platform()  # megatron's rotary embedding asks for the CUDA device

    class Stage(torch.nn.Module):  # a pipeline stage without transformer layers
        def __init__(self):
            super().__init__()
            self.rotary_pos_emb = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)

    stage = Stage()
    inputs = PackedInputs(stage)
    assert inputs.backend == ROWS
    mb = build_micro_batch(rows([(3, 2), (2, 4)]), [0, 1], packed=True)
    full = stage.rotary_pos_emb(mb.tokens.size(1))  # [S, 1, 1, d]: absolute positions
    assert inputs.arguments(mb) == {"attention_mask": None}
    per_row = stage.rotary_pos_emb(mb.tokens.size(1))  # [S, b, 1, d]
    expected = full[:, 0, 0, :][torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5])]
    assert torch.equal(per_row[:, 0, 0, :], expected)
    inputs.done()
    assert torch.equal(stage.rotary_pos_emb(mb.tokens.size(1)), full)  # padded: untouched


# ---------------------------------------------------------------------------------------
# configuration: rl_config keys, the dry-run
# ---------------------------------------------------------------------------------------
def test_budget_smaller_than_the_longest_row_fails_the_dry_run_naming_both_numbers(capsys):
    from mindspeed_rl.config.cli import main

    argv = ["--config", "configs/grpo_qwen25_7b.yaml", "--dry-run", "--world-size", "16",
            "rl_config.use_dynamic_bsz=true", "rl_config.ref_max_packing_token_size=3000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "rl_config.ref_max_packing_token_size" in err and "3000" in err
    assert "2048 + generate_config.sampling_config.max_tokens=2048 = 4096" in err


def test_dry_run_prints_each_phase_micro_batches(capsys):
    from mindspeed_rl.config import load_config, make_plan
    from mindspeed_rl.config.cli import main

    config = load_config("configs/grpo_qwen25_7b.yaml",
                         ["rl_config.actor_max_packing_token_size=6000",
                          "rl_config.dynamic_max_batch_size=16"], check_data=False)
    layouts = make_plan(config, 16).batch.micro_batching
    assert layouts["update"] == MicroBatching(1, 4096, 16, True)
    assert layouts["old_log_p"] == MicroBatching(4, 6000, 16, True)
    assert "values" not in layouts  # no critic in a GRPO job
    assert main(["--config", "configs/grpo_qwen25_7b.yaml", "--dry-run", "--world-size",
                 "16"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches (rl_config.use_dynamic_bsz / use_remove_padding)" in out
    assert "<= 4,096 tokens, packed" in out
    off = load_config("configs/grpo_qwen25_7b.yaml", ["rl_config.use_dynamic_bsz=false",
                                                      "rl_config.use_remove_padding=false"],
                      check_data=False)
    assert make_plan(off, 16).batch.micro_batching["update"] == MicroBatching(1)


# ---------------------------------------------------------------------------------------
# efficiency accounting
# ---------------------------------------------------------------------------------------
def test_counts_give_padding_efficiency_and_the_flops_of_real_tokens():
    from mindspeed_rl.config.model_spec import ModelSpec
    from mindspeed_rl.metrics.flops import forward_flops, row_forward_flops
    from mindspeed_rl.engine.efficiency import count_tokens, take_counts

    pr = [(3, 1), (5, 4), (2, 6)]
    batch = rows(pr)
    take_counts()
    count_tokens(make_micro_batches(batch, 2), training=True)  # 2 x [2, 9]: 36 positions
    c = take_counts()
    assert (c.real, c.computed) == (21, 36)
    spec = ModelSpec(source="spec", model_type="llama", hidden_size=16, intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=2, head_dim=8, vocab_size=50)
    assert spec.attention_parameters_per_layer() == 4 * 16 * 16
    flops = forward_flops(spec, tokens=c.tokens, causal_pairs=c.causal_pairs,
                          projected=c.projected)
    assert flops == pytest.approx(3 * sum(row_forward_flops(spec, p, r) for p, r in pr))
    count_tokens(make_micro_batches(batch, MicroBatching(max_tokens=30, packed=True)),
                 training=False)
    c = take_counts()
    assert c.real == c.computed == 21 and c.projected == 11


def _phase_metrics(spec, counted_rows):
    """On a rank: PhaseEfficiency's metrics of a rollout phase that generated
    ``counted_rows`` (peak 10 GFLOPS per rank, 2 seconds)."""
    from mindspeed_rl.engine.efficiency import PhaseEfficiency, count_generation

    efficiency = PhaseEfficiency(spec, counted=True, peak_gflops=10.0)
    count_generation(counted_rows)
    return efficiency.after_phase("rollout", 2.0), efficiency.iteration()


def test_generation_counts_one_prefill_per_context_and_give_the_rollout_floor():
    """count_generation: a row of context c and r new tokens is one forward of c + r
    positions with r through the output layer; rows with the same context key share its
    prefill. perf/rollout_floor_s is those FLOPs at the peak; perf/compute_floor_s (the
    training side) does not include them."""
    from mindspeed_rl.config.model_spec import ModelSpec
    from mindspeed_rl.engine.efficiency import count_generation, take_generated
    from mindspeed_rl.metrics.flops import forward_flops, row_forward_flops

    spec = ModelSpec(source="spec", model_type="llama", hidden_size=16, intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=2, head_dim=8, vocab_size=50)
    take_generated()
    count_generation([("a", 4, 3), ("b", 6, 2)])  # two contexts, nothing shared
    g = take_generated()
    assert g.projected == 5 and forward_flops(
        spec, tokens=g.tokens, causal_pairs=g.causal_pairs, projected=g.projected
    ) == pytest.approx(row_forward_flops(spec, 4, 3) + row_forward_flops(spec, 6, 2))
    count_generation([("a", 4, 3), ("a", 4, 5), ("a", 4, 1)])  # 3 samples of one prompt
    g = take_generated()
    prefill = forward_flops(spec, tokens=4, causal_pairs=10, projected=0)
    assert forward_flops(spec, tokens=g.tokens, causal_pairs=g.causal_pairs,
                         projected=g.projected) == pytest.approx(
        sum(row_forward_flops(spec, 4, r) for r in (3, 5, 1)) - 2 * prefill)
    [(metrics, iteration)] = run_on_ranks(_phase_metrics, 1, spec,
                                          [("a", 4, 3), ("a", 4, 5), ("b", 6, 2)])
    flops = (row_forward_flops(spec, 4, 3) + row_forward_flops(spec, 4, 5) - prefill
             + row_forward_flops(spec, 6, 2))
    assert metrics["perf/rollout_floor_s"] == pytest.approx(flops / 10e9)
    assert metrics["perf/mfu/rollout"] == pytest.approx(flops / 2.0 / 10e9)
    assert "perf/padding_efficiency/rollout" not in metrics
    assert iteration["perf/compute_floor_s"] == 0.0
