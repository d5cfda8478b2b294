"""Whether the local interpreter can run here, asked before any process group exists.

The config checks call :func:`local_interpreter_problem` for every local interpreter of a
run's tool YAML: the sandbox is built and one call runs in it with the tool's memory limit,
importing every allowed package. Where it cannot run, the run is refused with the three
ways on (install bubblewrap, a SandboxFusion service, or ``unsafe_no_sandbox: true``).
"""

from __future__ import annotations

from mindspeed_rl.agent_tools.code_interpreter import CodeInterpreter
from mindspeed_rl.agent_tools.sandbox import SandboxUnavailable, warn_unsandboxed

_PROBED: dict[tuple, str | None] = {}


def sandbox_problem(site_packages=(), memory_limit_mb: int = 1024,
                    timeout_s: float = 60.0) -> str | None:
    """Why the sandbox cannot run a call here (None: it can): it is built and one call runs
    in it with the tool's memory limit, importing every allowed package. Cached per
    process."""
    key = (tuple(site_packages), memory_limit_mb)
    if key not in _PROBED:
        try:
            interpreter = CodeInterpreter(timeout_s, memory_limit_mb,
                                          site_packages=site_packages)
        except SandboxUnavailable as e:
            _PROBED[key] = str(e)
        else:
            imports = "".join(f"import {name}\n" for name in site_packages)
            result = interpreter.run(imports + "print('sandbox ok')")
            _PROBED[key] = None if result.ok and result.text == "sandbox ok\n" else \
                " ".join(result.text.split())[:500]
    return _PROBED[key]



def local_interpreter_problem(spec, where: str) -> str | None:
    """Why the local interpreter of ``spec`` (a tool of the YAML at ``where``) cannot run
    here, and the three ways on; None when it can (after the unsandboxed warning for a
    tool that opted out of the sandbox)."""
    if spec.unsafe_no_sandbox:
        warn_unsandboxed(spec.name)
        return None
    problem = sandbox_problem(spec.site_packages, spec.memory_limit_mb)
    if problem is None:
        return None
    return (f"tool {spec.name!r} ({spec.class_name}) of {where} runs the model's code in a "
            f"bubblewrap sandbox, which cannot run here: {problem}. Either install bubblewrap "
            "(apt-get install bubblewrap; the kernel must allow unprivileged user namespaces: "
            "docs/tools.md), or point the tool at a SandboxFusion service (class_name "
            "mindspeed_rl.tools.retool.ReTool with sandbox_fusion_url, as "
            "configs/tools/retool_config.yaml), or run it without isolation by setting "
            f"unsafe_no_sandbox: true in its config in {where}")
