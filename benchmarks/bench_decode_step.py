"""What one decode step of the rollout engine costs, by batch size and context length.

    python benchmarks/bench_decode_step.py [--batch-sizes 1 8 32 64 128] [--contexts 32 512] \\
        [--steps 64] [--repeats 3] [--model DIR]

Partial rollout (docs/partial_rollout.md) removes decode steps: the tail of long responses
that an iteration otherwise waits for, decoded at a low batch. It saves time in proportion
to the steps only where a step costs about the same whatever its batch, as memory-bound
decoding on an accelerator does; where a step's cost grows with the sequences it carries,
the tokens cost the same however they are batched and the gain is smaller. This benchmark
measures which case a machine is in, with the same engine the trainer generates with
(``mindspeed_rl.rollout.RolloutEngine``, vLLM, one process).

For every batch size B and context length C it times ``generate`` of B prompts of C tokens
for ``--steps`` + 1 new tokens and for 1 token (``ignore_eos``, temperature 1, one seed per
prompt as the trainer samples), so that the difference is ``--steps`` decode steps with the
prefill taken out. The last stdout line is one JSON object::

    {"ms_per_step": {"32": {"1": ..., "8": ..., ...}, "512": {...}},   # context -> B -> ms
     "fit": {"32": {"ms_per_step": a, "us_per_sequence": b, "batch_independent_share": s}},
     "device": "cpu", ...}

``fit`` is the least-squares line ms(B) = a + b * B / 1000 per context, and
``batch_independent_share`` is a / ms at the largest batch: near 1, a step costs the same
whatever its batch and partial rollout's time gain follows its decode-step ratio (which
``bench_long_tail.py`` reports); near 0, the time gain is small.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

from json_report import stdout_reserved_for_json  # noqa: E402 - benchmarks/ is on sys.path

PROG = "bench_decode_step.py"


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs (slope 0 for a single x)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx, slope


def run(args) -> dict:
    from mindspeed_rl.parallel.groups import init_distributed
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.rollout import RolloutEngine

    platform = setup_platform()
    init_distributed(platform)
    with tempfile.TemporaryDirectory(prefix="bench_decode_step_") as root:
        model = args.model or _tiny_model(root, max(args.contexts) + args.steps + 16)
        engine = RolloutEngine(model, max_model_len=max(args.contexts) + args.steps + 8,
                               max_num_seqs=max(args.batch_sizes),
                               gpu_memory_utilization=args.gpu_memory_utilization
                               or (0.05 if platform.device_type == "cpu" else 0.3),
                               device_type=platform.device_type)
        try:
            seconds = _time_steps(engine, args)
        finally:
            engine.shutdown()
    ms = {str(c): {str(b): 1000 * statistics.median(seconds[c, b]) for b in args.batch_sizes}
          for c in args.contexts}
    fit = {}
    for c in args.contexts:
        a, slope = fit_line([float(b) for b in args.batch_sizes],
                            [ms[str(c)][str(b)] for b in args.batch_sizes])
        fit[str(c)] = {"ms_per_step": a, "us_per_sequence": 1000 * slope,
                       "batch_independent_share": a / ms[str(c)][str(max(args.batch_sizes))]}
    return {"ms_per_step": ms, "fit": fit, "device": platform.device_type,
            "model": args.model or "tiny qwen2 (random)", "steps": args.steps,
            "repeats": args.repeats}


def _time_steps(engine, args) -> dict[tuple[int, int], list[float]]:
    """Seconds per decode step of each (context, batch) case, one value per round."""
    import random

    from tqdm import tqdm

    from mindspeed_rl.config.schema import SamplingConfig

    _params = engine._params

    def params(*a):  # every prompt decodes to its budget: the steps are the ones timed
        out = _params(*a)
        for p in out:
            p.ignore_eos = True
        return out

    engine._params = params
    rng = random.Random(0)
    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    seconds: dict[tuple[int, int], list[float]] = {}
    cases = [(c, b) for c in args.contexts for b in args.batch_sizes]
    # round 0 warms the engine up (its first calls compile and allocate) and is not kept
    for repeat in tqdm(range(1 + args.repeats), desc="rounds", file=sys.stderr):
        for context, batch in cases:
            prompts = [[rng.randrange(1, vocab) for _ in range(context)] for _ in range(batch)]
            spent = []
            for steps in (1, args.steps + 1):
                start = time.perf_counter()
                engine.generate(prompts, 1, SamplingConfig(temperature=1.0, max_tokens=steps),
                                seeds=list(range(batch)))
                spent.append(time.perf_counter() - start)
            if repeat:
                seconds.setdefault((context, batch), []).append(
                    (spent[1] - spent[0]) / args.steps)
    return seconds


def _tiny_model(root: str, max_positions: int) -> str:
    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    return str(make_tiny_hf_dir("qwen2", os.path.join(root, "qwen2"),
                                max_position_embeddings=max_positions))


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 512],
                   help="prompt lengths (tokens) the decode steps attend over")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per case")
    p.add_argument("--repeats", type=int, default=3, help="each case's median over this many")
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny random qwen2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    args = p.parse_args(argv)
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: give 1 or more")
    for name in ("batch_sizes", "contexts"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')}: every value must be 1 or more")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    with stdout_reserved_for_json() as emit:
        emit(run(args))
    return 0


if __name__ == "__main__":  # vLLM spawns helpers that re-import __main__
    sys.exit(main())
