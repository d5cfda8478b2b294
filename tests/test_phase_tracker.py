"""The phase tracker's view of its peers (mindspeed_rl/fault/phases.py), read from a real
torch.distributed store: what the one-line report of a lost rank is built from."""

from __future__ import annotations

import threading

import torch.distributed as dist

from mindspeed_rl.fault.phases import PeerState, PhaseTracker


class _StoreWhoseHostDies:
    """A HashStore until ``die()``: then every read raises as a TCPStore client does when the
    torchrun agent holding the store has ended (a node of a multi-node job died)."""

    def __init__(self):
        self.store, self.dead = dist.HashStore(), False

    def die(self):
        self.dead = True

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args):
            if self.dead:
                raise RuntimeError("Connection reset by peer")
            return method(*args)
        return call


def _tracker(store) -> PhaseTracker:
    tracker = PhaseTracker()
    tracker.rank, tracker.world_size, tracker._store = 0, 2, store
    store.set("beat/1", "1")
    store.set("phase/1", "3|update")
    store.set("host/1", "node1|4242")
    return tracker


def test_peers_reads_each_rank_state_and_heartbeat():
    store = _StoreWhoseHostDies()
    tracker = _tracker(store)
    threading.Timer(0.1, lambda: store.add("beat/1", 1)).start()
    assert tracker.peers(watch_s=0.5) == [PeerState(1, 3, "update", True, "node1", 4242)]
    assert tracker.peers(watch_s=0.2) == [PeerState(1, 3, "update", False, "node1", 4242)]


def test_a_store_that_dies_mid_read_gives_no_peers_and_no_traceback(monkeypatch):
    """The surviving node of a 2-node job reads its peers while the store's host (node 0's
    agent) ends: no peers are known, and no thread prints a traceback under the job's
    one-line error."""
    store = _StoreWhoseHostDies()
    tracker = _tracker(store)
    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    threading.Timer(0.1, store.die).start()
    assert tracker.peers(watch_s=0.4) == []
    assert escaped == []
