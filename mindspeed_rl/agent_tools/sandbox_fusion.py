"""A client of a SandboxFusion service (``POST {sandbox_fusion_url}``, e.g. ``/run_code``).

SandboxFusion (github.com/bytedance/SandboxFusion) runs code in its own isolated runtime
and answers ``{"status": "Success" | "Failed" | "SandboxError", "message": ...,
"run_result": {"status": "Finished" | "Error" | "TimeLimitExceeded", "return_code": ...,
"stdout": ..., "stderr": ...}}``. This client posts MindSpeed-RL's request (the code,
``language``, ``run_timeout`` = ``compile_timeout`` = ``default_timeout``,
``memory_limit_MB``) with the standard library only, and maps every outcome to a
:class:`ToolResult`: a refused connection, an HTTP error, a body that is not the
expected JSON or a service that does not answer in time is an error/timeout result for
the model, never an exception in the trainer.

The whole exchange has one deadline (``default_timeout`` + ``margin_s``): socket
timeouts alone bound each read, not a service that trickles bytes, so a timer shuts the
socket down when the deadline passes. There are no retries (MindSpeed-RL retries a 504
three times): a retry would spend the time the rollout is waiting for.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlsplit

from mindspeed_rl.agent_tools.result import ToolResult, timeout_text

MARGIN_S = 10.0  # the service's overhead on top of run_timeout (MindSpeed-RL's API_TIMEOUT)
MAX_RESPONSE_BYTES = 4 << 20


class SandboxFusionClient:
    """Runs code through the SandboxFusion service at ``url``; :meth:`run` never raises."""

    def __init__(self, url: str, timeout_s: float, memory_limit_mb: int, *,
                 language: str = "python", margin_s: float = MARGIN_S) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"sandbox_fusion_url {url!r} is not an http(s) URL")
        self.url = url
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.language = language
        self.margin_s = margin_s

    @classmethod
    def from_spec(cls, spec) -> "SandboxFusionClient":
        return cls(spec.sandbox_fusion_url, spec.default_timeout, spec.memory_limit_mb,
                   language=spec.language)

    def run(self, code: str, started: float | None = None) -> ToolResult:
        """Run ``code`` in the service; its output (stdout, then stderr) and how it ended.
        The deadline counts from ``started`` (``time.monotonic()``; default: now)."""
        started = time.monotonic() if started is None else started
        body = json.dumps({
            "code": code, "language": self.language, "stdin": None,
            "compile_timeout": self.timeout_s, "run_timeout": self.timeout_s,
            "memory_limit_MB": self.memory_limit_mb, "files": {}, "fetch_files": [],
        }).encode()
        limit = self.timeout_s + self.margin_s
        try:
            status, payload = self._post(body, max(0.01, started + limit - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - any failure of the exchange is the call's result
            seconds = time.monotonic() - started
            if isinstance(e, TimeoutError):  # socket.timeout is TimeoutError since 3.10
                return ToolResult.timeout(
                    f"Error: the code sandbox did not answer within {limit:g} s", seconds)
            return ToolResult.failed(f"Error: the code sandbox at {self.url} could not be "
                                     f"reached ({_describe(e)})", seconds)
        return self._result(status, payload, time.monotonic() - started)

    def _post(self, body: bytes, limit: float) -> tuple[int, bytes]:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = kind(self._host, self._port, timeout=limit)
        fired = threading.Event()
        timer = threading.Timer(limit, _shut, (conn, fired))
        timer.daemon = True
        timer.start()
        try:
            conn.request("POST", self._path, body=body, headers={
                "Content-Type": "application/json", "Accept": "application/json"})
            response = conn.getresponse()
            payload = response.read(MAX_RESPONSE_BYTES + 1)
            if fired.is_set():  # cut short by the deadline: what was read is not the answer
                raise TimeoutError
            return response.status, payload
        except Exception:
            if fired.is_set():
                raise TimeoutError from None
            raise
        finally:
            timer.cancel()
            conn.close()

    def _result(self, status: int, payload: bytes, seconds: float) -> ToolResult:
        if status != 200:
            head = payload[:200].decode("utf-8", errors="replace")
            return ToolResult.failed(f"Error: the code sandbox answered HTTP {status}: {head}",
                                     seconds)
        if len(payload) > MAX_RESPONSE_BYTES:
            return ToolResult.failed(f"Error: the code sandbox's answer is larger than "
                                     f"{MAX_RESPONSE_BYTES} bytes", seconds)
        try:
            answer = json.loads(payload)
        except ValueError:
            return ToolResult.failed("Error: the code sandbox's answer is not JSON", seconds)
        run = answer.get("run_result") if isinstance(answer, dict) else None
        if not isinstance(run, dict):
            message = answer.get("message") if isinstance(answer, dict) else None
            state = answer.get("status") if isinstance(answer, dict) else None
            return ToolResult.failed(f"Error: the code sandbox did not run the code "
                                     f"(status {state!r}: {message or 'no message'})", seconds)
        text = f"{run.get('stdout') or ''}{run.get('stderr') or ''}"
        if run.get("status") == "TimeLimitExceeded":
            return ToolResult.timeout(timeout_text(self.timeout_s, text), seconds)
        if run.get("status") != "Finished":
            return ToolResult.failed(text or f"Error: the code sandbox reports run status "
                                             f"{run.get('status')!r}", seconds)
        if run.get("return_code") == 0:
            return ToolResult(text=text, ok=True, timed_out=False, error=False, seconds=seconds)
        return ToolResult.failed(text if text.strip() else f"Error: the program exited with "
                                                           f"status {run.get('return_code')}",
                                 seconds)


def _shut(conn: http.client.HTTPConnection, fired: threading.Event) -> None:
    """The deadline passed: wake the thread blocked on the socket (a close would not)."""
    fired.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _describe(error: Exception) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
