"""What the code interpreter's sandbox costs per call (one process, plain ``python``).

Each program is run ``--calls`` times, one call at a time, through the entry point the
rollout uses (``ToolPool(load_tool_config(...)).run``, the shipped
``configs/tools/code_interpreter.yaml``), in the sandbox (``sandbox``) and with
``unsafe_no_sandbox: true`` (``no_sandbox``: the interpreter without the -S flag, since the
config allows packages, so Python's site runs and reads the virtualenv's .pth files); the
trivial program also as the unsandboxed interpreter ran it by default before
(``no_sandbox_bare``: ``site_packages`` off, ``python -I -S``). The modes alternate call by
call, so a change in the machine's load falls on all alike. Programs:

- ``trivial``: ``print(6 * 7)``;
- ``sympy``: a ReTool-style program, sympy imported and an equation solved.

One JSON line on stdout: per program and mode the median and p99 seconds per call (the
pool's wall time of the call, as ``ToolResult.seconds``), and the sandbox's added median
in milliseconds over each unsandboxed mode::

    python benchmarks/bench_tools.py --calls 40
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from json_report import stdout_reserved_for_json  # noqa: E402 - benchmarks/ is on sys.path

PROGRAMS = {
    "trivial": "print(6 * 7)",
    "sympy": ("from sympy import symbols, solve, Rational\n"
              "x = symbols('x')\n"
              "roots = solve(x ** 2 - Rational(5, 2) * x + 1, x)\n"
              "sorted(roots)"),
}


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between the nearest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def measure(config: str, calls: int, warmup: int) -> dict:
    from mindspeed_rl.agent_tools import ToolCall, ToolPool, load_tool_config

    [spec] = load_tool_config(config)
    modes = {"sandbox": dataclasses.replace(spec, unsafe_no_sandbox=False),
             "no_sandbox": dataclasses.replace(spec, unsafe_no_sandbox=True),
             "no_sandbox_bare": dataclasses.replace(spec, unsafe_no_sandbox=True,
                                                    site_packages=())}
    pools = {mode: ToolPool([s]) for mode, s in modes.items()}
    runs = {program: [m for m in modes if program == "trivial" or m != "no_sandbox_bare"]
            for program in PROGRAMS}  # sympy needs its package
    seconds = {(program, mode): [] for program in PROGRAMS for mode in runs[program]}
    try:
        for program, code in PROGRAMS.items():
            call = ToolCall(spec.name, {"code": code}, "")
            for i in range(warmup + calls):
                for mode in runs[program]:
                    pool = pools[mode]
                    [result] = pool.run([(0, call)])
                    if not result.ok:
                        raise RuntimeError(f"{program} ({mode}) failed: {result.text}")
                    if i >= warmup:
                        seconds[(program, mode)].append(result.seconds)
    finally:
        for pool in pools.values():
            pool.close()
    out = {}
    for program in PROGRAMS:
        row = {}
        for mode in runs[program]:
            values = seconds[(program, mode)]
            row[mode] = {"median_s": statistics.median(values),
                         "p99_s": percentile(values, 0.99), "calls": len(values)}
        for mode in runs[program][1:]:
            row[f"added_median_ms_vs_{mode}"] = 1000 * (row["sandbox"]["median_s"]
                                                       - row[mode]["median_s"])
        out[program] = row
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench_tools.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "configs", "tools", "code_interpreter.yaml"))
    p.add_argument("--calls", type=int, default=40, help="measured calls per program and mode")
    p.add_argument("--warmup", type=int, default=2, help="calls first run and not counted")
    args = p.parse_args(argv)
    if args.calls < 1 or args.warmup < 0:
        p.error("--calls must be at least 1 and --warmup at least 0")
    with stdout_reserved_for_json() as emit:
        result = measure(args.config, args.calls, args.warmup)
        emit({"calls_per_program_and_mode": args.calls, "cpus": os.cpu_count(),
              "load_average_1m": os.getloadavg()[0], **result})


if __name__ == "__main__":
    main()
