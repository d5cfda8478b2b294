"""TransferDock under stress: random puts and gets on 2 and 4 ranks, checked against an oracle.

A seeded generator draws one op sequence shared by every rank (SPMD): puts of new rows
with random sizes, group sizes and column subsets (each rank its own count and columns,
many ranks with nothing), puts of results by the ranks that received the rows, gets by
random consumers for random column subsets, counts, layouts (TP/PP peers, every rank its
own DP rank) and whole groups — some asking for more rows than can ever be ready — and
clears. Every rank logs what it put and what it received (row ids and a checksum of every
cell). The parent replays the log with an independent model of the dock and checks:

- every get that can be met delivers exactly the oldest ready rows not yet taken by its
  consumer — each to exactly one DP rank, identical on all ranks of that DP rank — and
  every cell's checksum equals the one its writer put (exactly once, intact);
- every get that cannot be met raises TransferDockError on every rank alike (naming the
  consumer), promptly, and leaves the dock usable.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mindspeed_rl.testing.multiprocess import run_on_ranks
from mindspeed_rl.transfer_dock import ConsumerLayout, TransferDockError, build_transfer_dock

pytestmark = pytest.mark.slow

# name -> (make one cell from a generator, or None for result columns)
BASE_COLUMNS = ("ids", "logp", "score", "mat", "mask")
CONSUMERS = ("c0", "c1", "c2")


def _cell(column: str, gen: torch.Generator) -> torch.Tensor:
    n = int(torch.randint(0, 9, (1,), generator=gen))  # empty cells included
    if column == "ids":
        return torch.randint(0, 50_000, (n,), generator=gen)
    if column == "logp":
        return -torch.rand(n, generator=gen)
    if column == "score":
        return torch.rand((), generator=gen)
    if column == "mat":
        return torch.randn(n, 3, generator=gen).to(torch.bfloat16)
    return torch.rand(n, generator=gen) > 0.5  # mask


def _result(row: int, consumer: str) -> torch.Tensor:
    """What a consumer computes for a row: the same on every peer that computes it."""
    return torch.arange(row % 5, dtype=torch.float32) * row + CONSUMERS.index(consumer)


def _checksum(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode() + data).hexdigest()[:16]


def _layouts(world: int) -> list[ConsumerLayout | None]:
    out: list[ConsumerLayout | None] = [None]
    for tp in (1, 2):
        for pp in (1, 2):
            if world % (tp * pp) == 0 and world // (tp * pp) >= 1:
                out.append(ConsumerLayout.megatron(world, tp, pp))
    return out


def stress_body(mode: str, seed: int, num_ops: int) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dock = build_transfer_dock(mode, timeout_s=60)
    ops = np.random.default_rng(seed)  # the same on every rank
    layouts = _layouts(world)
    log: list[dict] = []
    received: dict[str, list[int]] = {}  # consumer -> rows of this rank's last get
    group = int(ops.integers(1, 4))
    for step in range(num_ops):
        kind = ops.choice(["new", "result", "get", "clear"], p=[.3, .15, .5, .05])
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
        if kind == "new":
            groups_per_rank = ops.integers(0, 4, world)
            groups_per_rank[ops.random(world) < 0.3] = 0  # ranks with nothing to add
            columns = [c for c in BASE_COLUMNS if ops.random() < 0.85] or ["ids"]
            mine = [c for c in columns if ops.random() < 0.9 or c == columns[0]]
            n = int(groups_per_rank[rank]) * group
            cells = {c: [_cell(c, gen) for _ in range(n)] for c in mine} if n else {}
            rows = dock.put(cells, num_rows_per_group=group)
            log.append({"step": step, "op": "new", "group": group, "rows": rows,
                        "sums": {c: [_checksum(t) for t in v] for c, v in cells.items()}})
        elif kind == "result":
            consumer = str(ops.choice(CONSUMERS))
            rows = received.pop(consumer, [])
            column = f"res_{consumer}"
            dock.put({column: [_result(r, consumer) for r in rows]} if rows else {}, rows=rows)
            log.append({"step": step, "op": "result", "column": column, "rows": rows,
                        "sums": [_checksum(_result(r, consumer)) for r in rows]})
        elif kind == "get":
            consumer = str(ops.choice(CONSUMERS))
            results = [f"res_{c}" for c in CONSUMERS if c != consumer]
            columns = sorted({str(ops.choice(results)) if ops.random() < 0.15
                              else str(ops.choice(BASE_COLUMNS))
                              for _ in range(int(ops.integers(1, 3)))})
            layout = layouts[int(ops.integers(len(layouts)))]
            whole = bool(ops.random() < 0.4)
            unit = group if whole else 1
            # 1_000: never satisfiable; the others sometimes are not
            n = int(ops.choice([0, 1, 2, 3, 1_000], p=[.05, .35, .3, .2, .1])) * unit
            entry = {"step": step, "op": "get", "consumer": consumer, "columns": columns,
                     "n": n, "whole": whole,
                     "layout": layout.ranks_per_dp_rank if layout else None}
            start = time.monotonic()
            try:
                batch = dock.get(consumer, columns, n, layout, whole_groups=whole)
            except TransferDockError as e:
                entry.update(error=str(e), seconds=time.monotonic() - start)
            else:
                if batch is not None:
                    entry["rows"] = batch.rows
                    entry["sums"] = {c: [_checksum(t) for t in v]
                                     for c, v in batch.columns.items()}
                    received[consumer] = batch.rows
            log.append(entry)
        else:
            dock.clear()
            received.clear()
            group = int(ops.integers(1, 4))
            log.append({"step": step, "op": "clear"})
    return log


class Oracle:
    """An independent model of one dock: rows, cells (checksum per writer), taken flags."""

    def __init__(self, world: int):
        self.world = world
        self.num_rows = 0  # row ids only grow, across clears too
        self.reset()

    def reset(self) -> None:
        self.first_row = self.num_rows  # the first row of this epoch
        self.group_size = 1
        self.cells: dict[tuple[int, str], str] = {}
        self.taken: dict[str, set[int]] = defaultdict(set)
        self.pending: list[dict[tuple[int, str], str]] = []

    def new_rows(self, logs: list[dict]) -> None:
        """A creating put: rows numbered after every row so far, in rank order."""
        for rank, entry in enumerate(logs):
            expected = list(range(self.num_rows, self.num_rows + len(entry["rows"])))
            assert entry["rows"] == expected, (entry["step"], rank, entry["rows"], expected)
            self.num_rows += len(expected)
            for column, sums in entry["sums"].items():
                for row, s in zip(expected, sums):
                    self.cells[(row, column)] = s
        # Within one epoch (between clears) every put uses the same group size, so the
        # groups are blocks of that many consecutive row ids.
        self.group_size = logs[0]["group"]

    def results(self, logs: list[dict]) -> None:
        """A put of results: published with the next get (the dock applies it first)."""
        staged = {}
        for entry in logs:
            for row, s in zip(entry["rows"], entry["sums"]):
                prev = staged.get((row, entry["column"]))
                assert prev in (None, s)  # TP peers wrote the same cell
                staged[(row, entry["column"])] = s
        self.pending.append(staged)

    def publish(self) -> None:
        for staged in self.pending:
            self.cells.update(staged)
        self.pending = []

    def expected_get(self, consumer: str, columns: list[str], n: int, whole: bool,
                     num_dp: int) -> list[int] | None:
        """The rows the get must deliver (oldest first), or None if it cannot be met."""
        self.publish()
        ready = [r for r in range(self.first_row, self.num_rows)
                 if r not in self.taken[consumer]
                 and all((r, c) in self.cells for c in columns)]
        if whole:
            g = self.group_size
            ready_set = set(ready)
            units = [list(range(s, s + g)) for s in range(self.first_row, self.num_rows, g)
                     if all(r in ready_set for r in range(s, s + g))]
            need = n // g * num_dp
            if len(units) < need:
                return None
            return sorted(r for u in units[:need] for r in u)
        need = n * num_dp
        return ready[:need] if len(ready) >= need else None


def check(logs_by_rank: list[list[dict]], world: int) -> dict:
    oracle = Oracle(world)
    stats = defaultdict(int)
    for step_logs in zip(*logs_by_rank):
        op = step_logs[0]["op"]
        assert all(e["op"] == op for e in step_logs)
        if op == "clear":
            oracle.reset()
            continue
        if op == "new":
            oracle.new_rows(list(step_logs))
            stats["rows"] += sum(len(e["rows"]) for e in step_logs)
            continue
        if op == "result":
            oracle.results(list(step_logs))
            continue
        e0 = step_logs[0]
        layout = e0["layout"] or tuple((r,) for r in range(world))
        expected = oracle.expected_get(e0["consumer"], e0["columns"], e0["n"], e0["whole"],
                                       len(layout))
        if expected is None:
            stats["refused"] += 1
            for e in step_logs:
                assert "error" in e, (e0["step"], "an unsatisfiable get did not fail", e)
                assert f"get for consumer {e0['consumer']!r}" in e["error"]
                assert e["seconds"] < 10  # answered, not waited on
            continue
        stats["gets"] += 1
        delivered = []
        for ranks in layout:
            got = [step_logs[r] for r in ranks]
            assert all("error" not in g for g in got), (e0["step"], got)
            assert all(g["rows"] == got[0]["rows"] and g["sums"] == got[0]["sums"]
                       for g in got)  # every TP/PP peer of a DP rank gets the same cells
            rows = got[0]["rows"]
            assert len(rows) == e0["n"]
            for column in e0["columns"]:
                for row, s in zip(rows, got[0]["sums"][column]):
                    assert oracle.cells[(row, column)] == s, (e0["step"], row, column)
                    stats["cells"] += 1
            delivered += rows
        assert len(delivered) == len(set(delivered))  # each row to one DP rank
        assert sorted(delivered) == expected, (e0["step"], sorted(delivered), expected)
        assert not set(delivered) & oracle.taken[e0["consumer"]]  # exactly once
        oracle.taken[e0["consumer"]].update(delivered)
    return dict(stats)


def stress_cases(cases: list[tuple[str, int]], num_ops: int) -> list[list[dict]]:
    """Several (mode, seed) sequences in one spawn of the ranks (spawning costs seconds)."""
    return [stress_body(mode, seed, num_ops) for mode, seed in cases]


@pytest.mark.parametrize("world, seeds", [(2, (1, 2, 3)), (4, (4, 5))])
def test_random_puts_and_gets_deliver_exactly_once(world, seeds):
    cases = [(mode, seed) for mode in ("distributed", "centralized") for seed in seeds]
    per_rank = run_on_ranks(stress_cases, world, cases, 150, timeout=300)
    for i, (mode, seed) in enumerate(cases):
        stats = check([logs[i] for logs in per_rank], world)
        print(f"\n{mode} world={world} seed={seed}: {stats}")
        # The sequence exercised what it is meant to.
        assert stats["gets"] >= 20 and stats["refused"] >= 10 and stats["cells"] >= 150, stats
