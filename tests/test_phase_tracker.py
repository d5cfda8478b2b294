"""The phase tracker's view of its peers (mindspeed_rl/fault/phase_tracker.py), read from a real
torch.distributed store: what the one-line report of a lost rank is built from."""

from __future__ import annotations

import threading

import torch.distributed as dist

from mindspeed_rl.fault.phase_tracker import PeerState, PhaseTracker


class _StoreWhoseHostDies:
    """A HashStore until ``die()``: then every read raises as a TCPStore client does when the
    torchrun agent holding the store has ended (a node of a multi-node job died).
    ``after_first_add`` runs once, after the tracker's first heartbeat read: what happens
    while it watches, at a fixed point instead of after a wall-clock delay (a loaded
    machine may run a timer late)."""

    def __init__(self, after_first_add=None):
        self.store, self.dead, self._after_first_add = dist.HashStore(), False, after_first_add

    def die(self):
        self.dead = True

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args):
            if self.dead:
                raise RuntimeError("Connection reset by peer")
            value = method(*args)
            if name == "add" and self._after_first_add is not None:
                hook, self._after_first_add = self._after_first_add, None
                hook(self)
            return value
        return call


def _tracker(store) -> PhaseTracker:
    tracker = PhaseTracker()
    tracker.rank, tracker.world_size, tracker._store = 0, 2, store
    store.set("beat/1", "1")
    store.set("phase/1", "3|update")
    store.set("host/1", "node1|4242")
    return tracker


def test_peers_reads_each_rank_state_and_heartbeat():
    beating = _StoreWhoseHostDies(after_first_add=lambda store: store.store.add("beat/1", 1))
    assert _tracker(beating).peers(watch_s=0.05) == [
        PeerState(1, 3, "update", True, "node1", 4242)]
    silent = _StoreWhoseHostDies()
    assert _tracker(silent).peers(watch_s=0.05) == [
        PeerState(1, 3, "update", False, "node1", 4242)]


def test_a_store_that_dies_mid_read_gives_no_peers_and_no_traceback(monkeypatch):
    """The surviving node of a 2-node job reads its peers while the store's host (node 0's
    agent) ends: no peers are known, and no thread prints a traceback under the job's
    one-line error."""
    store = _StoreWhoseHostDies(after_first_add=_StoreWhoseHostDies.die)
    tracker = _tracker(store)
    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    assert tracker.peers(watch_s=0.05) == []
    assert escaped == []
