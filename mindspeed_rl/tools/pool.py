"""The tool pool of one rank: a batch of tool calls from many trajectories, run at once.

A turn of the agent loop stops every trajectory that called a tool until all the calls
of the batch are back, so the batch runs concurrently: one thread per call in flight,
each driving one child process (the local interpreter) or one HTTP request
(SandboxFusion). The threads only wait; the isolation and the limits are the child's
(mindspeed_rl.tools.code_interpreter) or the service's. Per tool at most
``min(num_workers, rate_limit)`` calls are in flight (the rest queue), each bounded by the
tool's ``default_timeout``, so a batch that fits in flight ends within the timeout (plus
process start-up) however many of its calls hang. A call the pool cannot run (unknown
tool, no ``code``) is an error result that names the tools, never an exception.
"""

from __future__ import annotations

import collections
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Sequence

from mindspeed_rl.tools.code_interpreter import CodeInterpreter
from mindspeed_rl.tools.config import ToolSpec
from mindspeed_rl.tools.parser import ToolCall
from mindspeed_rl.tools.result import ToolResult
from mindspeed_rl.tools.retool_code import prepare_code
from mindspeed_rl.tools.sandbox_fusion import SandboxFusionClient

_STATS = ("calls", "errors", "timeouts", "seconds")
_CLOSED = "Error: the tool pool was closed before the call ran"


def _runner(spec: ToolSpec):
    if spec.kind == "code_interpreter":
        return CodeInterpreter.from_spec(spec)
    if spec.kind == "sandbox_fusion":
        return SandboxFusionClient.from_spec(spec)
    raise ValueError(f"tool {spec.name!r}: unknown kind {spec.kind!r}")


def _run_safely(runner, code: str, started: float) -> ToolResult:
    """The runner's result; a bug in a runner still gives the call a result."""
    try:
        return runner.run(code, started)
    except Exception as e:  # noqa: BLE001 - the batch must come back whole
        return ToolResult.failed(f"Error: the tool failed ({type(e).__name__}: {e})")


def _shutdown(executors, runners) -> None:
    interpreters = [r for r in runners if isinstance(r, CodeInterpreter)]
    for runner in interpreters:
        runner.kill_all()
    for executor in executors:
        executor.shutdown(wait=True, cancel_futures=True)
    for runner in interpreters:
        runner.reap()  # the killed children finish dying: none is left when close returns


class ToolPool:
    """Runs tool calls for the tools of ``specs``; ``close()`` (or ``with``) ends it and
    leaves no child process."""

    def __init__(self, specs: Sequence[ToolSpec]) -> None:
        if not specs:
            raise ValueError("a tool pool needs at least one tool")
        self.specs = {spec.name: spec for spec in specs}
        self._runners = {spec.name: _runner(spec) for spec in specs}
        self._executors = {spec.name: ThreadPoolExecutor(max_workers=spec.max_in_flight,
                                                         thread_name_prefix=f"tool-{spec.name}")
                           for spec in specs}
        self._stats = dict.fromkeys(_STATS, 0.0)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, list(self._executors.values()),
                                           list(self._runners.values()))

    def run(self, calls: Sequence[tuple[int, ToolCall]]) -> list[ToolResult]:
        """The result of each call, in the order of ``calls`` (``(trajectory index, call)``
        pairs: the index is the caller's, the pool does not use it). Blocks until every
        call has ended; never raises for what a call or its code does."""
        if self._closed:
            raise RuntimeError("the tool pool is closed")
        results: list[ToolResult | None] = [None] * len(calls)
        queued = {name: collections.deque() for name in self.specs}
        for i, (_, call) in enumerate(calls):
            code = self._code_of(call)
            if isinstance(code, ToolResult):
                results[i] = code
            else:
                queued[call.name].append((i, code))
        self._dispatch(queued, results)
        for result in results:
            self._stats["calls"] += 1
            self._stats["errors"] += result.error
            self._stats["timeouts"] += result.timed_out
            self._stats["seconds"] += result.seconds
        return results

    def _dispatch(self, queued: dict, results: list) -> None:
        """Run the queued calls, at most ``max_in_flight`` per tool at a time. A call's
        time limit counts from the moment its slot was free (the batch's start for the
        first ``max_in_flight``), not from when its thread starts and gets the CPU: on a
        loaded host that is up to a second later, and the batch would end that late."""
        free = {name: spec.max_in_flight for name, spec in self.specs.items()}
        in_flight = {}
        while in_flight or any(queued.values()):
            now = time.monotonic()  # when the free slots of this round became free
            for name, queue in queued.items():
                while queue and free[name] > 0:
                    i, code = queue.popleft()
                    try:
                        future = self._executors[name].submit(
                            _run_safely, self._runners[name], code, now)
                    except RuntimeError:  # close() ran in another thread
                        results[i] = ToolResult.failed(_CLOSED)
                        continue
                    free[name] -= 1
                    in_flight[future] = (i, name)
            if not in_flight:
                continue
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                i, name = in_flight.pop(future)
                free[name] += 1
                results[i] = ToolResult.failed(_CLOSED) if future.cancelled() \
                    else future.result()

    def _code_of(self, call: ToolCall) -> str | ToolResult:
        """The code to run for ``call``, or the error result of a call that cannot run."""
        spec = self.specs.get(call.name)
        if spec is None:
            return ToolResult.failed(f"Error: there is no tool named {call.name!r}; the tools "
                                     f"are: {', '.join(self.specs)}")
        code = call.arguments.get("code") if isinstance(call.arguments, dict) else None
        if not isinstance(code, str):
            return ToolResult.failed(f"Error: the tool {call.name!r} needs the argument "
                                     "\"code\": a string of Python code")
        # The model's own "timeout" / "language" arguments are ignored (MindSpeed-RL obeys
        # them): the limits are the job's, not the policy's to raise.
        return prepare_code(code) if spec.code_format == "retool" else code

    def take_stats(self) -> dict[str, float]:
        """Calls, errors, timeouts and the calls' summed seconds since the last take."""
        stats, self._stats = self._stats, dict.fromkeys(_STATS, 0.0)
        return stats

    def close(self) -> None:
        """Kill the calls still in flight (another thread's ``run``) and stop the threads."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "ToolPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
