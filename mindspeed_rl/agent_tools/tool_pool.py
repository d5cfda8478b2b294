"""The tool pool of one rank: a batch of tool calls from many trajectories, run at once.

``run`` takes a batch (a synchronous turn of the agent loop waits for all of it);
``submit`` takes one call and returns a future (the step-wise loop continues each
trajectory as soon as its own calls are back). Calls run concurrently: one thread per call
in flight, each driving one child process (the local interpreter) or one HTTP request
(SandboxFusion). The threads only wait; the isolation and the limits are the child's
(mindspeed_rl.agent_tools.code_interpreter) or the service's. Per tool at most
``min(num_workers, rate_limit)`` calls are in flight (the rest queue), each bounded by the
tool's ``default_timeout``, so a batch that fits in flight ends within the timeout (plus
process start-up) however many of its calls hang. A call the pool cannot run (unknown
tool, no ``code``) is an error result that names the tools, never an exception.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from mindspeed_rl.agent_tools.code_interpreter import CodeInterpreter
from mindspeed_rl.agent_tools.config import ToolSpec
from mindspeed_rl.agent_tools.parser import ToolCall
from mindspeed_rl.agent_tools.result import ToolResult
from mindspeed_rl.agent_tools.retool_code import prepare_code
from mindspeed_rl.agent_tools.sandbox_fusion import SandboxFusionClient

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
        # Calls waiting for a slot, and the free slots, per tool; _lock guards both and the
        # stats (calls end on the executors' threads).
        self._waiting = {spec.name: collections.deque() for spec in specs}
        self._free = {spec.name: spec.max_in_flight for spec in specs}
        self._lock = threading.RLock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, list(self._executors.values()),
                                           list(self._runners.values()))

    def run(self, calls: Sequence[tuple[int, ToolCall]]) -> list[ToolResult]:
        """The result of each call, in the order of ``calls`` (``(trajectory index, call)``
        pairs: the index is the caller's, the pool does not use it). Blocks until every
        call has ended; never raises for what a call or its code does."""
        started = time.monotonic()  # the batch's calls that get a slot at once start now
        futures = [self.submit(call, started) for _, call in calls]
        return [future.result() for future in futures]

    def submit(self, call: ToolCall, started: float | None = None) -> Future:
        """Start ``call`` (or queue it behind the tool's ``max_in_flight`` calls); the future's
        result is its ToolResult, never an exception. Safe from any thread. ``started``
        (time.monotonic) is when its time limit starts counting if it gets a slot at once:
        now by default."""
        if self._closed:
            raise RuntimeError("the tool pool is closed")
        out: Future = Future()
        code = self._code_of(call)
        if isinstance(code, ToolResult):
            self._finish(out, code)
            return out
        with self._lock:
            self._waiting[call.name].append((code, out))
            self._start_waiting(call.name, time.monotonic() if started is None else started)
        return out

    def _start_waiting(self, name: str, now: float) -> None:
        """Start the tool's queued calls while it has free slots (the caller holds the lock).
        A call's time limit counts from ``now``, the moment its slot was free (or its batch
        started), not from when its thread starts and gets the CPU: on a loaded host that is
        up to a second later, and a batch would end that late."""
        queue = self._waiting[name]
        while queue and self._free[name] > 0:
            code, out = queue.popleft()
            try:
                future = self._executors[name].submit(_run_safely, self._runners[name], code,
                                                      now)
            except RuntimeError:  # close() ran in another thread
                self._finish(out, ToolResult.failed(_CLOSED))
                continue
            self._free[name] -= 1
            future.add_done_callback(functools.partial(self._call_ended, name, out))

    def _call_ended(self, name: str, out: Future, future: Future) -> None:
        result = ToolResult.failed(_CLOSED) if future.cancelled() else future.result()
        with self._lock:
            self._free[name] += 1
            self._start_waiting(name, time.monotonic())
        self._finish(out, result)

    def _finish(self, out: Future, result: ToolResult) -> None:
        with self._lock:
            self._stats["calls"] += 1
            self._stats["errors"] += result.error
            self._stats["timeouts"] += result.timed_out
            self._stats["seconds"] += result.seconds
        out.set_result(result)

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
        with self._lock:
            stats, self._stats = self._stats, dict.fromkeys(_STATS, 0.0)
        return stats

    def close(self) -> None:
        """Kill the calls in flight (another thread's ``run``, or submitted ones), end the
        queued ones with an error result and stop the threads."""
        self._closed = True
        with self._lock:
            queued = [out for queue in self._waiting.values() for _, out in queue]
            for queue in self._waiting.values():
                queue.clear()
        for out in queued:
            self._finish(out, ToolResult.failed(_CLOSED))
        self._finalizer()

    def __enter__(self) -> "ToolPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
