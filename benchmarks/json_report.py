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


def run_for_json(cmd: list[str], log, *, what: str, env: dict | None = None,
                 cwd=None) -> dict:
    """Run a benchmark command, its stderr to the file ``log``; return the JSON object of its
    last stdout line. A failure ends the caller with ``what``, the exit code and the log's end."""
    import subprocess

    with open(log, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                              cwd=cwd)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        with open(log) as f:
            tail = f.read()[-2000:]
        raise SystemExit(f"{what} failed (exit {proc.returncode}); its stderr is {log}, "
                         f"ending:\n{tail}")
    return json.loads(lines[-1])
