"""Benchmark GRPO iterations of a job config: per-phase timings, throughput and model FLOPs.

Run under torchrun, with the launcher's arguments::

    torchrun --nproc_per_node 2 benchmarks/bench_grpo.py --config configs/grpo_tiny_test.yaml \\
        [--iterations 3] [--warmup 1] [dotted.key=value ...]

Side by side with another commit (this checkout and REV alternating, ``--rounds`` each; a
speed claim on this machine is a ratio of runs made together)::

    python benchmarks/bench_grpo.py --against HEAD~3 --rounds 2 --config ... [overrides]

The trainer is built exactly as ``pretrain_grpo.py`` builds it (the shared
bootstrap ``mindspeed_rl.trainer.launch``: load_job, trainer_session), with checkpoint
saving and evaluation switched off (``actor_config.save=null``,
``megatron_training.test_data_path=null``) and ``megatron_training.train_iters``
set to warmup + iterations. ``--warmup`` iterations run first and are not
counted; then ``--iterations`` iterations run through ``trainer.run_iteration``
and rank 0 prints one JSON object as the last line of stdout (everything else
goes to stderr) with

* ``timing/<phase>``: the median seconds of every phase over the timed
  iterations (``timing/all`` is the whole iteration);
* ``e2e_tokens_per_s_per_device``: median of (prompt + response tokens of the
  iteration) / ``timing/all`` / world size;
* ``model_tflops_per_iteration`` and its split ``tflops_train``, ``tflops_ref``,
  ``tflops_old``, ``tflops_rollout`` (median over the timed iterations);
* ``achieved_gflops_per_device``: median over iterations of
  (model FLOPs of the iteration) / ``timing/all`` / world / 1e9, and
  ``achieved_gflops_per_device_by_phase`` for the four phases (each phase's
  FLOPs over its own time);
* ``matmul_peak_gflops_per_device`` (unless ``--no-matmul-peak``): an fp32
  matmul measured on every rank at the same time after the run (the median
  rank), and ``fraction_of_matmul_peak``; compare with the machine's matmul
  peak (about 130-160 GFLOPS fp32 for the 2 cores of the CI machine, i.e. about
  half of that per rank with 2 ranks);
* ``compute_floor_s``: the iteration's model FLOPs over the matmul peak of all
  ranks (the time it would take at the measured peak), next to ``timing/all``;
* ``times_compute_floor``: ``timing/all`` and each phase's timing (update, reference
  forward, old log-probs, rollout) over that phase's own FLOPs at the same peak (medians
  over the timed iterations; null without a peak or for a phase that did not run);
* ``times_trainer_floor`` and ``floors_s``: the rollout over ``perf/rollout_floor_s`` and
  each resharding over its ``perf/resharding_*_floor_s`` (its bytes at the bandwidths the
  resharder measured: ``mindspeed_rl/resharding/floor.py``), medians, and those floors;
* ``padding_efficiency`` and ``mfu_by_phase_trainer``: the trainer's
  ``perf/padding_efficiency/<phase>`` (real tokens / computed positions) and
  ``perf/mfu/<phase>`` (medians), and ``micro_batching``: each phase's micro-batch
  layout (``rl_config.use_dynamic_bsz`` / ``use_remove_padding``);
* the token counts, sample counts and layout the numbers were measured with.

FLOPs model (model FLOPs of useful work, as in MFU: padding, recomputation,
masked-out attention halves, optimizer, sampling and softmax are not counted)
--------------------------------------------------------------------------------
Notation: L layers, h hidden size, V vocabulary (unpadded), A = num_heads x
head_dim (the attention width), N = non-embedding matmul parameters *active per
token* (attention q/k/v/o incl. biases and qk-norm, gated MLP 3*h*I; for MoE the
router, top-k routed experts and a shared expert), P and R the mean prompt and
response length of the iteration (``prompt_length/mean``,
``response_length/mean``), B = global_batch_size prompts, rows = B x
n_samples_per_prompt responses.

* body forward of one token: 2 N;
* causal attention of one query that sees c keys (itself included): QK^T and
  AV, 2 c A each per layer, so 4 L A c; a sequence of S tokens costs
  4 L A S(S+1)/2 (computed with the mean lengths P and R);
* LM head: 2 h V per position that is projected onto the vocabulary. Training
  and log-prob forwards project only the response positions (the trainer's
  ``_ResponseOutputsOnly``), so R positions per row, never the prompt;
* one training / log-prob forward of a row: 2 N (P+R) + 4 L A (P+R)(P+R+1)/2 +
  2 h V R;
* ``tflops_train`` = epochs x rows x 3 x forward (backward = 2 x forward);
* ``tflops_ref`` = rows x forward when the reference model runs
  (``rl_config.init_kl_coef`` != 0), else 0;
* ``tflops_old`` = rows x forward, or 0 when the trainer is on-policy
  (one epoch, one mini-batch: the trainer runs no ``old_log_p`` phase);
* ``tflops_rollout`` = prefill once per prompt, B x (2 N P + 4 L A P(P+1)/2)
  (the n samples of a prompt share its prefill), plus decode of every generated
  token over its context, rows x (2 N R + 2 h V R + 4 L A (P R + R(R+1)/2)).

Reward, advantages and the resharding flow are not counted as FLOPs (their
time is in ``timing/all``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from json_report import stdout_reserved_for_json  # noqa: E402 - benchmarks/ is on sys.path

from mindspeed_rl.metrics.flops import active_body_parameters, matmul_gflops  # noqa: E402

PROG = "bench_grpo.py"
_EPILOG = """\
examples:
  torchrun --nproc_per_node 2 benchmarks/bench_grpo.py --config configs/grpo_tiny_test.yaml \\
      megatron_training.model=/tmp/tiny/qwen2 megatron_training.data_path=/tmp/arith/train.jsonl
  torchrun --nproc_per_node 2 benchmarks/bench_grpo.py --config configs/grpo_smollm2_demo.yaml \\
      --iterations 3

  python benchmarks/bench_grpo.py --against main --config configs/grpo_smollm2_demo.yaml \
      --iterations 3   # this checkout vs main, A B then B A; prints both and the ratio

The options below are added to the config before your overrides (yours win):
  megatron_training.log_dir=<--log-dir>
and these after them (the benchmark needs them):
  actor_config.save=null  megatron_training.test_data_path=null  megatron_training.test_interval=0
  megatron_training.train_iters=<warmup + iterations>
"""


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------
def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run GRPO iterations of a job config and print one JSON object (rank 0, last "
                    "stdout line) with median per-phase timings, throughput and model FLOPs. "
                    "Run under torchrun.")
    p.add_argument("--config", required=True, help="job YAML, e.g. configs/grpo_tiny_test.yaml")
    p.add_argument("--iterations", type=int, default=3,
                   help="timed iterations (medians over them); default 3")
    p.add_argument("--warmup", type=int, default=1,
                   help="iterations run first and not counted (vLLM and megatron warm-up); default 1")
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "bench_grpo_logs"),
                   help="megatron_training.log_dir for the run's metrics.jsonl "
                        "(default: %(default)s; an override of that key wins)")
    p.add_argument("--matmul-peak", action=argparse.BooleanOptionalAction, default=True,
                   help="after the run, measure an fp32 matmul on every rank at once to compare "
                        "achieved_gflops_per_device with (default: on)")
    p.add_argument("--against", metavar="REV",
                   help="not under torchrun: run this checkout and commit REV side by side "
                        "(a git worktree), alternating, --rounds times each, and print both "
                        "and their ratio (benchmarks/against.py)")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --against: runs of each side (default 2: A B, B A)")
    p.add_argument("--nproc", type=int, default=2,
                   help="with --against: torchrun's --nproc_per_node (default 2)")
    p.add_argument("--own-config", action="store_true",
                   help="with --against: each side reads --config from its own tree (a "
                        "tuned config against the config as it was at REV)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, e.g. rl_config.n_samples_per_prompt=8")
    args = p.parse_intermixed_args(argv)
    if args.rounds < 1 or args.nproc < 1:
        p.error(f"--rounds and --nproc must be >= 1 (got {args.rounds}, {args.nproc})")
    if args.iterations < 1:
        p.error(f"--iterations must be >= 1 (got {args.iterations})")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0 (got {args.warmup})")
    for text in args.overrides:
        if "=" not in text:
            p.error(f"argument {text!r} is not a dotted.key=value override "
                    "(write e.g. rl_config.n_samples_per_prompt=8)")
    return args


# ---------------------------------------------------------------------------------------
# FLOPs model (see the module docstring)
# ---------------------------------------------------------------------------------------
def iteration_flops(spec, *, prompt_len: float, response_len: float, num_prompts: int,
                    n_samples: int, epochs: int, with_ref: bool, with_old: bool) -> dict[str, float]:
    """Model FLOPs of one GRPO iteration by phase (``train``, ``ref``, ``old``, ``rollout``)."""
    n_body = active_body_parameters(spec)
    layers, h, vocab = spec.num_hidden_layers, spec.hidden_size, spec.vocab_size
    width = spec.attention_width
    P, R = float(prompt_len), float(response_len)
    rows = num_prompts * n_samples

    def attention(first: float, last: float) -> float:
        """Queries at positions first+1..last, each over all keys up to itself."""
        return 4 * layers * width * (last * (last + 1) - first * (first + 1)) / 2

    seq = P + R
    forward = 2 * n_body * seq + attention(0, seq) + 2 * h * vocab * R  # one row
    prefill = 2 * n_body * P + attention(0, P)  # once per prompt
    decode = 2 * n_body * R + 2 * h * vocab * R + attention(P, P + R)  # per response
    return {
        "train": epochs * rows * 3 * forward,
        "ref": rows * forward if with_ref else 0.0,
        "old": rows * forward if with_old else 0.0,
        "rollout": num_prompts * prefill + rows * decode,
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _round(x, digits=4):
    return None if x is None else round(x, digits)


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------
def run(args, config, plan) -> dict | None:
    import torch
    import torch.distributed as dist

    from mindspeed_rl.trainer.launch import trainer_session

    timed: list[dict] = []
    with trainer_session(config, plan, header=f"{PROG}: {args.config} on {plan.world_size} ranks",
                         plan_to=sys.stderr) as trainer:
        rank, world = dist.get_rank(), dist.get_world_size()
        phases = {p.name for p in trainer.phases}
        on_policy, with_ref = "old_log_p" not in phases, "reference_model" in phases
        for i in range(args.warmup + args.iterations):
            metrics = trainer.run_iteration(i + 1)
            if i >= args.warmup:
                timed.append(dict(metrics))
        peak = None
        if args.matmul_peak:
            dist.barrier()
            mine = matmul_gflops()
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            peak = statistics.median(everyone)
        threads = torch.get_num_threads()
        device = trainer.platform.device_type
    if rank != 0:
        return None
    return summarize(args, config, plan, timed, on_policy=on_policy, with_ref=with_ref,
                     world=world, matmul_peak=peak, threads=threads, device=device)


# the FLOPs model's phases (iteration_flops) and the trainer's timing of each
PHASE_TIMINGS = {"train": "timing/update", "ref": "timing/reference_model",
                 "old": "timing/old_log_p", "rollout": "timing/rollout"}


# a phase's timing and the floor the trainer logs for it
TRAINER_FLOORS = {"timing/rollout": "perf/rollout_floor_s",
                  "timing/resharding_to_infer": "perf/resharding_to_infer_floor_s",
                  "timing/resharding_to_train": "perf/resharding_to_train_floor_s"}


def summarize(args, config, plan, timed: list[dict], *, on_policy: bool, with_ref: bool,
              world: int, matmul_peak: float | None, threads: int, device: str) -> dict:
    mt, rl = config.megatron_training, config.rl_config
    spec = config.model
    prompts, n = mt.global_batch_size, rl.n_samples_per_prompt
    rows = prompts * n
    per_iter = []
    for m in timed:
        P, R = m["prompt_length/mean"], m["response_length/mean"]
        flops = iteration_flops(spec, prompt_len=P, response_len=R, num_prompts=prompts,
                                n_samples=n, epochs=rl.epochs, with_ref=with_ref,
                                with_old=not on_policy)
        total = sum(flops.values())
        t_all = m["timing/all"]
        by_phase, times_floor = {}, {}
        peak_all = matmul_peak * 1e9 * world if matmul_peak else None
        for phase, key in PHASE_TIMINGS.items():
            seconds = m.get(key)
            by_phase[phase] = (flops[phase] / seconds / world / 1e9
                               if flops[phase] and seconds else None)
            # the phase's seconds over its FLOPs at the measured peak of all ranks
            times_floor[key] = (seconds / (flops[phase] / peak_all)
                                if peak_all and flops[phase] and seconds else None)
        times_floor["timing/all"] = t_all / (total / peak_all) if peak_all else None
        per_iter.append({
            "flops": flops, "total": total, "prompt_tokens": P * rows, "response_tokens": R * rows,
            "e2e": (P + R) * rows / t_all / world,
            "gflops": total / t_all / world / 1e9, "by_phase": by_phase,
            "times_floor": times_floor,
        })
    timing_keys = sorted({k for m in timed for k in m if k.startswith("timing/")})
    out: dict = {"config": config.config_path, "iterations": args.iterations, "warmup": args.warmup}
    out.update({k: _round(_median(m.get(k) for m in timed)) for k in timing_keys})
    achieved = _median(p["gflops"] for p in per_iter)
    out.update({
        "e2e_tokens_per_s_per_device": _round(_median(p["e2e"] for p in per_iter), 3),
        "e2e_tokens_per_s_per_device_trainer_metric": _round(_median(
            m.get("throughput/e2e_tokens_per_s_per_device") for m in timed), 3),
        "rollout_tokens_per_s_per_device": _round(_median(
            m.get("throughput/rollout_tokens_per_s_per_device") for m in timed), 3),
        "model_tflops_per_iteration": _round(_median(p["total"] for p in per_iter) / 1e12, 6),
        **{f"tflops_{k}": _round(_median(p["flops"][k] for p in per_iter) / 1e12, 6)
           for k in ("train", "ref", "old", "rollout")},
        "achieved_gflops_per_device": _round(achieved, 3),
        "achieved_gflops_per_device_by_phase": {
            k: _round(_median(p["by_phase"][k] for p in per_iter), 3)
            for k in ("train", "ref", "old", "rollout")},
        "matmul_peak_gflops_per_device": _round(matmul_peak, 2),
        "fraction_of_matmul_peak": _round(achieved / matmul_peak, 4) if matmul_peak else None,
        # The iteration at the measured peak (all ranks): its model FLOPs / (peak x world),
        # next to the measured timing/all.
        "compute_floor_s": _round(_median(p["total"] for p in per_iter) / (
            matmul_peak * 1e9 * world), 3) if matmul_peak else None,
        # How many times its compute floor each phase and the iteration took (medians).
        "times_compute_floor": {k: _round(_median(p["times_floor"][k] for p in per_iter), 3)
                                for k in ("timing/all", *PHASE_TIMINGS.values())},
        # The phases that are not training compute over the floors the trainer logs: the
        # rollout's FLOPs at the peak, each resharding's bytes at the measured bandwidths.
        "times_trainer_floor": {
            timing: _round(_median(m[timing] / m[floor] for m in timed
                                   if m.get(timing) and m.get(floor)), 3)
            for timing, floor in TRAINER_FLOORS.items()},
        "floors_s": {floor: _round(_median(m.get(floor) for m in timed), 4)
                     for floor in TRAINER_FLOORS.values()},
        # The trainer's own accounting (mindspeed_rl.engine.efficiency), per phase.
        "padding_efficiency": {k.split("/", 2)[2]: _round(_median(m.get(k) for m in timed))
                               for k in sorted({k for m in timed for k in m
                                                if k.startswith("perf/padding_efficiency/")})},
        "mfu_by_phase_trainer": {k.split("/", 2)[2]: _round(_median(m.get(k) for m in timed))
                                 for k in sorted({k for m in timed for k in m
                                                  if k.startswith("perf/mfu/")})},
        "micro_batching": {phase: m.describe() for phase, m in
                           plan.batch.micro_batching.items()},
        "prompt_tokens_per_iteration": _round(_median(p["prompt_tokens"] for p in per_iter), 1),
        "response_tokens_per_iteration": _round(_median(p["response_tokens"] for p in per_iter), 1),
        "prompt_length_mean": _round(_median(m["prompt_length/mean"] for m in timed), 2),
        "response_length_mean": _round(_median(m["response_length/mean"] for m in timed), 2),
        "prompts_per_iteration": prompts,
        "responses_per_iteration": rows,
        "n_samples_per_prompt": n,
        "epochs": rl.epochs,
        "on_policy": on_policy,
        "reference_model": with_ref,
        "num_parameters": spec.num_parameters(),
        "active_body_parameters": active_body_parameters(spec),
        "model": spec.describe(),
        "world_size": world,
        "tensor_model_parallel_size": plan.layout.tensor_model_parallel_size,
        "pipeline_model_parallel_size": plan.layout.pipeline_model_parallel_size,
        "data_parallel_size": plan.layout.data_parallel_size,
        "expert_model_parallel_size": plan.layout.expert_model_parallel_size,
        "infer_tensor_parallel_size": plan.layout.infer_tensor_parallel_size,
        "device_type": device,
        "torch_threads_per_rank": threads,
        "cpu_count": os.cpu_count(),
        "per_iteration_seconds": [_round(m["timing/all"]) for m in timed],
    })
    return out


def main(argv=None) -> int:
    from mindspeed_rl.config import ConfigError
    from mindspeed_rl.trainer.launch import load_job

    args = _parse(argv)
    if args.against:
        return _side_by_side(args, sys.argv[1:] if argv is None else list(argv))
    overrides = [f"megatron_training.log_dir={args.log_dir}", *args.overrides,
                 "actor_config.save=null", "megatron_training.test_data_path=null", "megatron_training.test_interval=0",
                 f"megatron_training.train_iters={args.warmup + args.iterations}"]
    try:
        config, plan = load_job(args.config, overrides, algorithm="grpo")
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    # Keep stdout for the JSON line: the trainer's console lines, megatron's and vLLM's
    # output (C-level prints included) go to stderr.
    with stdout_reserved_for_json() as emit:
        result = run(args, config, plan)
        if result is not None:
            emit(result)
    return 0


def _side_by_side(args, argv: list[str]) -> int:
    """``--against REV``: this driver (not a rank) runs both trees' bench_grpo.py."""
    from against import side_by_side

    if "LOCAL_RANK" in os.environ:
        print(f"{PROG}: error: --against drives torchrun itself; run it with python, not "
              "under torchrun", file=sys.stderr)
        return 2
    from against import own_config_path

    own = {"--against", "--rounds", "--nproc"}
    passed, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in own:
            skip = True
        elif a.split("=", 1)[0] not in own and a != "--own-config":
            passed.append(a)
    result = side_by_side(args.against, "benchmarks/bench_grpo.py", passed,
                          rounds=args.rounds, nproc=args.nproc,
                          own_config=own_config_path(args.config) if args.own_config else None)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":  # vLLM and dist_checkpointing spawn helpers that re-import __main__
    from mindspeed_rl.trainer.launch import exit_process

    exit_process(main())  # without the interpreter's finalization (seconds per rank)
