"""The benchmarks' output discipline: one JSON object on stdout, everything else on stderr."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def stdout_reserved_for_json() -> Iterator[Callable[[dict], None]]:
    """Inside the block, Python and C-level stdout (megatron, vLLM, torch) go to stderr;
    the yielded ``emit(result)`` writes ``result`` as one JSON line to the real stdout."""
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)

    def emit(result: dict) -> None:
        sys.stderr.flush()
        os.write(real_stdout, (json.dumps(result) + "\n").encode())

    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield emit
    finally:
        sys.stderr.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
