"""mindspeed_rl.agent_tools: the tool YAML, hermes parsing, the local interpreter's limits, the
SandboxFusion client, and the pool (the acceptance test of the pool: 64 trajectories, 5 % of
the calls hang and 5 % crash, the batch ends within default_timeout + 10 % and no child
process survives).

The SandboxFusion tests talk to a small HTTP server started here on 127.0.0.1 that
returns canned SandboxFusion answers: it stands for the service, the client is real.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from mindspeed_rl.agent_tools import (CodeInterpreter, SandboxFusionClient, ToolCall, ToolConfigError,
                                ToolPool, ToolSpec, load_tool_config, parse_hermes,
                                tool_system_prompt, truncate)
from mindspeed_rl.agent_tools.config import CODE_INTERPRETER
from mindspeed_rl.agent_tools.retool_code import prepare_code
from mindspeed_rl.agent_tools.sandbox import RUNTIME_DIR

ROOT = Path(__file__).resolve().parents[1]
RETOOL_YAML = ROOT / "configs" / "tools" / "retool_config.yaml"
LOCAL_YAML = ROOT / "configs" / "tools" / "code_interpreter.yaml"


def _spec(**overrides) -> ToolSpec:
    fields = dict(name="code_interpreter", class_name=CODE_INTERPRETER, kind="code_interpreter",
                  schema={}, num_workers=4, rate_limit=4, default_timeout=5.0,
                  memory_limit_mb=512, sandbox_fusion_url=None, language="python")
    fields.update(overrides)
    return ToolSpec(**fields)


def _call(code: str, name: str = "code_interpreter") -> ToolCall:
    return ToolCall(name=name, arguments={"code": code}, raw="")


_PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()


def _doomed_or_gone(proc: psutil.Process) -> bool:
    """Gone, a zombie, exiting, or with SIGKILL pending: it cannot run any more of its code.
    A killed process can take a moment to finish dying on a loaded host; once SIGKILL is
    taken it is no longer pending but the task is in do_exit() (PF_EXITING), where bwrap's
    PID-namespace init also sleeps until everything in its namespace is gone."""
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        with open(f"/proc/{proc.pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
        if flags & _PF_EXITING:
            return True
        with open(f"/proc/{proc.pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f
                       if line.startswith(("SigPnd:", "ShdPnd:"))]
        return any(mask & (1 << (signal.SIGKILL - 1)) for mask in pending)
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
        return True


_EARLIER_CHILDREN: set[int] = set()


@pytest.fixture(autouse=True)
def _children_of_earlier_tests():
    """Children this test did not start: in a full run, other modules leave long-lived ones
    (multiprocessing's resource tracker after a spawn-context queue, for one). The checks
    below are about the children a tool call starts, so those are left out."""
    _EARLIER_CHILDREN.clear()
    _EARLIER_CHILDREN.update(p.pid for p in psutil.Process().children(recursive=True))
    yield


def _new_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in _EARLIER_CHILDREN]


def _running_children(settle_s: float = 5.0) -> list[psutil.Process]:
    """New children that can still run code, once the kills sent so far have had up to
    ``settle_s`` to land. A sandboxed call's inner bwrap gets its SIGKILL only when the
    outer one has died (``--die-with-parent``) and the code only when that PID-namespace
    init dies: with 64 calls on 2 loaded cores that chain can take longer than the pool's
    return (seen once in a full run). A process nobody killed is still running after it."""
    deadline = time.monotonic() + settle_s
    while True:
        running = [p for p in _new_children() if not _doomed_or_gone(p)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.1)


def _describe(procs: list[psutil.Process]) -> str:
    """What a failure needs to tell a leak from a slow death: parent, state, kernel flags."""
    lines = []
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            lines.append(f"pid {proc.pid} ppid {fields[1]} state {fields[0]} "
                         f"flags {int(fields[6]):#x} {proc.cmdline()[:3]}")
        except (psutil.Error, OSError) as e:
            lines.append(f"pid {proc.pid}: {e}")
    return "\n".join(lines)


def _running_with_cmdline(args: list[str]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.info["cmdline"] == args and not _doomed_or_gone(proc):
            found.append(proc)
    return found


# ---- the tool YAML --------------------------------------------------------------------

def test_mindspeed_rl_retool_config_selects_the_sandbox_fusion_client():
    [spec] = load_tool_config(RETOOL_YAML)
    assert (spec.name, spec.kind, spec.class_name) == (
        "code_interpreter", "sandbox_fusion", "mindspeed_rl.tools.retool.ReTool")
    assert spec.sandbox_fusion_url == "http://localhost:8080/run_code"
    assert (spec.num_workers, spec.rate_limit, spec.default_timeout, spec.memory_limit_mb) == (
        128, 128, 30.0, 1024)
    assert spec.language == "python" and spec.code_format == "retool"
    assert spec.schema["function"]["parameters"]["required"] == ["code"]


def test_local_interpreter_config():
    [spec] = load_tool_config(LOCAL_YAML)
    assert (spec.kind, spec.sandbox_fusion_url) == ("code_interpreter", None)
    assert (spec.num_workers, spec.default_timeout, spec.memory_limit_mb) == (4, 5.0, 512)
    assert spec.site_packages == ("numpy", "sympy", "mpmath") and not spec.unsafe_no_sandbox


def test_the_interpreters_class_name_before_the_package_rename_still_loads(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(LOCAL_YAML.read_text().replace(CODE_INTERPRETER,
                                                  "mindspeed_rl.tools.code_interpreter."
                                                  "CodeInterpreter"))
    assert CODE_INTERPRETER not in old.read_text()
    assert load_tool_config(old) == load_tool_config(LOCAL_YAML)


def test_allowed_packages_import_in_the_sandbox_and_nothing_else():
    result = CodeInterpreter(30, 512, site_packages=("numpy", "sympy", "mpmath")).run(
        "import numpy, sympy\nx = sympy.symbols('x')\n"
        "print(sympy.solve(x ** 2 - 4, x), int(numpy.arange(5).sum()))\nimport yaml")
    assert result.text.startswith("[-2, 2] 10\n"), result.text
    assert "ModuleNotFoundError: No module named 'yaml'" in result.text


_GOOD = """\
tools:
  - class_name: "mindspeed_rl.tools.retool.ReTool"
    config:
      sandbox_fusion_url: "http://localhost:8080/run_code"
      num_workers: 8
      rate_limit: 8
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code: {type: "string", description: "The code to execute."}
          required: ["code"]
"""

# (name, the YAML, the key the message must name)
_REFUSED = [
    ("not yaml", "tools: [\n  - {", "not valid YAML"),
    ("no tools", "other: 1\n", "tools"),
    ("empty tools", "tools: []\n", "tools"),
    ("tools not a list", "tools: 3\n", "tools"),
    ("duplicate names", _GOOD + _GOOD[len("tools:\n"):], "tools[1].tool_schema.function.name"),
    ("no function name", _GOOD.replace('name: "code_interpreter"', 'description2: "x"'),
     "tools[0].tool_schema.function.name"),
    ("no schema", _GOOD[:_GOOD.index("    tool_schema")], "tools[0].tool_schema"),
    ("schema without code", _GOOD.replace("code: {", "script: {"),
     "tools[0].tool_schema.function.parameters.properties"),
    ("type not native", _GOOD.replace("type: native", "type: mcp"), "tools[0].config.type"),
    ("language", _GOOD.replace('"python"', '"cpp"'), "tools[0].config.default_language"),
    ("num_workers 0", _GOOD.replace("num_workers: 8", "num_workers: 0"),
     "tools[0].config.num_workers"),
    ("num_workers bool", _GOOD.replace("num_workers: 8", "num_workers: true"),
     "tools[0].config.num_workers"),
    ("rate_limit", _GOOD.replace("rate_limit: 8", "rate_limit: -2"), "tools[0].config.rate_limit"),
    ("timeout 0", _GOOD.replace("default_timeout: 30", "default_timeout: 0"),
     "tools[0].config.default_timeout"),
    ("timeout text", _GOOD.replace("default_timeout: 30", "default_timeout: soon"),
     "tools[0].config.default_timeout"),
    ("memory", _GOOD.replace("memory_limit_mb: 1024", "memory_limit_mb: 0"),
     "tools[0].config.memory_limit_mb"),
    ("search tool", _GOOD.replace("mindspeed_rl.tools.retool.ReTool",
                                  "mindspeed_rl.tools.search_tool.SearchTool"),
     "tools[0].class_name"),
    ("no url", _GOOD.replace('      sandbox_fusion_url: "http://localhost:8080/run_code"\n', ""),
     "tools[0].config.sandbox_fusion_url"),
    ("url without scheme", _GOOD.replace('"http://localhost:8080/run_code"', '"localhost:8080"'),
     "tools[0].config.sandbox_fusion_url"),
    ("typo in a key", _GOOD.replace("default_timeout:", "default_timout:"),
     "tools[0].config.default_timout"),
    ("unknown entry key", _GOOD.replace("    config:", "    cfg: {}\n    config:"),
     "tools[0].cfg"),
    ("all site_packages in the sandbox", _GOOD.replace("type: native",
                                                       "type: native\n      site_packages: true"),
     "tools[0].config.site_packages: true; the sandbox binds only the packages it is told"),
    ("site_packages not names", _GOOD.replace("type: native",
                                              "type: native\n      site_packages: [numpy.linalg]"),
     "tools[0].config.site_packages"),
    ("unsafe_no_sandbox not a bool",
     _GOOD.replace("type: native", "type: native\n      unsafe_no_sandbox: yes please"),
     "tools[0].config.unsafe_no_sandbox"),
]


@pytest.mark.parametrize("name,text,key", _REFUSED, ids=[r[0] for r in _REFUSED])
def test_bad_tool_yaml_is_refused_naming_file_and_key(tmp_path, name, text, key):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError) as e:
        load_tool_config(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and key in message, message


def test_missing_file_and_unknown_class_messages(tmp_path):
    with pytest.raises(ToolConfigError, match="no such file"):
        load_tool_config(tmp_path / "absent.yaml")
    path = tmp_path / "search.yaml"
    path.write_text(_GOOD.replace("mindspeed_rl.tools.retool.ReTool",
                                  "mindspeed_rl.tools.search_tool.SearchTool"))
    with pytest.raises(ToolConfigError) as e:
        load_tool_config(path)
    assert "SearchTool" in str(e.value) and CODE_INTERPRETER in str(e.value)


def test_rate_limit_only_with_the_global_rate_limit(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(_GOOD.replace("rate_limit: 8", "rate_limit: 2"))
    assert load_tool_config(path)[0].max_in_flight == 2
    path.write_text(_GOOD.replace("rate_limit: 8", "rate_limit: 2\n      "
                                  "enable_global_rate_limit: false"))
    assert load_tool_config(path)[0].max_in_flight == 8


def test_config_module_imports_neither_torch_nor_vllm():
    code = ("import sys, mindspeed_rl.agent_tools.config as c; c.load_tool_config(sys.argv[1]); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    subprocess.run([sys.executable, "-c", code, str(RETOOL_YAML)], check=True, cwd=ROOT)


def test_tool_system_prompt_is_what_the_chat_template_writes():
    specs = load_tool_config(RETOOL_YAML)
    block = tool_system_prompt(specs)
    assert block.startswith("# Tools\n\nYou may call one or more functions")
    assert json.dumps(specs[0].schema) in block
    # The hermes tools block is the same text in Qwen2.5's, Qwen3's and vLLM's copies of it.
    vllm = importlib.util.find_spec("vllm")
    template = (Path(vllm.origin).parent / "transformers_utils" / "chat_templates"
                / "template_minicpmv45.jinja") if vllm and vllm.origin else None
    if template is None or not template.exists():
        pytest.skip("no chat template with the hermes tools block in this environment")
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template(
        conversations=[[{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]],
        tools=[s.schema for s in specs], chat_template=template.read_text())
    assert f"<|im_start|>system\nS\n\n{block}<|im_end|>\n" in rendered[0]


# ---- hermes parsing and truncation ------------------------------------------------------

def test_parse_one_call():
    text = ('Let me compute.\n<tool_call>\n{"name": "code_interpreter", "arguments": '
            '{"code": "print(1 + 1)"}}\n</tool_call>')
    result = parse_hermes(text)
    assert result.errors == []
    [call] = result.calls
    assert (call.name, call.arguments) == ("code_interpreter", {"code": "print(1 + 1)"})
    assert call.raw.strip().startswith('{"name"')


def test_parse_several_calls_string_arguments_and_nested_braces():
    code = "d = {'a': {'b': [1, {2: 3}]}}\nprint(f'{d}')"
    text = ("<tool_call>" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
            + "</tool_call> and <tool_call>"
            + json.dumps({"name": "code_interpreter", "arguments": json.dumps({"code": "1"})})
            + "</tool_call>")
    result = parse_hermes(text)
    assert result.errors == []
    assert [c.arguments["code"] for c in result.calls] == [code, "1"]


@pytest.mark.parametrize("body,expected", [
    ('{"name": "code_interpreter", "arguments": {"code": "x"}', "not valid JSON"),
    ('{"arguments": {"code": "x"}}', 'no "name"'),
    ('["code_interpreter"]', "JSON object"),
    ('{"name": "f", "arguments": "{not json"}', "arguments of 'f' are not valid JSON"),
    ('{"name": "f", "arguments": [1]}', "must be a JSON object"),
    ("[" * 100_000, "not valid JSON"),  # deeper than json's recursion limit
])
def test_malformed_calls_are_errors_not_exceptions(body, expected):
    result = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert result.calls == [] and len(result.errors) == 1
    assert result.errors[0].startswith("Error:") and expected in result.errors[0]
    assert len(result.errors[0]) < 400


def test_unclosed_call_is_an_error_and_text_without_calls_is_nothing():
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {}}').errors
    assert parse_hermes("no calls here, </tool_call> stray").calls == []
    assert parse_hermes("no calls here, </tool_call> stray").errors == []
    assert parse_hermes('<tool_call>{"name": "f"}</tool_call>').calls[0].arguments == {}


_ADVERSARIAL = {
    "open tags": "<tool_call>" * 6000,
    "open tag then braces": "<tool_call>" + "{" * 65536,
    "deep brackets": "<tool_call>" + "[" * 65536 + "</tool_call>",
    "partial tags": "<tool_call" * 6500,
    "empty calls": "<tool_call></tool_call>" * 2900,
    "lt": "<" * 65536,
    "nested open in block": "<tool_call>" * 6000 + '{"name": "f"}</tool_call>',
    "many valid calls": '<tool_call>{"name": "f", "arguments": {"code": "1"}}</tool_call>' * 1000,
    "unterminated string": '<tool_call>{"name": "' + "\\\"" * 32000 + "</tool_call>",
}


@pytest.mark.parametrize("name", sorted(_ADVERSARIAL))
def test_parse_is_linear_on_adversarial_text(name):
    text = _ADVERSARIAL[name]
    assert len(text) >= 64_000
    started = time.perf_counter()
    parse_hermes(text)
    assert time.perf_counter() - started < 0.5


def test_truncate_keeps_the_named_side():
    text = "0123456789" * 3
    assert truncate(text, 100, "left") == text
    assert truncate(text, 5, "left") == "01234...(truncated)"
    assert truncate(text, 5, "right") == "(truncated)...56789"
    assert truncate(text, 6, "middle") == "012...(truncated)...789"
    assert truncate(text, 5, "middle") == "01...(truncated)...789"
    assert truncate(text, 0, "middle") == "...(truncated)..."
    with pytest.raises(ValueError):
        truncate(text, 5, "both")


# ---- the local interpreter -----------------------------------------------------------------

def test_interpreter_runs_code():
    result = CodeInterpreter(10, 512).run("import math\nprint(math.factorial(10))")
    assert (result.ok, result.error, result.timed_out) == (True, False, False)
    assert result.text == "3628800\n"


@pytest.mark.parametrize("code,expected", [
    ("import os\nprint('before', flush=True)\nos.abort()", "SIGABRT"),
    ("raise ValueError('bad value')", "ValueError: bad value"),
    ("import sys\nsys.exit(3)", "exited with status 3"),
    ("def f(:\n    pass", "SyntaxError"),
    ("x = bytearray(2 * 1024 ** 3)", "MemoryError"),  # 2 GB past memory_limit_mb
    ("print(input())", "EOFError"),                   # stdin is empty, not the parent's
])
def test_interpreter_reports_crashes(code, expected):
    result = CodeInterpreter(10, 512).run(code)
    assert (result.ok, result.error, result.timed_out) == (False, True, False)
    assert expected in result.text
    assert "_run" not in result.text and "<string>" not in result.text  # no wrapper frames
    assert result.seconds < 10


def test_timeout_kills_the_whole_process_group():
    """Without the sandbox (unsafe_no_sandbox) the call's process group is killed at the
    deadline, children and grandchildren included. (In the sandbox no process can start
    one: tests/test_sandbox.py.)"""
    marker = ["sleep", "987.654"]
    code = textwrap.dedent(f"""
        import os, subprocess, time
        subprocess.Popen({marker!r})
        if os.fork() == 0:
            time.sleep(1000)
        print('started', flush=True)
        time.sleep(1000)
    """)
    result = CodeInterpreter(1.5, 512, sandboxed=False).run(code)
    assert (result.ok, result.error, result.timed_out) == (False, False, True)
    assert result.text.startswith("started") and "timed out after 1.5 s" in result.text
    assert 1.5 <= result.seconds < 3
    assert _running_with_cmdline(marker) == []
    assert _running_children() == []


def test_cpu_limit_and_wall_limit():
    result = CodeInterpreter(1, 512).run("while True:\n    pass")
    assert result.timed_out and not result.error and result.seconds < 3
    assert result.text == "Error: execution timed out after 1 s"


@pytest.mark.parametrize("sandboxed", [True, False])
def test_environment_is_scrubbed_and_workdir_removed(monkeypatch, sandboxed):
    monkeypatch.setenv("MSRL_TEST_SECRET", "hunter2")
    code = ("import os, json\nopen('scratch.txt', 'w').write('x')\n"
            "print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd()}))")
    result = CodeInterpreter(10, 512, sandboxed=sandboxed).run(code)
    assert result.ok, result.text
    seen = json.loads(result.text)
    assert "hunter2" not in result.text
    # in the sandbox: PWD (bwrap's --chdir sets it) and, for a Python built with a shared
    # libpython, LD_LIBRARY_PATH naming where the sandbox shows it
    shared = sandboxed and sysconfig.get_config_var("Py_ENABLE_SHARED")
    assert set(seen["env"]) == {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "OMP_NUM_THREADS",
                                "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"} | (
                                    {"PWD"} if sandboxed else set()) | (
                                    {"LD_LIBRARY_PATH"} if shared else set())
    if shared:
        assert seen["env"]["LD_LIBRARY_PATH"].startswith(RUNTIME_DIR)
    assert seen["env"]["PATH"] == "/usr/bin:/bin" and seen["env"]["HOME"] == seen["cwd"]
    if sandboxed:  # a private tmpfs, gone with the sandbox: the host's /tmp is untouched
        assert seen["cwd"] == "/tmp" and not os.path.exists("/tmp/scratch.txt")
    else:
        assert not os.path.exists(seen["cwd"])


def test_site_packages_are_not_importable_by_default():
    result = CodeInterpreter(10, 512).run("import yaml")
    assert result.error and "ModuleNotFoundError" in result.text


def test_output_is_capped():
    started = time.monotonic()
    result = CodeInterpreter(10, 512, max_output_bytes=64 * 1024).run(
        "while True:\n    print('y' * 1000)")
    assert result.error and "more than 65536 bytes" in result.text
    assert len(result.text) < 70 * 1024
    assert time.monotonic() - started < 5


def test_calls_in_flight_die_with_the_rank(tmp_path):
    """The rank is SIGKILLed mid-call (without the sandbox): the call's process group kills
    itself."""
    pid_file = tmp_path / "pid"
    rank = textwrap.dedent(f"""
        from mindspeed_rl.agent_tools import CodeInterpreter
        CodeInterpreter(60, 512, sandboxed=False).run("import os, time\\n"
            "open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{os.getcwd()}}')\\n"
            "time.sleep(1000)")
    """)
    proc = subprocess.Popen([sys.executable, "-c", rank], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid, workdir = pid_file.read_text().split(" ", 1)
        child = psutil.Process(int(pid))
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not _doomed_or_gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _doomed_or_gone(child)
    assert not os.path.exists(workdir)  # removed by the child before it killed its group


def test_sandboxed_calls_die_with_the_rank(tmp_path):
    """The rank is SIGKILLed mid-call: bwrap (--die-with-parent) and every process of the
    sandbox die with it."""
    ready = tmp_path / "ready"
    rank = textwrap.dedent(f"""
        import threading, time
        from mindspeed_rl.agent_tools import CodeInterpreter
        threading.Thread(target=lambda: (time.sleep(1.5), open({str(ready)!r}, "w").close()),
                         daemon=True).start()
        CodeInterpreter(60, 512).run("import time\\ntime.sleep(1000)")
    """)
    proc = subprocess.Popen([sys.executable, "-c", rank], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sandbox = psutil.Process(proc.pid).children(recursive=True)
    finally:
        proc.kill()
        proc.wait()
    assert len(sandbox) >= 2  # bwrap, its init in the new PID namespace, the interpreter
    deadline = time.monotonic() + 10
    while not all(_doomed_or_gone(p) for p in sandbox) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_doomed_or_gone(p) for p in sandbox)


def test_retool_code_format():
    assert prepare_code("x = 6\nx * 7") == "x = 6\nprint(x * 7)"
    assert prepare_code("```python\ny = 2\ny ** 10\n```\nsome prose") == "y = 2\nprint(y ** 10)"
    assert prepare_code("print(1)") == "print(1)"
    assert prepare_code("for i in range(3):\n    t = i") == "for i in range(3):\n    t = i"
    assert prepare_code("def f(:") == "def f(:"
    with ToolPool([_spec(code_format="retool")]) as pool:
        [result] = pool.run([(0, _call("x = 6\nx * 7"))])
    assert result.ok and result.text == "42\n"


# ---- the SandboxFusion client -----------------------------------------------------------------

_ANSWERS = {
    "/ok": (200, {"status": "Success", "message": "", "run_result": {
        "status": "Finished", "execution_time": 0.01, "return_code": 0,
        "stdout": "42\n", "stderr": ""}}),
    "/fail": (200, {"status": "Failed", "message": "", "run_result": {
        "status": "Finished", "return_code": 1, "stdout": "",
        "stderr": "Traceback...\nZeroDivisionError: division by zero\n"}}),
    "/slow": (200, {"status": "Failed", "message": "", "run_result": {
        "status": "TimeLimitExceeded", "return_code": None, "stdout": "partial\n",
        "stderr": ""}}),
    "/down": (200, {"status": "SandboxError", "message": "no runtime", "run_result": None}),
    "/500": (500, "internal error"),
    "/text": (200, "<html>not json</html>"),
}


class _FakeSandbox(http.server.BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _FakeSandbox.requests.append(json.loads(body))
        status, answer = _ANSWERS[self.path]
        data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def sandbox_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeSandbox)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_sandbox_fusion_request_and_success(sandbox_url):
    _FakeSandbox.requests.clear()
    result = SandboxFusionClient(sandbox_url + "/ok", 7, 256).run("print(6 * 7)")
    assert (result.ok, result.text) == (True, "42\n")
    [request] = _FakeSandbox.requests
    assert request["code"] == "print(6 * 7)" and request["language"] == "python"
    assert (request["run_timeout"], request["compile_timeout"], request["memory_limit_MB"]) == (
        7, 7, 256)


@pytest.mark.parametrize("path,kind,expected", [
    ("/fail", "error", "ZeroDivisionError"),
    ("/slow", "timed_out", "partial\nError: execution timed out after 7 s"),
    ("/down", "error", "no runtime"),
    ("/500", "error", "HTTP 500"),
    ("/text", "error", "not JSON"),
])
def test_sandbox_fusion_failures_are_results(sandbox_url, path, kind, expected):
    result = SandboxFusionClient(sandbox_url + path, 7, 256).run("1/0")
    assert getattr(result, kind) and not result.ok and expected in result.text


def test_sandbox_fusion_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections in the kernel, never answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/run_code"
        result = SandboxFusionClient(url, 0.3, 256, margin_s=0.3).run("print(1)")
    finally:
        listener.close()
    assert result.timed_out and not result.error and "did not answer within 0.6 s" in result.text
    assert 0.6 <= result.seconds < 2


def test_sandbox_fusion_refused_connection_is_an_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    result = SandboxFusionClient(f"http://127.0.0.1:{port}/run_code", 5, 256).run("print(1)")
    assert result.error and "connection refused" in result.text and result.seconds < 2


# ---- the pool ------------------------------------------------------------------------------

def test_pool_answers_calls_it_cannot_run_and_counts():
    calls = [(0, _call("print(1)")), (1, _call("print(2)", name="search")),
             (2, ToolCall("code_interpreter", {"script": "print(3)"}, "")), (3, _call("1/0"))]
    with ToolPool([_spec(num_workers=2, rate_limit=2)]) as pool:
        results = pool.run(calls)
        stats = pool.take_stats()
        assert pool.take_stats() == {"calls": 0, "errors": 0, "timeouts": 0, "seconds": 0}
    assert results[0].ok and results[0].text == "1\n"
    assert results[1].error and "no tool named 'search'" in results[1].text
    assert "code_interpreter" in results[1].text
    assert results[2].error and '"code"' in results[2].text
    assert results[3].error and "ZeroDivisionError" in results[3].text
    assert (stats["calls"], stats["errors"], stats["timeouts"]) == (4, 3, 0)
    assert stats["seconds"] > 0
    with pytest.raises(RuntimeError):
        pool.run(calls)


def test_pool_queues_past_num_workers():
    code = ("import os, time\nopen('/tmp/msrl-tools-test-%d' % os.getpid(), 'w').close()\n"
            "time.sleep(0.3)\nprint('done')")
    with ToolPool([_spec(num_workers=2, rate_limit=2)]) as pool:
        results = pool.run([(i, _call(code)) for i in range(5)])
    assert all(r.ok and r.text == "done\n" for r in results)
    for path in Path("/tmp").glob("msrl-tools-test-*"):
        path.unlink()


def test_64_trajectories_with_hanging_and_crashing_calls():
    """The pool's acceptance test. 64 calls, one per trajectory: 3 hang (spin, sleep), 3
    crash (abort, raise), 58 print a product. All 64 in flight at once; the batch ends
    within default_timeout + 10 %, every result is there, and no child process survives."""
    timeout = 5.0
    hang = {5: "while True:\n    pass", 26: "import time\ntime.sleep(10 ** 6)",
            47: "import threading\nthreading.Event().wait()"}
    crash = {12: "import os\nos.abort()", 33: "raise RuntimeError('boom')",
             54: "import sys\nsys.exit(2)"}
    code = {i: hang.get(i) or crash.get(i) or f"print({i} * 7)" for i in range(64)}
    pool = ToolPool([_spec(num_workers=64, rate_limit=64, default_timeout=timeout)])
    try:
        started = time.monotonic()
        results = pool.run([(i, _call(code[i])) for i in range(64)])
        wall = time.monotonic() - started
        running = _running_children()  # all ended or killed (SIGKILL pending)
        assert running == [], _describe(running)
        assert pool.run([(0, _call("print('the run continues')"))])[0].ok
    finally:
        pool.close()
    assert _new_children() == []
    print(f"64 calls: {wall:.2f} s; ok calls took {max(r.seconds for r in results if r.ok):.2f} s "
          "at most")
    assert wall <= timeout * 1.1, wall
    assert len(results) == 64
    for i, result in enumerate(results):
        if i in hang:
            assert result.timed_out and not result.error, (i, result)
        elif i in crash:
            assert result.error and not result.timed_out, (i, result)
        else:
            assert result.ok and result.text == f"{i * 7}\n", (i, result)


def test_close_kills_calls_in_flight():
    pool = ToolPool([_spec(default_timeout=60)])
    results = []
    runner = threading.Thread(target=lambda: results.extend(
        pool.run([(0, _call("import time\ntime.sleep(1000)"))])))
    runner.start()
    deadline = time.monotonic() + 30
    while not _new_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    pool.close()
    runner.join(30)
    assert time.monotonic() - started < 10
    assert results and not results[0].ok
    assert _new_children() == []


def test_submit_returns_each_call_as_it_ends():
    """The step-wise agent loop's interface: a fast call's result is there while a slow one
    still runs; a call queued behind the tool's in-flight limit starts in the slot the fast
    one freed; close() ends a queued call with an error result and leaves no child."""
    pool = ToolPool([_spec(num_workers=2, rate_limit=2, default_timeout=20)])
    try:
        slow = pool.submit(_call("import time\ntime.sleep(8)\nprint('slow')"))
        fast = pool.submit(_call("print(6 * 7)"))
        queued = pool.submit(_call("print('next')"))  # a third call: waits for a free slot
        assert fast.result(timeout=6).text.strip() == "42"
        assert queued.result(timeout=6).text.strip() == "next"
        assert not slow.done()
        hung = pool.submit(_call("import time\ntime.sleep(1000)"))
        waiting = pool.submit(_call("print('never runs')"))  # both slots taken
        deadline = time.monotonic() + 30
        while len(_running_children(settle_s=0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pool.close()
    assert not waiting.result(timeout=10).ok and "closed" in waiting.result().text
    assert not hung.result(timeout=10).ok
    assert pool.take_stats()["calls"] == 5
    assert _new_children() == []
