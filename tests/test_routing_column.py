"""The routed_experts column (pure tensors): its dtype, the filler of padding, the comparison,
and its alignment with the tokens of a row continued across a partial-rollout pass and across
multi-turn turns (tool tokens take the routes of the prefill that read them), through the
dock's row columns and back."""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.algorithms.routing import (carry_routing, differing_routes, distinct_experts,
                                             routing_dtype)
from mindspeed_rl.rollout.agent_loop import Trajectory
from mindspeed_rl.trainer.rollout_parts.rows import Row, columns_of, row_columns, rows_of
from mindspeed_rl.transfer_dock import DockBatch

L, K, E = 3, 2, 16


def _features(*, partial: bool, multi_turn: bool):
    """The features row_columns reads (router_replay R3: the engine's routes)."""
    from types import SimpleNamespace

    return SimpleNamespace(partial_rollout=partial, multi_turn=multi_turn,
                           replays_rollout_routing=True)


def routes_of(tokens: list[int], tag: int) -> torch.Tensor:
    """Routes that name their token and the pass that fed it: [T, L, k] for T tokens fed."""
    t = torch.tensor(tokens[:-1]).view(-1, 1, 1) % 7
    return (t + tag * 7 + torch.arange(L).view(1, -1, 1) + torch.arange(K)).to(torch.uint8) % E


def test_dtype_filler_and_comparison():
    assert routing_dtype(16) == torch.uint8 and routing_dtype(256) == torch.uint8
    assert routing_dtype(257) == torch.int16 and routing_dtype(40000) == torch.int32
    fill = distinct_experts(5, 4, 6)
    assert all(len(set(row.tolist())) == 4 for row in fill)  # distinct within each token
    with pytest.raises(ValueError):
        distinct_experts(1, 7, 6)
    a = torch.tensor([[[1, 2]], [[3, 4]]])
    assert differing_routes(a, torch.tensor([[[2, 1]], [[3, 5]]])).tolist() == [1]


def test_continued_and_multi_turn_rows_keep_routes_aligned_with_tokens():
    prompt = [11, 12, 13, 14]
    t = Trajectory(prompt=prompt, seed=0)
    t.add_model_turn([21, 22, 23], [0.0] * 3, routes_of(prompt + [21, 22, 23], tag=1))
    t.add_tool_turn([31, 32])  # read by the next turn's prefill
    so_far = prompt + t.tokens
    t.add_model_turn([41, 42], [0.0] * 2, routes_of(so_far + [41, 42], tag=2))
    # the dock round trip of a partial row, continued in a later pass
    row = Row(t, prompt_index=0, group_id=0, sample_idx=0, weight_version=0)
    names = row_columns(_features(partial=True, multi_turn=True))
    cols = columns_of([row], names)
    back = rows_of(DockBatch(rows=[0], columns=cols, token_lengths=[0]))[0].t
    back.add_model_turn([51], [0.0], routes_of(prompt + back.tokens + [51], tag=3))
    fed = prompt + back.tokens
    assert back.routing.shape == (len(fed) - 1, L, K) and back.routing.dtype == torch.uint8
    # each token keeps the routes of the pass that first fed it
    first = len(prompt) + 3 - 1  # pass 1 fed the prompt and its first two tokens
    second = len(prompt) + 3 + 2 + 2 - 1  # pass 2 fed up to its own last-but-one token
    expected = torch.cat([routes_of(fed, 1)[:first], routes_of(fed, 2)[first:second],
                          routes_of(fed, 3)[second:]])
    assert torch.equal(back.routing, expected)
    with pytest.raises(ValueError):  # a continuation shorter than what it continues
        carry_routing(expected, expected[:2])


def test_an_unstarted_row_is_written_empty_and_read_back_as_none():
    row = Row(Trajectory(prompt=[1, 2, 3], seed=0), prompt_index=0, group_id=0, sample_idx=0,
              weight_version=0)
    cols = columns_of([row], row_columns(_features(partial=True, multi_turn=False)))
    assert cols["routed_experts"][0].shape == (0, 0, 0)
    assert rows_of(DockBatch(rows=[0], columns=cols, token_lengths=[0]))[0].t.routing is None
