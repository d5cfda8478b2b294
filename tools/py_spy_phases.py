"""Split a py-spy profile of a training run by trainer phase (docs/performance.md).

    py-spy record --subprocesses -r 25 -f raw -o prof.raw -- \\
        python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/bench_grpo.py --config configs/grpo_smollm2_demo.yaml --iterations 3
    python tools/py_spy_phases.py prof.raw [--top 8] [--json]

A sample belongs to the phase whose function in ``mindspeed_rl/trainer/phases.py`` (or
``trainer/preference.py``) is on its stack (``other``: start-up, evaluation, anything
outside a phase). For each phase it prints its share of the samples, the innermost frames
(where the time is spent: a megatron layer's matmul, vLLM's oneDNN GEMM, a copy; an
op's or a module's ``__call__`` is skipped for the frame that called it) and the
innermost frame of this project's own code above them (which part of ours asked for it).
py-spy samples running threads only (no ``--idle``): a phase's waits are its wall time
(``timing/<phase>``) less what its samples show.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

PHASE_FILES = ("mindspeed_rl/trainer/phases.py", "mindspeed_rl/trainer/preference.py")
_LINE = re.compile(r":\d+\)")
# frames that only dispatch to the one below (an op's __call__, a module's __call__)
_DISPATCH = ("(torch/_ops.py)", "(torch/nn/modules/module.py)", "<lambda> (")


def _frame(text: str) -> tuple[str, str]:
    """(function, 'function (file)') of one py-spy frame, line numbers dropped."""
    text = _LINE.sub(")", text.strip())
    return text.split(" (")[0], text


def split_by_phase(lines) -> dict[str, dict]:
    """Per phase: samples, innermost frames and innermost project frames (Counters)."""
    phases: dict[str, dict] = {}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_frame(f) for f in stack.split(";")]
        phase = next((fn for fn, full in frames if any(p in full for p in PHASE_FILES)
                      and not fn.startswith("_")), "other")
        entry = phases.setdefault(phase, {"samples": 0, "leaf": collections.Counter(),
                                          "ours": collections.Counter()})
        entry["samples"] += int(count)
        leaf = next((full for _, full in reversed(frames)
                     if not any(d in full for d in _DISPATCH)), frames[-1][1])
        entry["leaf"][leaf] += int(count)
        ours = next((full for _, full in reversed(frames) if "mindspeed_rl/" in full), None)
        if ours is not None:
            entry["ours"][ours] += int(count)
    return phases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy record -f raw output")
    p.add_argument("--top", type=int, default=8, help="frames listed per phase")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    try:
        with open(args.raw, encoding="utf-8") as f:
            phases = split_by_phase(f)
    except OSError as e:
        print(f"py_spy_phases: {args.raw}: {e.strerror}", file=sys.stderr)
        return 2
    if not phases:
        print(f"py_spy_phases: {args.raw}: no samples (is it py-spy's -f raw output?)",
              file=sys.stderr)
        return 2
    total = sum(e["samples"] for e in phases.values())
    ordered = sorted(phases.items(), key=lambda kv: -kv[1]["samples"])
    if args.json:
        print(json.dumps({name: {"share": round(e["samples"] / total, 4),
                                 "leaf": dict(e["leaf"].most_common(args.top)),
                                 "ours": dict(e["ours"].most_common(args.top))}
                          for name, e in ordered}))
        return 0
    for name, e in ordered:
        print(f"== {name}: {e['samples']} samples ({100 * e['samples'] / total:.1f} %)")
        for frame, n in e["leaf"].most_common(args.top):
            print(f"  {100 * n / e['samples']:5.1f} %  {frame}")
        print("  -- our innermost frame:")
        for frame, n in e["ours"].most_common(min(args.top, 5)):
            print(f"  {100 * n / e['samples']:5.1f} %  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
