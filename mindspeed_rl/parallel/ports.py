"""A free local TCP port, for a world of one started on ``env://`` (parallel/groups.py) and
for the multi-process tests (mindspeed_rl/testing)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free a moment ago (for libraries that insist on env://)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
