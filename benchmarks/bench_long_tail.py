"""Long-tail rollouts: the trainer's rollout and iteration with and without partial rollout.

    python benchmarks/bench_long_tail.py [--splits 1 2 4] [--iterations 16] [--warmup 2] \\
        [--groups 8] [--repeats 1] [--model DIR] [--max-tokens 1024] [--sigma 1.2] [--median 48]

One run, side by side: for each ``rl_config.partial_rollout_max_split`` N in ``--splits``
it launches ``torchrun --nproc_per_node 2`` on this script (``--worker``), which builds the
trainer exactly as pretrain_grpo.py does (``mindspeed_rl.trainer.launch``), runs
``--warmup`` + ``--iterations`` GRPO iterations and reports the timed ones. Every N trains
the same number of groups per iteration (``--groups`` = ``global_batch_size``, one
optimizer step, token-budget micro-batches: ``use_dynamic_bsz``), so the comparison is at
equal trained samples. The last stdout line is one JSON object::

    {"workload": {...}, "runs": {"1": {...}, "2": {...}, "4": {...}},
     "ratios_vs_1": {"2": {"rollout": ..., "iteration": ..., "decode_steps": ...}, ...}}

with, per N: ``rollout_s_per_iteration`` and ``iteration_s`` (means over the timed
iterations of ``timing/rollout`` and ``timing/all``), ``trained_tokens_per_iteration``
(the response tokens the update covered, ``actor/loss_tokens``), ``generated_tokens_per_s``
(tokens generated / rollout seconds), ``decode_occupancy`` (mean over the decode steps of
the fraction of a call's sequences still decoding: 1 when all responses of a call are
equally long), ``decode_steps_per_iteration`` (engine steps of the rollout, counted as each
call's longest new segment, on the generation-DP rank with most: what rollout time follows
where a step costs the same whatever its batch, as memory-bound decoding on an accelerator
does; on a CPU a step costs about in proportion to its sequences, so the seconds gain less)
and the response-length quantiles of the generated rows. ``cpu_steal_fraction`` is the
share of the machine's CPU time the hypervisor gave to other guests during the timed
iterations (/proc/stat): on a virtual machine it is the timing noise (the driver warns on
stderr above 5 %); compare runs whose steal is alike. ``--repeats R`` runs the Ns in turn
R times and reports each N's medians (and, per run, its seconds and steal).

The workload (say which, the issue asks): per-prompt response lengths drawn from a
lognormal (``--median``, ``--sigma``, capped at ``--max-tokens``) and enforced with
vLLM's ``ignore_eos``: the engine decodes every request to its drawn length, which then
counts as the response's end (finish reason "stop"); the n samples of a prompt share
its length. The model is the tiny random qwen2 (``mindspeed_rl.models.tiny``, made on
the fly unless ``--model``), so the rollout's cost is decoding, not the weights. Data:
arithmetic prompts (``make_arithmetic_problems``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

from json_report import stdout_reserved_for_json  # noqa: E402 - benchmarks/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "bench_long_tail.py"
STEAL_WARNING = 0.05  # cpu_steal_fraction above which a run's seconds are noise


# ---- the workload: a drawn length per prompt ---------------------------------------------
def drawn_length(prompt: tuple[int, ...], median: float, sigma: float, cap: int) -> int:
    """The prompt's response length: lognormal(log median, sigma) from a hash of its ids."""
    digest = hashlib.sha256(repr(prompt).encode()).digest()
    u1, u2 = (int.from_bytes(digest[k:k + 8], "big") / 2**64 for k in (0, 8))
    z = math.sqrt(-2 * math.log(max(u1, 1e-300))) * math.cos(2 * math.pi * u2)
    return max(1, min(cap, round(median * math.exp(sigma * z))))


class LongTail:
    """Wraps the trainer's RolloutEngine: each request decodes (``ignore_eos``) up to its
    prompt's drawn length, which then counts as its end; counts what the rollout decodes."""

    COUNTS = ("tokens", "slots", "steps")

    def __init__(self, engine, prompts, median: float, sigma: float, cap: int) -> None:
        self.engine, self.median, self.sigma, self.cap = engine, median, sigma, cap
        self.prompts = {tuple(p) for p in prompts}
        self.prompt_lengths = sorted({len(p) for p in self.prompts})
        self.tokens = self.slots = self.steps = 0  # generated tokens; sequences x steps; steps
        self.lengths: list[int] = []  # finished responses' lengths
        self._generate, self._stepwise = engine.generate, engine.generate_stepwise
        self._params = engine._params
        engine.generate, engine.generate_stepwise = self.generate, self.generate_stepwise
        engine._params = self.params

    def _split(self, request) -> tuple[int, int]:
        """(drawn length, tokens already generated) of a request (prompt + partial)."""
        for k in self.prompt_lengths:
            if tuple(request[:k]) in self.prompts:
                return drawn_length(tuple(request[:k]), self.median, self.sigma,
                                    self.cap), len(request) - k
        raise ValueError("a request that starts with no dataset prompt")

    def params(self, prompts, n, sampling, seeds, max_tokens, min_tokens):
        params = self._params(prompts, n, sampling, seeds, max_tokens, min_tokens)
        for p, request in zip(params, prompts):
            length, done = self._split(request)
            p.max_tokens = max(1, min(p.max_tokens, length - done))
            p.min_tokens = min(p.min_tokens, p.max_tokens)
            p.ignore_eos = True
        return params

    def _account(self, prompts, result):
        # one call decodes all its sequences together: max(new tokens) steps of all of them
        news = [len(c.token_ids) for group in result.completions for c in group]
        self.tokens += sum(news)
        self.slots += len(news) * max(news, default=0)
        self.steps += max(news, default=0)
        for request, group in zip(prompts, result.completions):
            length, done = self._split(request)
            for c in group:
                if done + len(c.token_ids) >= length and c.finish_reason != "abort":
                    c.finish_reason = "stop" if length < self.cap else "length"
                    self.lengths.append(done + len(c.token_ids))
        return result

    def generate(self, prompts, n, sampling, **kwargs):
        return self._account(prompts, self._generate(prompts, n, sampling, **kwargs))

    def generate_stepwise(self, prompts, sampling, **kwargs):
        return self._account(prompts, self._stepwise(prompts, sampling, **kwargs))


def cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat: user ... steal); [] where there are none."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def steal_fraction(before: list[int], after: list[int]) -> float | None:
    """The share of CPU time the hypervisor gave to other guests in between (a virtual
    machine's timing noise), or None where it is not counted."""
    if len(before) < 8 or len(after) < 8:
        return None
    spent = [b - a for a, b in zip(before, after)]
    return spent[7] / max(sum(spent), 1)


# ---- one N, under torchrun ---------------------------------------------------------------
def worker(args) -> dict | None:
    import torch.distributed as dist

    from mindspeed_rl.trainer.launch import load_job, trainer_session

    config, plan = load_job(args.config, args.overrides, algorithm="grpo")
    with trainer_session(config, plan, header=PROG) as trainer:
        prompts = [trainer.train_data[i].prompt_ids for i in range(len(trainer.train_data))]
        tail = LongTail(trainer.roles.rollout, prompts, args.median, args.sigma, args.max_tokens)
        rows = []
        for it in range(1, args.warmup + args.iterations + 1):
            if it == args.warmup + 1:
                timed_from = cpu_times()
            before = {k: getattr(tail, k) for k in LongTail.COUNTS}
            metrics = trainer.run_iteration(it)
            if it > args.warmup:
                rows.append({"rollout": metrics["timing/rollout"], "all": metrics["timing/all"],
                             "trained_tokens": metrics["actor/loss_tokens"],
                             **{k: getattr(tail, k) - before[k] for k in LongTail.COUNTS}})
        steal = steal_fraction(timed_from, cpu_times())
        lengths = [None] * dist.get_world_size()
        dist.all_gather_object(lengths, tail.lengths if trainer.ranks.is_gen_writer else [])
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, rows if trainer.ranks.is_gen_writer else [])
    if int(os.environ.get("RANK", "0")):
        return None
    lengths = sorted(x for part in lengths for x in part)
    tokens = [sum(r[k]["tokens"] for r in per_rank if r) for k in range(args.iterations)]
    slots = sum(r[k]["slots"] for r in per_rank if r for k in range(args.iterations))
    # the generation-DP ranks decode side by side: an iteration waits for the one with most
    steps = [max(r[k]["steps"] for r in per_rank if r) for k in range(args.iterations)]
    rollout = statistics.mean(r["rollout"] for r in rows)
    return {"rollout_s_per_iteration": rollout,
            "iteration_s": statistics.mean(r["all"] for r in rows),
            "trained_tokens_per_iteration": statistics.mean(r["trained_tokens"] for r in rows),
            "generated_tokens_per_s": statistics.mean(tokens) / rollout,
            "decode_occupancy": sum(tokens) / max(slots, 1),
            "decode_steps_per_iteration": statistics.mean(steps),
            "cpu_steal_fraction": steal,
            "response_length_median": statistics.median(lengths) if lengths else 0,
            "response_length_p99": lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))]
            if lengths else 0}


# ---- the driver ----------------------------------------------------------------------------
def _assets(root: str, model: str | None, max_tokens: int) -> tuple[str, str]:
    from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    train, _ = make_arithmetic_problems(400, 1, seed=0, max_operand=99, ops="+-")
    data = os.path.join(root, "train.jsonl")
    write_jsonl(train, data)
    return model or str(make_tiny_hf_dir("qwen2", os.path.join(root, "qwen2"),
                                         max_position_embeddings=max_tokens + 128)), data


def _overrides(args, model: str, data: str, split: int, log_dir: str) -> list[str]:
    return [f"megatron_training.model={model}", f"megatron_training.data_path={data}",
            f"megatron_training.log_dir={log_dir}", "actor_config.save=null",
            "megatron_training.test_data_path=null",
            f"megatron_training.global_batch_size={args.groups}",
            f"megatron_training.train_iters={args.warmup + args.iterations}",
            f"megatron_training.seq_length={args.max_tokens + 64}",
            f"rl_config.mini_batch_size={args.groups}",
            "rl_config.init_kl_coef=0", "rl_config.max_prompt_length=64",
            f"generate_config.max_model_len={args.max_tokens + 64}",
            f"generate_config.max_num_seqs={max(64, 8 * args.groups)}",
            # token-budget micro-batches of rows of similar length, as long-sequence configs
            # run: no training on padding to the longest row of the batch (packing them too,
            # use_remove_padding, takes about as long on CPU, whose attention pads a packed
            # micro-batch's rows to its longest: docs/partial_rollout.md)
            "rl_config.use_dynamic_bsz=true",
            f"rl_config.max_packing_token_size={2 * (args.max_tokens + 64)}",
            f"generate_config.sampling_config.max_tokens={args.max_tokens}",
            f"rl_config.partial_rollout_max_split={split}",
            f"rl_config.async_engine={str(args.async_engine and split > 1).lower()}",
            *args.overrides]


def driver(args) -> dict:
    root = tempfile.mkdtemp(prefix="bench_long_tail_")
    print(f"[{PROG}] the model, the data and each run's metrics (logs_N*/metrics.jsonl, "
          f"every phase's seconds per iteration) are kept in {root}", file=sys.stderr,
          flush=True)
    model, data = _assets(root, args.model, args.max_tokens)
    each: dict[str, list[dict]] = {str(split): [] for split in args.splits}
    # --repeats R: the Ns in turn, R times, so that a slow spell of the machine does not
    # fall on one N only; each N's numbers are then the medians of its R runs
    for repeat, split in ((r, s) for r in range(args.repeats) for s in args.splits):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               os.path.abspath(__file__), "--worker", "--config", args.config,
               "--iterations", str(args.iterations), "--warmup", str(args.warmup),
               "--median", str(args.median), "--sigma", str(args.sigma),
               "--max-tokens", str(args.max_tokens),
               *_overrides(args, model, data, split,
                           os.path.join(root, f"logs_{split}" + (f"_{repeat}" if repeat else "")))]
        print(f"[{PROG}] partial_rollout_max_split={split}"
              + (f" (repeat {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""),
              file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
        if proc.returncode:
            raise SystemExit(f"{PROG}: the run with partial_rollout_max_split={split} failed "
                             f"(exit {proc.returncode}); its log is above")
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        if (run["cpu_steal_fraction"] or 0) > STEAL_WARNING:
            print(f"[{PROG}] warning: the hypervisor took "
                  f"{100 * run['cpu_steal_fraction']:.0f} % of the CPU time during this run of "
                  f"N={split}; its seconds are not comparable with the other runs' (rerun, "
                  "or --repeats)", file=sys.stderr, flush=True)
        each[str(split)].append(run)
    runs = {n: _medians(r) for n, r in each.items()}
    base = runs.get("1")
    ratios = {n: {"rollout": r["rollout_s_per_iteration"] / base["rollout_s_per_iteration"],
                  "iteration": r["iteration_s"] / base["iteration_s"],
                  "decode_steps": r["decode_steps_per_iteration"]
                  / base["decode_steps_per_iteration"]}
              for n, r in runs.items() if base and n != "1"}
    lengths = runs[str(args.splits[0])]
    return {"workload": {"model": args.model or "tiny qwen2 (random)",
                         "engine": "step-wise (async_engine)" if args.async_engine
                         else "token budget per pass",
                         "lengths": f"lognormal(median {args.median}, sigma {args.sigma}) "
                                    f"per prompt, capped at {args.max_tokens}, ignore_eos",
                         "p99_over_median": lengths["response_length_p99"]
                         / max(lengths["response_length_median"], 1),
                         "global_batch_size": args.groups, "n_samples_per_prompt": 4,
                         "timed_iterations": args.iterations, "warmup": args.warmup,
                         "repeats": args.repeats},
            "runs": runs, "ratios_vs_1": ratios}


def _medians(runs: list[dict]) -> dict:
    """One N's numbers over its repeats: each the median of its runs'; with several runs
    also the seconds and CPU steal of each."""
    out = {k: statistics.median(r[k] for r in runs) if all(r[k] is not None for r in runs)
           else None for k in runs[0]}
    if len(runs) > 1:
        for k in ("rollout_s_per_iteration", "iteration_s", "cpu_steal_fraction"):
            out[f"{k}_each"] = [r[k] for r in runs]
    return out


def plot(result: dict, path: str) -> None:
    """Bars per N: rollout and iteration seconds, decode steps, decode occupancy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(result["runs"])
    runs = [result["runs"][n] for n in splits]
    fig, (ax_time, ax_steps, ax_occ) = plt.subplots(1, 3, figsize=(12, 3.4))
    x = range(len(splits))
    ax_time.bar([i - 0.2 for i in x], [r["rollout_s_per_iteration"] for r in runs], 0.4,
                label="rollout")
    ax_time.bar([i + 0.2 for i in x], [r["iteration_s"] for r in runs], 0.4, label="iteration")
    ax_time.set_ylabel("seconds per iteration")
    ax_steps.bar(list(x), [r["decode_steps_per_iteration"] for r in runs], 0.5,
                 color="tab:purple")
    ax_steps.set_ylabel("decode steps per iteration")
    ax_occ.bar(list(x), [r["decode_occupancy"] for r in runs], 0.5, color="tab:green")
    ax_occ.set_ylabel("mean decode-batch occupancy")
    ax_occ.set_ylim(0, 1)
    for ax in (ax_time, ax_steps, ax_occ):
        ax.set_xticks(list(x), [f"N={n}" for n in splits])
        ax.set_xlabel("partial_rollout_max_split")
    ax_time.legend()
    w = result["workload"]
    fig.suptitle(f"long-tail rollouts, {w.get('engine', '')}, {w['global_batch_size']} groups x "
                 f"{w['n_samples_per_prompt']} per iteration ({w['lengths']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "grpo_tiny_test.yaml"))
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the Ns in turn this many times and report each N's medians "
                        "(for a machine whose speed drifts)")
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny random qwen2)")
    p.add_argument("--groups", type=int, default=8,
                   help="prompts (groups of 4 responses) trained per iteration, for every N")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--median", type=float, default=48.0)
    p.add_argument("--sigma", type=float, default=1.2)
    p.add_argument("--async-engine", action="store_true",
                   help="N > 1 with rl_config.async_engine: true (a pass stops once enough "
                        "groups are finished) instead of the per-pass token budget")
    p.add_argument("--plot", default=None, help="also write the bars to this PNG")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_intermixed_args(argv)
    for name in ("repeats", "iterations"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: give 1 or more")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    with stdout_reserved_for_json() as emit:
        result = worker(args) if args.worker else driver(args)
        if result is not None and args.plot and not args.worker:
            plot(result, args.plot)
        if result is not None:
            emit(result)
    return 0


if __name__ == "__main__":  # vLLM spawns helpers that re-import __main__
    from mindspeed_rl.trainer.launch import exit_process

    exit_process(main())  # without the interpreter's finalization (seconds per rank)
