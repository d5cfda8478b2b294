"""Split a torch-profiler trace of ``profiler_config`` by phase into where the time went.

    python tools/trace_phases.py LOG_DIR/profiler_data/integrated/rank0_iter2.pt.trace.json \\
        [--top 6] [--json]

For every ``phase/<name>`` range the recorder put in the trace (``mindspeed_rl/metrics/
profiler.py``), the host thread's operator time is split by each operator's *self* time
(its duration less the operators it called):

- ``matmul``: the GEMMs (``mm``, ``addmm``, ``bmm``, ``linear``, oneDNN/vLLM GEMM kernels),
  the model compute a FLOPs count describes;
- ``copy/cast``: copies, casts, layout changes, concatenation (``copy_``, ``to``, ``cat``...);
- ``allocation``: ``empty``, ``zeros``, ``full``, ``resize_``...;
- ``communication``: collectives and their waits (``c10d::``, ``gloo``, ``nccl``, ``record_param_comms``);
- ``other operators``: the rest (element-wise, norms, softmax, sampling: memory-bound work
  on a CPU);
- ``between operators``: the phase's wall time not inside any operator (Python, the
  framework's bookkeeping, waits outside collectives).

The operators counted are those of the thread that entered the phase (the trainer's; a
rank runs one). Accelerator kernels (CUDA) are summed separately when present.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

CATEGORIES = (
    ("matmul", re.compile(r"aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)$|"
                          r"gemm|onednn|mkldnn_linear|cpu_linear|_C::.*gemm", re.I)),
    ("communication", re.compile(r"c10d::|gloo|nccl|record_param_comms|all_reduce|all_gather|"
                                 r"broadcast|reduce_scatter|barrier|send|recv", re.I)),
    ("copy/cast", re.compile(r"aten::(copy_|_to_copy|to|contiguous|clone|cat|stack|index_copy_|"
                             r"_copy_from|narrow_copy|split_with_sizes_copy)$", re.I)),
    ("allocation", re.compile(r"aten::(empty|empty_like|empty_strided|zeros|zeros_like|ones|"
                              r"ones_like|full|full_like|new_empty|new_zeros|resize_)$", re.I)),
)


def category(name: str) -> str:
    return next((c for c, pattern in CATEGORIES if pattern.search(name)), "other operators")


def _self_times(events: list[dict]) -> tuple[list[tuple[dict, float]], float]:
    """(event, self time in us) of the nested complete events of one thread, and the time
    inside any of them (the outermost ones' durations)."""
    out, stack, outer = [], [], 0.0  # stack of [event, end, children's time]
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and e["ts"] >= stack[-1][1]:
            done = stack.pop()
            out.append((done[0], done[0]["dur"] - done[2]))
        if stack:
            stack[-1][2] += e["dur"]
        else:
            outer += e["dur"]
        stack.append([e, e["ts"] + e["dur"], 0.0])
    out += [(done[0], done[0]["dur"] - done[2]) for done in stack]
    return out, outer


def split(trace: dict) -> dict[str, dict]:
    """Per phase: wall ms and ms per category, the top operators by self time, kernels."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    phases = [e for e in events if e.get("name", "").startswith("phase/")]
    result: dict[str, dict] = {}
    for p in sorted(phases, key=lambda e: e["ts"]):
        start, end = p["ts"], p["ts"] + p["dur"]
        inside = [e for e in events if start <= e["ts"] and e["ts"] + e["dur"] <= end]
        host = [e for e in inside if e.get("cat") == "cpu_op" and e.get("tid") == p.get("tid")]
        kernels = [e for e in inside if e.get("cat") == "kernel"]
        entry = result.setdefault(p["name"].removeprefix("phase/"), {
            "wall_ms": 0.0, "ms": collections.Counter(), "top": collections.Counter(),
            "kernel_ms": 0.0})
        entry["wall_ms"] += p["dur"] / 1e3
        selves, outer = _self_times(host)
        for event, self_us in selves:
            entry["ms"][category(event["name"])] += self_us / 1e3
            entry["top"][event["name"]] += self_us / 1e3
        entry["ms"]["between operators"] += (p["dur"] - outer) / 1e3
        entry["kernel_ms"] += sum(e["dur"] for e in kernels) / 1e3
    return result


def report(result: dict[str, dict], top: int) -> str:
    lines = []
    for phase, entry in result.items():
        wall = entry["wall_ms"]
        lines.append(f"{phase}: {wall / 1e3:.2f} s" + (f" (accelerator kernels "
                     f"{entry['kernel_ms'] / 1e3:.2f} s)" if entry["kernel_ms"] else ""))
        for name, ms in entry["ms"].most_common():
            lines.append(f"  {name:<18} {ms / 1e3:7.2f} s  {100 * ms / wall:5.1f} %")
        lines.append("  top operators (self): " + ", ".join(
            f"{n} {ms / 1e3:.2f} s" for n, ms in entry["top"].most_common(top)))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a .pt.trace.json that profiler_config wrote")
    p.add_argument("--top", type=int, default=6, help="operators listed per phase")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    try:
        with open(args.trace) as f:
            trace = json.load(f)
    except (OSError, ValueError) as error:
        print(f"trace_phases: error: {args.trace}: {error}", file=sys.stderr)
        return 2
    result = split(trace)
    if not result:
        print(f"trace_phases: error: {args.trace} has no phase/<name> ranges (was it written "
              "by profiler_config?)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: {"wall_s": round(v["wall_ms"] / 1e3, 4),
                              "seconds": {c: round(ms / 1e3, 4) for c, ms in v["ms"].items()},
                              "top": {n: round(ms / 1e3, 4)
                                      for n, ms in v["top"].most_common(args.top)},
                              "kernel_s": round(v["kernel_ms"] / 1e3, 4)}
                          for k, v in result.items()}))
    else:
        print(report(result, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
