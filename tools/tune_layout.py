"""Choose the training layout by measurement: time every TP x PP x DP that fits, ranked.

    python tools/tune_layout.py --config configs/grpo_smollm2_demo.yaml --world-size 2 \\
        [--budgets 512,1024] [--rounds 2] [--shift 2] [--memory-gib 8] [dotted.key=value ...]

1. Candidates: every tensor x pipeline x data-parallel split of ``--world-size`` ranks
   (context parallel 1, the config's expert parallel) that the dry run accepts for this
   model (heads divisible by TP, layers by PP, batches by DP, ...) and whose per-rank
   memory plan fits ``--memory-gib`` (default: this machine's memory over the ranks, or
   the accelerator's); the others are listed with the reason. With pipeline stages, also
   the splits that move 1 .. ``--shift`` layers off the last stage (``num_layer_list``):
   the last stage alone runs the vocabulary projection and the log-softmax, so an even
   split leaves the other stages waiting for it.
2. Timing: ``benchmarks/bench_micro_batches.py`` at each layout, under torchrun: one training
   step's rows of the config (real prompts, ragged responses) through the update and the
   reference forward, each packed micro-batch budget of ``--budgets`` in turns. Layouts run
   round by round in rotated order (A B C, B C A, ...), because this machine's speed drifts
   by more than the differences looked for.
3. The result, ranked by the median update + forward seconds (the phases whose speed the
   layout sets; the rollout's layout is vLLM's, ``generate_config``), as a table on stderr
   and one JSON object on stdout. Put the winner's two keys (and budget) in the config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from json_report import run_for_json  # noqa: E402
from mindspeed_rl.config import ConfigError, load_config, make_plan  # noqa: E402

GIB = 1024 ** 3


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_overrides(tp: int, pp: int, sequence_parallel: bool) -> list[str]:
    return [f"actor_config.tensor_model_parallel_size={tp}",
            f"actor_config.pipeline_model_parallel_size={pp}",
            "actor_config.context_parallel_size=1",
            f"megatron_training.sequence_parallel={str(sequence_parallel and tp > 1).lower()}"]


def stage_splits(num_layers: int, pp: int, shift: int) -> list[str | None]:
    """``num_layer_list`` values to try at ``pp`` stages: None (the even split) when the
    layers divide, then the near-even split with 1 .. ``shift`` layers moved off the last
    stage, one each onto the stages from the first on."""
    if pp == 1:
        return [None]
    base = [num_layers // pp + (1 if i < num_layers % pp else 0) for i in range(pp)]
    out: list[str | None] = [None] if num_layers % pp == 0 else [",".join(map(str, base))]
    for moved in range(1, shift + 1):
        counts = list(base)
        counts[-1] -= moved
        for i in range(moved):
            counts[i % (pp - 1)] += 1
        if counts[-1] >= 1:
            out.append(",".join(map(str, counts)))
    return out


def candidates(config_path: str, overrides: list[str], world: int, limit_bytes: float,
               shift: int = 0):
    """[(name, overrides, plan or None, why not)] for every TP x PP split of ``world`` (and,
    with pipeline stages, every split of the layers of ``stage_splits``)."""
    # each candidate sets its own num_layer_list (the config's may not fit another split)
    base = load_config(config_path, [*overrides, "actor_config.num_layer_list=null"],
                       check_data=False)
    sp = base.megatron_training.sequence_parallel
    out = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for layers in stage_splits(base.model.num_hidden_layers, pp, shift):
                out.append(_candidate(config_path, overrides, world, limit_bytes, tp, pp, sp,
                                      layers))
    return out


def _candidate(config_path, overrides, world, limit_bytes, tp, pp, sp, layers):
    """(name, overrides, plan or None, why not) of one layout."""
    name = f"TP{tp} PP{pp} DP{world // (tp * pp)}" + (f" [{layers}]" if layers else "")
    layout = [*layout_overrides(tp, pp, sp),
              f"actor_config.num_layer_list={layers if layers else 'null'}"]
    try:
        plan = make_plan(load_config(config_path, [*overrides, *layout], check_data=False),
                         world)
    except ConfigError as error:
        return name, layout, None, str(error).splitlines()[0]
    need = max(plan.phase_bytes["training_phase"], plan.phase_bytes["generation_phase"])
    why = (f"needs {need / GIB:.1f} GiB per rank, over --memory-gib {limit_bytes / GIB:.1f}"
           if need > limit_bytes else "")
    return name, layout, plan, why


def default_memory_bytes(world: int) -> float:
    """The accelerator's memory, else this machine's memory shared by the ranks."""
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world


def time_layout(config: str, overrides: list[str], world: int, budgets: str,
                log: Path) -> dict:
    """One bench_micro_batches.py run at a layout: its JSON."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(world), str(ROOT / "benchmarks" / "bench_micro_batches.py"), "--config", config,
           "--variants", budgets, "--repeats", "1", *overrides]
    return run_for_json(cmd, log, what=f"tune_layout: the run at {' '.join(overrides)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--budgets", default="512,1024",
                   help="packed micro-batch token budgets to try at each layout (default "
                        "%(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="timings of each layout (default 2)")
    p.add_argument("--memory-gib", type=float, help="memory per rank the plan must fit")
    p.add_argument("--shift", type=int, default=2,
                   help="with pipeline stages, also try moving 1 .. N layers off the last "
                        "stage (default %(default)s)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_intermixed_args(argv)
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if not budgets or not all(b.isdigit() for b in budgets) or args.rounds < 1 or args.shift < 0:
        p.error("--budgets must be token counts like 512,1024, --rounds >= 1, --shift >= 0")
    variants = ",".join(f"packed:{b}" for b in budgets)
    limit = args.memory_gib * GIB if args.memory_gib else default_memory_bytes(args.world_size)
    try:
        found = candidates(args.config, args.overrides, args.world_size, limit, args.shift)
    except ConfigError as error:
        print(f"tune_layout: error: {error}", file=sys.stderr)
        return 2
    runnable = [(name, layout) for name, layout, plan, why in found if plan and not why]
    for name, _, plan, why in found:
        if plan is None or why:
            print(f"[tune_layout] {name}: skipped: {why}", file=sys.stderr)
    if not runnable:
        print("tune_layout: error: no layout of this world size fits (reasons above)",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="tune_layout_"))
    times: dict[str, dict[str, list[float]]] = {name: {} for name, _ in runnable}
    for r in range(args.rounds):
        k = r % len(runnable)
        for name, layout in runnable[k:] + runnable[:k]:
            print(f"[tune_layout] round {r + 1}/{args.rounds}: {name}", file=sys.stderr,
                  flush=True)
            result = time_layout(args.config, [*args.overrides, *layout], args.world_size,
                                 variants, work / f"{name.replace(' ', '_')}_{r}.log")
            for variant, v in result["variants"].items():
                times[name].setdefault(variant, []).append(v["update_s"][0] + v["forward_s"][0])
    ranked = sorted(((statistics.median(s), name, variant) for name, by in times.items()
                     for variant, s in by.items()))
    best = ranked[0][0]
    for seconds, name, variant in ranked:
        print(f"[tune_layout] {name:<14} {variant:<12} {seconds:7.2f} s  "
              f"({seconds / best:.2f}x the fastest)", file=sys.stderr)
    winner = next(layout for name, layout in runnable if name == ranked[0][1])
    print(json.dumps({
        "world_size": args.world_size, "rounds": args.rounds, "budgets": budgets,
        "ranked": [{"layout": name, "micro_batches": variant,
                    "update_plus_forward_s": round(s, 3),
                    "runs": [round(t, 3) for t in times[name][variant]]}
                   for s, name, variant in ranked],
        "skipped": {name: why for name, _, plan, why in found if plan is None or why},
        "winner_overrides": [*winner, "rl_config.use_remove_padding=true",
                             "rl_config.use_dynamic_bsz=true",
                             f"rl_config.max_packing_token_size={ranked[0][2].split(':')[1]}"],
        "logs": str(work)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
