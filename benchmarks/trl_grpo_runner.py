"""TRL's ``GRPOTrainer`` on the comparison task of ``bench_vs_trl.py``; runs in TRL's own venv.

Never imported by the project (its venv has ``trl`` and not ``mindspeed_rl``). Prints one
JSON line: the seconds of every optimizer step (each generates the step's completions with
``model.generate``, scores them, computes the reference log-probs and takes the step).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time


def integer_answer(completions, answer, **_):
    """1 when the last integer of the completion is the answer (the project's integer_answer
    verifier reads the answer the same way for these prompts)."""
    out = []
    for completion, want in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        found = re.findall(r"-?\d+", text)
        out.append(1.0 if found and found[-1] == str(want) else 0.0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="jsonl with prompt and answer")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="TRL's output_dir (nothing is saved there)")
    args = p.parse_args()

    import torch
    import trl
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    data = load_dataset("json", data_files=args.data, split="train")
    data = data.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    step_ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            step_ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            step_ends.append(time.perf_counter())

    rows = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, learning_rate=args.lr, beta=args.beta,
        num_generations=args.samples, per_device_train_batch_size=args.samples,
        gradient_accumulation_steps=rows // args.samples,  # one optimizer step per batch
        max_completion_length=args.max_new_tokens, temperature=args.temperature,
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no",
        report_to=[], bf16=False, fp16=False, use_cpu=True, seed=1234,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=args.model, reward_funcs=integer_answer, args=config,
                          train_dataset=data, callbacks=[Clock()])
    trainer.train()
    seconds = [round(b - a, 3) for a, b in zip(step_ends, step_ends[1:])]
    print(json.dumps({"trl": trl.__version__, "torch": torch.__version__,
                      "seconds_per_step": seconds, "threads": args.threads,
                      "generation_batch_size": config.generation_batch_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
