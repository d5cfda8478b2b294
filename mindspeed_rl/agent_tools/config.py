"""The tool YAML (MindSpeed-RL's format) read into :class:`ToolSpec` records.

MindSpeed-RL imports the class a tool entry names and hands it the raw ``config``
mapping; a typo in a key, a missing URL or a schema without a name then surfaces deep
inside a rollout, after the job has loaded its models. Here the file is checked whole
before any process group exists (``config/checks/tool_turns.py`` calls
:func:`load_tool_config` on a dry run), every problem raised as one :class:`ToolConfigError`
naming the file and the key. Nothing here imports torch or vLLM, and nothing contacts a sandbox.

``class_name`` picks the backend (``kind``):

- ``mindspeed_rl.tools.retool.ReTool`` and
  ``mindspeed_rl.tools.sandbox_fusion_tool.SandboxFusionTool``: the SandboxFusion HTTP
  service at ``config.sandbox_fusion_url`` (``kind="sandbox_fusion"``), as in MindSpeed-RL;
- ``mindspeed_rl.agent_tools.code_interpreter.CodeInterpreter``: this project's local
  interpreter in a bubblewrap sandbox with limits (``kind="code_interpreter"``), for
  machines without a SandboxFusion service; ``config.unsafe_no_sandbox: true`` runs it
  without the sandbox (an explicit opt-in: docs/tools.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

RETOOL = "mindspeed_rl.tools.retool.ReTool"
SANDBOX_FUSION_TOOL = "mindspeed_rl.tools.sandbox_fusion_tool.SandboxFusionTool"
CODE_INTERPRETER = "mindspeed_rl.agent_tools.code_interpreter.CodeInterpreter"
# this project's own class name before its package was named agent_tools: still read
_OLD_CODE_INTERPRETER = "mindspeed_rl.tools.code_interpreter.CodeInterpreter"

# class_name -> (kind, the code format it implies unless config.code_format says otherwise)
KNOWN_CLASSES = {
    RETOOL: ("sandbox_fusion", "retool"),
    SANDBOX_FUSION_TOOL: ("sandbox_fusion", "plain"),
    CODE_INTERPRETER: ("code_interpreter", "plain"),
}

# MindSpeed-RL's defaults (SandboxFusionTool.__init__) for the keys a file leaves out.
_DEFAULTS = {"num_workers": 10, "rate_limit": 10, "default_timeout": 30,
             "memory_limit_mb": 1024, "default_language": "python",
             "enable_global_rate_limit": True, "type": "native"}
_CONFIG_KEYS = set(_DEFAULTS) | {"sandbox_fusion_url", "code_format", "site_packages",
                                 "unsafe_no_sandbox"}
_ENTRY_KEYS = {"class_name", "config", "tool_schema"}
CODE_FORMATS = ("plain", "retool")


class ToolConfigError(ValueError):
    """A tool YAML that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool of the YAML, checked.

    ``schema`` is the OpenAI function schema exactly as written (it is what the model is
    shown). ``num_workers`` and ``rate_limit`` both bound the calls of this tool in flight
    on one rank (the smaller wins; ``rate_limit`` only with ``enable_global_rate_limit``).
    ``code_format`` ``"retool"`` applies ReTool's conventions to the code before it runs
    (mindspeed_rl.agent_tools.retool_code); ``site_packages`` names the packages installed next
    to the trainer's Python that the local interpreter's code may import (e.g. numpy,
    sympy, mpmath: bound read-only into its sandbox); ``unsafe_no_sandbox`` runs the local
    interpreter without its sandbox (then ``site_packages`` non-empty means all of them).
    """

    name: str
    class_name: str
    kind: str  # "code_interpreter" | "sandbox_fusion"
    schema: dict
    num_workers: int
    rate_limit: int
    default_timeout: float
    memory_limit_mb: int
    sandbox_fusion_url: str | None
    language: str
    code_format: str = "plain"
    site_packages: tuple[str, ...] = ()
    unsafe_no_sandbox: bool = False

    @property
    def max_in_flight(self) -> int:
        return min(self.num_workers, self.rate_limit)


def load_tool_config(path: str | Path) -> list[ToolSpec]:
    """The tools of the YAML at ``path``; raises :class:`ToolConfigError` on any problem."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ToolConfigError(f"{where}: no such file; point rl_config.tool_config_path at a "
                              "tool YAML such as configs/tools/code_interpreter.yaml") from None
    except OSError as e:
        raise ToolConfigError(f"{where}: cannot be read ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ToolConfigError(f"{where}: is not valid YAML ({_one_line(e)})") from None
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list) or not data["tools"]:
        raise ToolConfigError(f"{where}: tools: missing or not a non-empty list; the file needs "
                              "a top-level 'tools:' list of {class_name, config, tool_schema}")
    unknown = sorted(set(data) - {"tools"})
    if unknown:
        raise ToolConfigError(f"{where}: {unknown[0]}: unknown top-level key; only 'tools' is read")
    specs, seen = [], {}
    for i, entry in enumerate(data["tools"]):
        spec = _tool(where, f"tools[{i}]", entry)
        if spec.name in seen:
            raise ToolConfigError(
                f"{where}: tools[{i}].tool_schema.function.name: {spec.name!r} is also the name "
                f"of tools[{seen[spec.name]}]; the model calls tools by name, so names must differ")
        seen[spec.name] = i
        specs.append(spec)
    return specs


def _tool(where: str, key: str, entry) -> ToolSpec:
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: {key}: must be a mapping with class_name, config and "
                              "tool_schema")
    extra = sorted(set(entry) - _ENTRY_KEYS)
    if extra:
        raise ToolConfigError(f"{where}: {key}.{extra[0]}: unknown key; a tool has "
                              f"{sorted(_ENTRY_KEYS)}")
    class_name = entry.get("class_name")
    if class_name == _OLD_CODE_INTERPRETER:
        class_name = CODE_INTERPRETER
    if class_name not in KNOWN_CLASSES:
        raise ToolConfigError(
            f"{where}: {key}.class_name: {class_name!r} is not a tool this project runs; "
            f"known: {', '.join(KNOWN_CLASSES)}")
    kind, code_format = KNOWN_CLASSES[class_name]
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: {key}.config: must be a mapping")
    extra = sorted(set(config) - _CONFIG_KEYS)
    if extra:
        raise ToolConfigError(f"{where}: {key}.config.{extra[0]}: unknown key for {class_name}; "
                              f"known: {', '.join(sorted(_CONFIG_KEYS))}")
    get = lambda k: config[k] if config.get(k) is not None else _DEFAULTS[k]  # noqa: E731
    ck = f"{key}.config"
    if get("type") != "native":
        raise ToolConfigError(f"{where}: {ck}.type: {get('type')!r}; only 'native' (function "
                              "calling in the model's text) is supported, as in MindSpeed-RL")
    if get("default_language") != "python":
        raise ToolConfigError(f"{where}: {ck}.default_language: {get('default_language')!r}; "
                              "only 'python' is supported")
    flag = get("enable_global_rate_limit")
    _require_bool(where, f"{ck}.enable_global_rate_limit", flag)
    num_workers = _positive_int(where, f"{ck}.num_workers", get("num_workers"))
    rate_limit = _positive_int(where, f"{ck}.rate_limit", get("rate_limit"))
    code_format = config.get("code_format", code_format)
    if code_format not in CODE_FORMATS:
        raise ToolConfigError(f"{where}: {ck}.code_format: {code_format!r}; one of {CODE_FORMATS}")
    unsafe = config.get("unsafe_no_sandbox", False)
    _require_bool(where, f"{ck}.unsafe_no_sandbox", unsafe)
    site_packages = _site_packages(where, f"{ck}.site_packages",
                                   config.get("site_packages", False), unsafe)
    name, schema = _schema(where, f"{key}.tool_schema", entry.get("tool_schema"))
    return ToolSpec(
        name=name, class_name=class_name, kind=kind, schema=schema,
        num_workers=num_workers, rate_limit=rate_limit if flag else num_workers,
        default_timeout=_positive_number(where, f"{ck}.default_timeout", get("default_timeout")),
        memory_limit_mb=_positive_int(where, f"{ck}.memory_limit_mb", get("memory_limit_mb")),
        sandbox_fusion_url=_url(where, ck, config.get("sandbox_fusion_url"), class_name)
        if kind == "sandbox_fusion" else None,
        language="python", code_format=code_format, site_packages=site_packages,
        unsafe_no_sandbox=unsafe)


def _site_packages(where: str, key: str, value, unsafe: bool) -> tuple[str, ...]:
    """The packages the local interpreter's code may import: a list of top-level import
    names (false or [] = none). ``true`` (all of them) only without the sandbox: the
    sandbox shows the code only what is named."""
    if value is False or value is None:
        return ()
    if value is True:
        if unsafe:
            return ("*",)
        raise ToolConfigError(
            f"{where}: {key}: true; the sandbox binds only the packages it is told: list the "
            "top-level packages the code may import, e.g. [numpy, sympy, mpmath] (sympy needs "
            "mpmath)")
    if not isinstance(value, list) or not all(
            isinstance(v, str) and v.isidentifier() for v in value):
        raise ToolConfigError(f"{where}: {key}: {value!r}; a list of top-level package names "
                              "such as [numpy, sympy, mpmath], or false")
    return tuple(dict.fromkeys(value))


def _schema(where: str, key: str, schema) -> tuple[str, dict]:
    """The function's name and the schema; the code tools read their code from ``code``."""
    if not isinstance(schema, dict):
        raise ToolConfigError(f"{where}: {key}: missing or not a mapping; every tool needs an "
                              "OpenAI function schema (type: function, function: {name, ...})")
    if schema.get("type") != "function":
        raise ToolConfigError(f"{where}: {key}.type: {schema.get('type')!r}; must be 'function'")
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ToolConfigError(f"{where}: {key}.function: missing or not a mapping")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolConfigError(f"{where}: {key}.function.name: missing; every tool needs a name "
                              "the model calls it by")
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict) or "code" not in properties:
        raise ToolConfigError(f"{where}: {key}.function.parameters.properties: no 'code'; the "
                              "code tools run the call's argument 'code', so the schema must "
                              "offer it to the model")
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ToolConfigError(f"{where}: {key}: not expressible as JSON ({e})") from None
    return name, schema


def _url(where: str, key: str, url, class_name: str) -> str:
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ToolConfigError(
            f"{where}: {key}.sandbox_fusion_url: {url!r} is not an http(s) URL; {class_name} "
            "runs code in a SandboxFusion service (e.g. http://localhost:8080/run_code), or use "
            f"class_name {CODE_INTERPRETER} for the local interpreter")
    return url


def _positive_int(where: str, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ToolConfigError(f"{where}: {key}: {value!r}; must be a positive integer")
    return value


def _positive_number(where: str, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ToolConfigError(f"{where}: {key}: {value!r}; must be a positive number of seconds")
    return float(value)


def _require_bool(where: str, key: str, value) -> None:
    if not isinstance(value, bool):
        raise ToolConfigError(f"{where}: {key}: {value!r}; must be true or false")


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def tool_system_prompt(specs: list[ToolSpec]) -> str:
    """The tools block of the system message, as Qwen2.5's chat template writes it (hermes).

    Each schema on its own line as the template's ``tojson`` writes it (json.dumps,
    ensure_ascii off). The template puts this after the system message and a blank line.
    """
    lines = "\n".join(json.dumps(spec.schema, ensure_ascii=False) for spec in specs)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
