"""The control block every put and get starts with: its layout and its checks.

Each rank sends every peer the same fixed-size block (``TransferDock._control``
runs the ``all_to_all_single``): an int64 header ``[op, call number, clears so
far, hash of the arguments, metadata bytes, dp_key length, dp_key...]`` followed
by up to ``eager_bytes`` of pickled metadata. Blocks have the same size whatever a
rank called, so ranks that disagree on the call are caught by the headers, on
every rank alike, before any transfer whose sizes would not match. Nothing here
communicates.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from mindspeed_rl.errors import TransferDockError

OPS = ("put", "get")  # op codes of the control header
HEADER_FIELDS = 6  # op, call number, clears, argument hash, metadata bytes, dp_key length


def header_bytes(size: int) -> int:
    """Bytes of a block's header in a dock of ``size`` ranks (room for a dp_key of each)."""
    return 8 * (HEADER_FIELDS + size)


def pack_block(op: str, call: int, clears: int, args: tuple, dp_key: Sequence[int],
               blob: bytes, size: int, eager_bytes: int) -> torch.Tensor:
    """This rank's control block (``blob`` included only if it fits ``eager_bytes``)."""
    head = header_bytes(size)
    block = torch.zeros(head + eager_bytes, dtype=torch.uint8)
    header = block[:head].view(torch.int64)
    header[:HEADER_FIELDS] = torch.tensor([
        OPS.index(op), call, clears, zlib.crc32(repr(args).encode()), len(blob), len(dp_key)])
    header[HEADER_FIELDS:HEADER_FIELDS + len(dp_key)] = torch.tensor(list(dp_key),
                                                                   dtype=torch.int64)
    if 0 < len(blob) <= eager_bytes:
        block[head:head + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return block


def unpack_blocks(blocks: torch.Tensor, eager_bytes: int
                  ) -> tuple[list[list[int]], list[bytes | None]]:
    """Every rank's header, and its metadata where it fit the block (else None)."""
    size = blocks.shape[0]
    head = header_bytes(size)
    headers = blocks[:, :head].contiguous().view(torch.int64).tolist()
    blobs: list[bytes | None] = [None] * size
    for r, h in enumerate(headers):
        if h[4] <= eager_bytes:
            blobs[r] = blocks[r, head:head + h[4]].numpy().tobytes()
    return headers, blobs


def dp_keys_of(headers: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The ``dp_key`` every rank sent."""
    return [tuple(h[HEADER_FIELDS:HEADER_FIELDS + h[5]]) for h in headers]


def check_same_call(headers: Sequence[Sequence[int]], global_ranks: Sequence[int],
                    what: str) -> None:
    """Raise :class:`TransferDockError` naming every rank's call unless all agree."""
    calls = [tuple(h[:4]) for h in headers]
    if len(set(calls)) == 1:
        return
    described = "; ".join(
        f"rank {global_ranks[r]}: {OPS[o] if 0 <= o < len(OPS) else o} "
        f"(dock call #{n}, after {c} clear())" for r, (o, n, c, _) in enumerate(calls))
    same_op = len({c[:3] for c in calls}) == 1
    raise TransferDockError(
        f"{what}: ranks disagree on the dock call ({described}"
        f"{'; same call, different arguments' if same_op else ''}); every rank must "
        "call put/get/clear alike and in the same order (a put that creates rows, "
        "rows=None, is one call on every rank; so is a put of results: a rank with no "
        "results passes rows=[])")
