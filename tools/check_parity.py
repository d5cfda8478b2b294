#!/usr/bin/env python
"""Logit parity of a megatron checkpoint against transformers, at a chosen TP/PP/EP layout.

Run under torchrun with world size = TP x PP x DP:

  torchrun --nproc_per_node 4 tools/check_parity.py --hf-dir HF_DIR --mg-dir MG_DIR \\
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Loads MG_DIR at that layout, runs one random token batch through it and through
transformers (fp32, eager attention) on HF_DIR, and prints `max_abs_logit_diff=<float>`
as its last line. Exit status 1 when the difference exceeds --tolerance. A checkpoint
with a scalar head (a reward model converted from *ForSequenceClassification) is
compared with AutoModelForSequenceClassification: its scores per position and at the
last non-pad token.

With --temperature T it also runs random prompt + response rows through the trainer's
own log-prob forward (the one that computes old and reference log-probs: vocabulary-
parallel, logits / T) and compares every response token's log-prob with
log_softmax(transformers logits / T): `max_abs_train_logprob_diff=<float>` (exit 1
above --tolerance).

With --rollout it also reshards the megatron weights into a vLLM engine (TP_g =
--infer-tensor-parallel-size; vLLM starts with dummy weights, so every token comes
from the resharded ones), continues a few random prompts (greedily, or sampled at
--temperature), recomputes each token's log-prob with megatron at that temperature
and prints `max_abs_logprob_diff=<float>` as the last line (exit 1 above
--logprob-tolerance).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--mg-dir", required=True)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="seed of the random token batch")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--rollout", action="store_true",
                   help="also check vLLM log-probs after resharding (allgather-swap)")
    p.add_argument("--infer-tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--logprob-tolerance", type=float, default=1e-3)
    p.add_argument("--temperature", type=float, default=None,
                   help="also check the trainer's log-probs at this sampling temperature "
                        "against log_softmax(transformers logits / T); with --rollout, vLLM "
                        "samples at it")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from mindspeed_rl.checkpoint.checkpoint_parity import check_parity
    from mindspeed_rl.errors import CheckpointError
    from mindspeed_rl.parallel.groups import init_distributed
    from mindspeed_rl.parallel.layout import LayoutError, ParallelLayout
    from mindspeed_rl.platform import setup_platform

    platform = setup_platform()
    init_distributed(platform)
    rank = dist.get_rank()
    try:
        layout = ParallelLayout(
            world_size=dist.get_world_size(),
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            infer_tensor_parallel_size=args.infer_tensor_parallel_size,
        )
        diff = check_parity(args.hf_dir, args.mg_dir, layout, seq_length=args.seq_length,
                            batch_size=args.batch_size, seed=args.seed)
        train_diff = logprob_diff = None
        if args.temperature is not None:
            from mindspeed_rl.engine.logprob_parity import check_logprob_parity

            train_diff = check_logprob_parity(args.hf_dir, args.mg_dir, layout,
                                              temperature=args.temperature, seed=args.seed)
        if args.rollout:
            from mindspeed_rl.resharding.rollout_parity import check_rollout_parity

            logprob_diff = check_rollout_parity(args.hf_dir, args.mg_dir, layout,
                                                max_tokens=args.max_new_tokens, seed=args.seed,
                                                temperature=args.temperature or 0.0)
    except (CheckpointError, LayoutError, ValueError) as exc:
        if rank == 0:
            print(f"check_parity: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():  # vLLM's engine teardown may have destroyed it already
            dist.destroy_process_group()
    ok = diff <= args.tolerance
    if rank == 0:
        print(f"layout: {layout.describe()}; tolerance {args.tolerance:g}: {'PASS' if ok else 'FAIL'}")
        print(f"max_abs_logit_diff={diff:.6e}", flush=True)
    if train_diff is not None:
        ok = ok and train_diff <= args.tolerance
        if rank == 0:
            print(f"training log-probs at temperature {args.temperature:g}: tolerance "
                  f"{args.tolerance:g}: {'PASS' if train_diff <= args.tolerance else 'FAIL'}")
            print(f"max_abs_train_logprob_diff={train_diff:.6e}", flush=True)
    if logprob_diff is not None:
        ok = ok and logprob_diff <= args.logprob_tolerance
        if rank == 0:
            print(f"rollout after resharding: logprob tolerance {args.logprob_tolerance:g}: "
                  f"{'PASS' if logprob_diff <= args.logprob_tolerance else 'FAIL'}")
            print(f"max_abs_logprob_diff={logprob_diff:.6e}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
