"""Multi-process TransferDock tests (gloo, 2 and 4 ranks).

One spawned run per world size replays a small GRPO-shaped iteration in both
modes and returns what every rank put and received; the parent then checks the
invariants on the whole picture: every row reaches every consumer exactly once
(hashes of every cell), TP peers see identical batches, token balance is within
one row (or group) of greedy, and both modes deliver identical data.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist

from mindspeed_rl.testing.multiprocess import run_on_ranks
from mindspeed_rl.transfer_dock import (ConsumerLayout, TransferDockError,
                                        TransferDockTimeoutError, build_transfer_dock)
from mindspeed_rl.transfer_dock.assignment import greedy_balance, token_spread, tokens_per_bin

GROUP = 2  # n_samples_per_prompt
ROLLOUT_COLUMNS = ["prompt_ids", "response_ids", "logprobs_rollout", "rewards"]
UPDATE_COLUMNS = ROLLOUT_COLUMNS + ["logprobs_old", "logprobs_ref", "advantages"]


def _hash(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode() + data).hexdigest()[:16]


def _logprobs_old(response_ids: torch.Tensor) -> torch.Tensor:
    return response_ids.to(torch.float32) * 0.5 - 1.0  # [num_tokens]


def _logprobs_ref(response_ids: torch.Tensor) -> torch.Tensor:
    return -response_ids.to(torch.float32) / 7.0  # [num_tokens]


def _rollout(rank: int, num_groups: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Variable-length rows, deterministic per (rank, seed)."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    cols: dict[str, list[torch.Tensor]] = {c: [] for c in ROLLOUT_COLUMNS}
    for _ in range(num_groups * GROUP):
        p_len = int(torch.randint(1, 12, (1,), generator=gen))
        r_len = int(torch.randint(1, 40, (1,), generator=gen))
        cols["prompt_ids"].append(torch.randint(0, 1000, (p_len,), generator=gen))
        cols["response_ids"].append(torch.randint(0, 1000, (r_len,), generator=gen))
        cols["logprobs_rollout"].append(-torch.rand(r_len, generator=gen))
        cols["rewards"].append(torch.rand((), generator=gen))  # per-row scalar, shape []
    return cols


def _mixed_cells(rank: int) -> dict[str, list[torch.Tensor]]:
    """Three rows of cells of every kind the exchange packs differently."""
    gen = torch.Generator().manual_seed(rank)
    return {
        "mat": [torch.randn(k + 1, 3, generator=gen) for k in range(3)],  # 2-D
        "mask": [torch.arange(k + 2) % 2 == rank for k in range(3)],  # bool
        "score": [torch.tensor(k * 10 + rank) for k in range(3)],  # 0-d int64
        "strided": [torch.arange(2 * k + 4)[::2] + rank for k in range(3)],  # non-contiguous
        "empty": [torch.zeros(0, dtype=torch.float16) for _ in range(3)],  # no elements
    }


def _record(log: list, consumer: str, call: int, dp: int | None, batch) -> None:
    if batch is None:
        return
    log.append({"consumer": consumer, "call": call, "dp": dp, "rows": list(batch.rows),
                "tokens": list(batch.token_lengths),
                "hashes": {c: [_hash(t) for t in cells] for c, cells in batch.columns.items()}})


def _iteration(mode: str, world: int, groups_per_rank: list[int], seed: int) -> dict:
    rank = dist.get_rank()
    dock = build_transfer_dock(mode, timeout_s=60)
    log: list = []
    tp = 2
    train_layout = ConsumerLayout.megatron(world, tensor_model_parallel_size=tp)
    my_dp_train = rank // tp
    # DP groups as a trainer would have them (TP peers differ in DP group).
    dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    my_dp_group = dp_groups[rank % tp]

    # 1. rollout on generation-DP ranks (uneven rows per rank).
    cols = _rollout(rank, groups_per_rank[rank], seed)
    rows = dock.put(cols, num_rows_per_group=GROUP)
    produced = {r: {c: _hash(cols[c][i]) for c in ROLLOUT_COLUMNS} for i, r in enumerate(rows)}
    num_rows = dock.num_rows
    assert num_rows == GROUP * sum(groups_per_rank)

    # 2. old log-probs: TP=2 consumer, two mini-batch gets; all TP peers put back.
    per_dp = num_rows // train_layout.num_dp_ranks // 2
    for call in range(2):
        batch = dock.get("actor_logprobs", ["prompt_ids", "response_ids"], per_dp, train_layout)
        _record(log, "actor_logprobs", call, my_dp_train, batch)
        dock.put({"logprobs_old": [_logprobs_old(t) for t in batch["response_ids"]]},
                 rows=batch.rows)

    # 3. ref log-probs: same layout given as real DP process groups; only TP rank 0 puts.
    batch = dock.get("ref_logprobs", ["response_ids"], num_rows // train_layout.num_dp_ranks,
                     my_dp_group)
    _record(log, "ref_logprobs", 0, my_dp_train, batch)
    if rank % tp == 0:
        dock.put({"logprobs_ref": [_logprobs_ref(t) for t in batch["response_ids"]]},
                 rows=batch.rows)
    else:
        dock.put({}, rows=[])

    # 4. advantages: every rank its own DP rank, whole groups (GRPO).
    batch = dock.get("advantages", ["rewards"], num_rows // world, whole_groups=True)
    _record(log, "advantages", 0, rank, batch)
    rewards = torch.stack(batch["rewards"]).view(-1, GROUP)  # [num_groups, GROUP]
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    dock.put({"advantages": list(adv.reshape(-1).unbind())}, rows=batch.rows)

    # 5. update: uneven DP layout (last DP rank has two peers), then the remainder.
    uneven = (ConsumerLayout(((0,), (1,), (2, 3))) if world == 4
              else ConsumerLayout(((0,), (1,))))
    per_dp = num_rows // uneven.num_dp_ranks
    batch = dock.get("actor_update", UPDATE_COLUMNS, per_dp, uneven)
    my_dp = next((d for d, rs in enumerate(uneven.ranks_per_dp_rank) if rank in rs), None)
    _record(log, "actor_update", 0, my_dp, batch)
    remainder = num_rows - per_dp * uneven.num_dp_ranks
    last = ConsumerLayout(((world - 1,),))
    tail = dock.get("actor_update", UPDATE_COLUMNS, remainder, last)
    _record(log, "actor_update", 1, 0 if rank == world - 1 else None, tail)
    checks_ok = True
    for b in (batch, tail):
        if b is not None:
            for resp, lp_old, lp_ref in zip(b["response_ids"], b["logprobs_old"],
                                            b["logprobs_ref"]):
                checks_ok &= torch.equal(lp_old, _logprobs_old(resp))
                checks_ok &= torch.equal(lp_ref, _logprobs_ref(resp))

    # 6. gets that can never be satisfied fail on every rank alike, and leave the
    #    dock usable.
    errors = []
    for consumer, columns, n in [("actor_update", ["response_ids"], 1),
                                 ("critic_values", ["values"], 1),
                                 ("greedy", ["response_ids"], num_rows + 1)]:
        try:
            dock.get(consumer, columns, n, ConsumerLayout(((0,),)))
        except TransferDockError as e:
            errors.append(str(e))
    metrics = dock.metrics.as_dict()
    held_bytes = dock.warehouse.num_bytes

    # 7. next iteration: ids restart, consumers may take again.
    dock.clear()
    again = dock.put({"response_ids": [torch.arange(3) + rank]})
    got = dock.get("actor_logprobs", ["response_ids"], 1)
    second = (again, got.rows, got["response_ids"][0].tolist())
    return {"produced": produced, "log": log, "checks_ok": bool(checks_ok), "errors": errors,
            "metrics": metrics, "held_bytes": held_bytes, "second": second}


def _both_modes(groups_per_rank: list[int], seed: int) -> dict:
    world = dist.get_world_size()
    return {mode: _iteration(mode, world, groups_per_rank, seed)
            for mode in ("distributed", "centralized")}


def _check_mode(results: list[dict], world: int) -> None:
    produced = {}
    for r in results:
        produced.update(r["produced"])
    num_rows = len(produced)
    assert all(r["checks_ok"] for r in results), "results put back did not come back intact"

    by_call: dict[tuple[str, int], dict[int, list[dict]]] = {}
    for r in results:
        for entry in r["log"]:
            by_call.setdefault((entry["consumer"], entry["call"]), {}).setdefault(
                entry["dp"], []).append(entry)
    delivered: dict[str, list[int]] = {}
    for (consumer, call), per_dp in by_call.items():
        for dp, entries in per_dp.items():
            # All TP/PP peers of a DP rank received the identical batch.
            first = entries[0]
            assert all(e["rows"] == first["rows"] and e["hashes"] == first["hashes"]
                       for e in entries), (consumer, call, dp)
            delivered.setdefault(consumer, []).extend(first["rows"])
            for c, hashes in first["hashes"].items():
                if c in produced[0]:
                    assert hashes == [produced[row][c] for row in first["rows"]], (consumer, c)
        # Balance: within one unit (row, or group for whole-group gets) of greedy.
        batches = [per_dp[d][0] for d in sorted(per_dp)]
        if len(batches) > 1:
            whole = consumer == "advantages"
            lengths_per_dp = []
            for b in batches:
                toks = b["tokens"]
                if whole:
                    assert all(b["rows"][i] // GROUP == b["rows"][i + 1] // GROUP
                               for i in range(0, len(toks), GROUP)), "group split"
                    toks = [sum(toks[i:i + GROUP]) for i in range(0, len(toks), GROUP)]
                lengths_per_dp.append(toks)
            units = [x for toks in lengths_per_dp for x in toks]
            ref = tokens_per_bin(units, greedy_balance(units, len(batches),
                                                       len(lengths_per_dp[0])))
            got = [sum(t) for t in lengths_per_dp]
            assert token_spread(got) <= token_spread(ref) + max(units), (consumer, got, ref)
    for consumer in ("actor_logprobs", "ref_logprobs", "advantages", "actor_update"):
        assert sorted(delivered[consumer]) == list(range(num_rows)), consumer  # exactly once

    errors = results[0]["errors"]
    assert all(r["errors"] == errors for r in results)
    assert len(errors) == 3
    assert "'actor_update'" in errors[0] and f"already taken by 'actor_update': {num_rows}" \
        in errors[0]
    assert "'critic_values'" in errors[1] and "'values': 0 ready" in errors[1]
    assert "'greedy'" in errors[2] and f"= {num_rows + 1} rows" in errors[2] \
        and f"only {num_rows}" in errors[2]
    # After clear() the rows are gone but ids keep growing: the next put continues them.
    assert [r["second"] for r in results][0][1] == [num_rows]
    assert results[world - 1]["second"][0] == [num_rows + world - 1]


def _check_world(results: list[dict], world: int) -> None:
    for mode in ("distributed", "centralized"):
        _check_mode([r[mode] for r in results], world)
    # Both modes deliver identical batches (same rows to the same DP ranks, same bytes).
    for r in results:
        assert r["distributed"]["log"] == r["centralized"]["log"]
    cent = [r["centralized"] for r in results]
    dist_ = [r["distributed"] for r in results]
    # Centralized: every cell at rest is on rank 0; distributed: spread out.
    assert all(c["held_bytes"] == 0 for c in cent[1:]) and cent[0]["held_bytes"] > 0
    assert all(d["held_bytes"] > 0 for d in dist_)
    traffic = lambda m: m["row_bytes_sent"] + m["row_bytes_received"]  # noqa: E731
    assert traffic(dist_[0]["metrics"]) < traffic(cent[0]["metrics"])
    # Distributed: every rank moves exactly its own share (each cell crosses once per
    # rank that lacks it); the centralized buffer moves at least that through rank 0.
    for d in dist_:
        assert traffic(d["metrics"]) == d["metrics"]["row_bytes_own"] > 0
    assert traffic(cent[0]["metrics"]) > cent[0]["metrics"]["row_bytes_own"]
    assert [c["metrics"]["row_bytes_own"] for c in cent] == \
        [d["metrics"]["row_bytes_own"] for d in dist_]  # the share is placement-independent


def test_transfer_dock_two_ranks():
    results = run_on_ranks(_both_modes, 2, [3, 1], seed=1, timeout=120)
    _check_world(results, 2)


def test_transfer_dock_four_ranks_tp2_uneven():
    results = run_on_ranks(_both_modes, 4, [3, 1, 2, 2], seed=2, timeout=180)
    _check_world(results, 4)


def _misuse_scenario() -> tuple[str, str]:
    dock = build_transfer_dock("distributed", timeout_s=3)
    rank = dist.get_rank()
    # Ranks calling different dock ops: caught by the call header, on every rank.
    try:
        if rank == 0:
            dock.get("actor_update", ["response_ids"], 1)
        else:
            dock.put({"response_ids": [torch.arange(4)]})
        mismatch = "no error"
    except TransferDockError as e:
        mismatch = str(e)
    # The dock stays usable; then a rank that never arrives bounds the wait.
    dock.put({"response_ids": [torch.arange(4)]})
    if rank == 1:
        time.sleep(8)  # never makes the get: rank 0 must give up, not hang
        return mismatch, "skipped"
    start = time.monotonic()
    try:
        dock.get("actor_update", ["response_ids"], 1)
    except TransferDockTimeoutError as e:
        return mismatch, f"{time.monotonic() - start:.1f}s|{e}"
    return mismatch, "no error"


def test_misuse_fails_clearly_and_timeout_bounds_the_wait():
    results = run_on_ranks(_misuse_scenario, 2, timeout=60)
    assert all("ranks disagree on the dock call" in m for m, _ in results), results
    elapsed, message = results[0][1].split("|", 1)
    assert float(elapsed[:-1]) < 8, results[0]
    assert "get for consumer 'actor_update'" in message and "timeout_s=3" in message


def _protocol_scenario() -> dict:
    """Control-protocol behaviour on 2 ranks (one DP rank of two TP peers)."""
    rank = dist.get_rank()
    out: dict = {}
    tp_pair = ConsumerLayout(((0, 1),))
    for mode in ("distributed", "centralized"):
        dock = build_transfer_dock(mode, timeout_s=30)
        cells = [torch.arange(100 * (i + 1)) for i in range(4)] if rank == 0 else []
        rows = dock.put({"ids": cells})
        # A second consumer of cells this rank already received moves nothing in
        # distributed mode; the centralized buffer serves them again.
        first = dock.get("actor_logprobs", ["ids"], 4, tp_pair)
        received_after_first = dock.metrics.row_bytes_received
        second = dock.get("ref_logprobs", ["ids"], 4, tp_pair)
        # A put of results is local: no collective until the next get publishes it.
        before = dock.metrics.num_collectives
        dock.put({"lp": [c.float() * -1 for c in second["ids"]]} if rank == 1 else {},
                 rows=second.rows if rank == 1 else [])
        put_collectives = dock.metrics.num_collectives - before
        third = dock.get("actor_update", ["ids", "lp"], 4, tp_pair)
        out[mode] = {
            "rows": rows, "put_collectives": put_collectives,
            "received": [received_after_first, dock.metrics.row_bytes_received],
            "same": all(torch.equal(a, b) and torch.equal(a, c)
                        for a, b, c in zip(first["ids"], second["ids"], third["ids"])),
            "lp_ok": all(torch.equal(lp, ids.float() * -1)
                         for ids, lp in zip(third["ids"], third["lp"])),
        }

    # Cells of any shape, dtype and layout cross ranks intact, in both modes: both
    # ranks form one DP rank, so each receives the other's rows; then rank 1's
    # 2-D results travel back to rank 0.
    for mode in ("distributed", "centralized"):
        dock = build_transfer_dock(mode, timeout_s=30)
        dock.put(_mixed_cells(rank))
        both = dock.get("c", list(_mixed_cells(0)), 6, ConsumerLayout(((0, 1),)))
        expected = {c: _mixed_cells(0)[c] + _mixed_cells(1)[c] for c in _mixed_cells(0)}
        same = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                   for c in expected for a, b in zip(both[c], expected[c]))
        dock.put({"double": [m * 2 for m in both["mat"]]} if rank == 1 else {},
                 rows=both.rows if rank == 1 else [])
        back = dock.get("d", ["double", "mat"], 6, ConsumerLayout(((0,),)))
        doubled = back is None or all(torch.equal(d, m * 2) and d.shape == m.shape
                                      for d, m in zip(back["double"], back["mat"]))
        out[f"mixed_cells_{mode}"] = (same, len(both), doubled)

    # Metadata larger than eager_bytes takes a second all-to-all and arrives intact.
    dock = build_transfer_dock("distributed", timeout_s=30, eager_bytes=64)
    dock.put({"ids": [torch.arange(n) + rank for n in range(1, 41)]})
    batch = dock.get("c", ["ids"], 40)
    out["overflow"] = (dock.metrics.num_collectives,
                       [t.tolist() == (torch.arange(len(t)) + t[0]).tolist() for t in batch["ids"]])

    # A put of results for a row that does not exist fails at the get that
    # publishes it, on every rank, naming the row; the dock stays usable.
    dock.put({"lp": [torch.zeros(3)]} if rank == 0 else {}, rows=[999] if rank == 0 else [])
    try:
        dock.get("d", ["ids"], 1)
        out["bad_put"] = "no error"
    except TransferDockError as e:
        out["bad_put"] = str(e)
    out["after_bad_put"] = len(dock.get("d", ["ids"], 1))
    # Rewriting a cell is refused the same way and leaves the original in place.
    dock.put({"ids": [torch.full((5,), 7)]} if rank == 0 else {}, rows=[0] if rank == 0 else [])
    try:
        dock.get("d", ["ids"], 1)
        out["rewrite"] = "no error"
    except TransferDockError as e:
        out["rewrite"] = str(e)
    batch = dock.get("e", ["ids"], 40)
    out["row0"] = [t.tolist() for r, t in zip(batch.rows, batch["ids"]) if r == 0]

    # A rank that skips clear() is caught by the next call.
    if rank == 0:
        dock.clear()
    try:
        dock.put({})
        out["skipped_clear"] = "no error"
    except TransferDockError as e:
        out["skipped_clear"] = str(e)

    # Mixing the two kinds of put in one call is caught, with the fix in the message.
    dock = build_transfer_dock("distributed", timeout_s=30)
    dock.put({"ids": [torch.arange(3)]})
    try:
        if rank == 0:
            dock.put({"lp": [torch.zeros(3)]}, rows=[0])
            dock.get("e", ["ids", "lp"], 1)
        else:
            dock.put({})  # should have been rows=[]
        out["mixed"] = "no error"
    except TransferDockError as e:
        out["mixed"] = str(e)
    return out


def test_control_protocol_replicas_deferred_puts_overflow_and_misuse():
    results = run_on_ranks(_protocol_scenario, 2, timeout=120)
    for r in results:
        d, c = r["distributed"], r["centralized"]
        assert d["same"] and d["lp_ok"] and c["same"] and c["lp_ok"]
        # distributed: no collective; centralized: control + moving rank 1's cells to rank 0
        assert d["put_collectives"] == 0 and c["put_collectives"] == 2
    # rank 1 received the cells once (distributed) vs. for every consumer (centralized)
    d1, c1 = results[1]["distributed"], results[1]["centralized"]
    bytes_ids = sum(100 * (i + 1) for i in range(4)) * 8
    assert d1["received"] == [bytes_ids, bytes_ids]  # the second and third gets moved nothing
    assert c1["received"][0] == bytes_ids and c1["received"][1] >= 3 * bytes_ids
    for r in results:
        for mode in ("distributed", "centralized"):
            assert r[f"mixed_cells_{mode}"] == (True, 6, True), mode
    for r in results:
        collectives, intact = r["overflow"]
        assert all(intact) and len(intact) == 40
        # put: control + overflow; get: control only (each rank's own rows stay local)
        assert collectives == 3
        assert "row 999" in r["bad_put"] and "published with this get" in r["bad_put"]
        assert r["after_bad_put"] == 1
        assert "'ids' of row 0, which is already written" in r["rewrite"]
    assert results[0]["row0"] + results[1]["row0"] == [[0]]  # rank 0's first row, arange(1)
    for r in results:
        assert "ranks disagree" in r["skipped_clear"] and "after 1 clear()" in r["skipped_clear"]
        assert "ranks disagree" in r["mixed"] and "rows=[]" in r["mixed"]


# ---- rows kept across iterations (the room partial rollout needs) -------------------------

def _retire_and_restore(mode: str) -> dict:
    rank = dist.get_rank()
    dock = build_transfer_dock(mode, timeout_s=60)
    # 2 ranks x 4 rows: ids 0..7, groups of 2
    dock.put({"ids": [torch.arange(3) + 10 * rank + i for i in range(4)]}, num_rows_per_group=2)
    first = dock.get("c", ["ids"], 2)  # the oldest 4 rows, 2 per rank
    dock.put({"lp": [c.float() for c in first["ids"]]}, rows=first.rows)
    out = {"first": first.rows}
    # Retire what was consumed; the other rows stay, with their ids and cells.
    dock.retire(list(range(4)))
    out["left"] = dock.num_rows
    out["again"] = dock.put({"ids": [torch.arange(2) + 100 + rank]})
    state = dock.state_dict()
    fresh = build_transfer_dock(mode, timeout_s=60)
    fresh.load_state_dict(state)
    later = fresh.get("c", ["ids"], 2)
    out["later_rows"] = later.rows
    out["later_cells"] = [c.tolist() for c in later["ids"]]
    try:
        fresh.put({"lp": [torch.zeros(1)]}, rows=[0])
        out["retired_put"] = "no error"
    except TransferDockError as e:
        out["retired_put"] = str(e)
    fresh.clear()
    out["after_clear"] = fresh.put({"ids": [torch.ones(1, dtype=torch.long)]})
    return out


def _rows_across_iterations() -> dict:
    return {mode: _retire_and_restore(mode) for mode in ("distributed", "centralized")}


def test_retired_rows_leave_and_kept_rows_survive_a_checkpoint():
    results = run_on_ranks(_rows_across_iterations, 2, timeout=300)
    for mode in ("distributed", "centralized"):
        r0, r1 = results[0][mode], results[1][mode]
        assert sorted(r0["first"] + r1["first"]) == [0, 1, 2, 3]
        assert r0["left"] == r1["left"] == 4
        assert (r0["again"], r1["again"]) == ([8], [9])  # ids keep growing
        # rows 4..7 (rank 1's put) come out of the restored dock with their own cells
        assert sorted(r0["later_rows"] + r1["later_rows"]) == [4, 5, 6, 7]
        cells = {row: c for r in (r0, r1) for row, c in zip(r["later_rows"], r["later_cells"])}
        assert cells == {4 + i: [10 + i, 11 + i, 12 + i] for i in range(4)}
        assert "row 0, which was retired" in r0["retired_put"]
        assert (r0["after_clear"], r1["after_clear"]) == ([10], [11])


# ---- held rows, tags and named gets (partial rollout's pool) ------------------------------

def _held_pool(mode: str) -> dict:
    rank = dist.get_rank()
    dock = build_transfer_dock(mode, timeout_s=60)
    out = {}
    # rank 0: one visible group (rows 0, 1); then both ranks put held groups with tags
    dock.put({"ids": [torch.arange(2) + i for i in range(2)] if rank == 0 else []},
             num_rows_per_group=2)
    held = dock.put({"ids": [torch.arange(3 + i) for i in range(4)]}, num_rows_per_group=2,
                    held=True, tags={"age": [rank * 10 + i for i in range(4)]})
    out["held"] = held
    out["rows_held"] = dock.rows(held=True).tolist()
    out["rows_free"] = dock.rows(held=False).tolist()
    out["tags"] = dock.tags("age", dock.rows(held=True)).tolist()
    out["untagged"] = dock.tags("age", [0, 1]).tolist()
    # a plain get sees only the visible rows
    plain = dock.get("c", ["ids"], 1)
    out["plain"] = plain.rows
    try:  # and cannot be met from held rows
        dock.get("c", ["ids"], 1)
        out["shortfall"] = "no error"
    except TransferDockError as e:
        out["shortfall"] = str(e)
    # a named get: rows 6..9 (rank 1's groups) first, then rows 2..5; at most 1 group each
    named = dock.get("cont", ["ids"], 2, whole_groups=True,
                     candidates=[6, 7, 8, 9, 2, 3, 4, 5])
    out["named"] = named.rows
    dock.release([2, 3])
    out["after_release"] = dock.get("c", ["ids"], 1).rows
    state = dock.state_dict()
    fresh = build_transfer_dock(mode, timeout_s=60)
    fresh.load_state_dict(state)
    out["restored_held"] = fresh.rows(held=True).tolist()
    out["restored_tags"] = fresh.tags("age", fresh.rows(held=True)).tolist()
    # uneven: 3 groups named over 2 DP ranks -> 2 + 1
    odd = fresh.get("odd", ["ids"], 4, whole_groups=True, candidates=[4, 5, 6, 7, 8, 9])
    out["odd"] = odd.rows
    return out


def _held_both_modes() -> dict:
    return {mode: _held_pool(mode) for mode in ("distributed", "centralized")}


def test_held_rows_reach_only_named_gets_and_survive_a_checkpoint():
    results = run_on_ranks(_held_both_modes, 2, timeout=300)
    for mode in ("distributed", "centralized"):
        r0, r1 = results[0][mode], results[1][mode]
        assert (r0["held"], r1["held"]) == ([2, 3, 4, 5], [6, 7, 8, 9])
        for r in (r0, r1):  # replicated metadata: every rank sees the same
            assert r["rows_held"] == list(range(2, 10)) and r["rows_free"] == [0, 1]
            assert r["tags"] == [0, 1, 2, 3, 10, 11, 12, 13] and r["untagged"] == [-1, -1]
            assert r["restored_held"] == [4, 5, 6, 7, 8, 9]
            assert r["restored_tags"] == [2, 3, 10, 11, 12, 13]
        assert sorted(r0["plain"] + r1["plain"]) == [0, 1]
        assert "can never be satisfied" in r0["shortfall"]
        # the first two named groups in the candidates' order: (6, 7) and (8, 9)
        assert sorted(r0["named"] + r1["named"]) == [6, 7, 8, 9]
        assert sorted(r0["after_release"] + r1["after_release"]) == [2, 3]
        assert sorted(map(len, (r0["odd"], r1["odd"]))) == [2, 4]
        assert sorted(r0["odd"] + r1["odd"]) == [4, 5, 6, 7, 8, 9]


def test_checkpointed_cells_own_their_storage():
    """Cells that view one transfer buffer as different dtypes (what a put's exchange
    stores) are saved compact: torch.save refuses such views, and a view would write the
    whole buffer."""
    import io

    from mindspeed_rl.checkpoint.trainer_state import unwritable
    from mindspeed_rl.transfer_dock.warehouse import Warehouse

    buffer = torch.arange(64, dtype=torch.uint8)
    ids, logprobs = buffer[:16].view(torch.int64), buffer[16:32].view(torch.float32)
    warehouse = Warehouse()
    warehouse.write_many("response_ids", [3], [ids])
    warehouse.write_many("logprobs_rollout", [3], [logprobs])
    assert unwritable(warehouse._cells) is not None  # the views as stored: refused
    state = warehouse.state_dict()
    assert unwritable(state) is None
    for column, view in (("response_ids", ids), ("logprobs_rollout", logprobs)):
        saved = state[column][3]
        assert torch.equal(saved, view) and saved.untyped_storage().nbytes() == view.nbytes
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    assert torch.equal(torch.load(saved)["response_ids"][3], ids)
    assert "rank 0: its own state cannot be serialized" in unwritable({"f": lambda: 0})
