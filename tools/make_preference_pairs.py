#!/usr/bin/env python
"""Make DPO preference pairs from a model's own samples, scored by the verifiers.

For each prompt of a prompt file (the GRPO format: prompt + answer), vLLM samples
``--samples`` responses; the verifiers score them (``--verifiers``, the names
``rl_config.verifier_function`` takes); a prompt with a correct response (score of the
first verifier 1) and a wrong one (0) gives one pair: the first correct as ``chosen``,
the first wrong as ``rejected``. Prompts whose samples all agree give none. Output: a
jsonl of ``{"prompt", "chosen", "rejected", "answer"}`` rows that pretrain_dpo.py reads
(``is_pairwise_dataset: true``), written whole or not at all.

  python tools/make_preference_pairs.py --model cache/smollm2_135m_instruct_hf \\
      --data cache/arithmetic/train.jsonl --out cache/dpo_pairs/train.jsonl --samples 8
  # two ranks, each sampling half the prompts (one vLLM engine per rank)
  torchrun --nproc_per_node 2 tools/make_preference_pairs.py ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys


_CHUNK = 32  # prompts per generate call (the progress bar's step)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", required=True, help="HF model directory (weights + tokenizer)")
    p.add_argument("--data", required=True, help="prompt file: .jsonl/.json/.parquet with "
                                                 "prompt and answer columns")
    p.add_argument("--out", required=True, help="output .jsonl of pairs")
    p.add_argument("--samples", type=int, default=8, help="responses sampled per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=48, help="response tokens at most")
    p.add_argument("--max-prompt-length", type=int, default=96)
    p.add_argument("--max-prompts", type=int, default=None, help="the first N prompts only")
    p.add_argument("--verifiers", default="integer_answer",
                   help="comma-separated verifier names; the first decides correct (1) / "
                        "wrong (0)")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--answer-key", default="answer")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def pairs_of(prompts, completions, scores, tokenizer) -> list[dict]:
    """One pair per prompt with a correct and a wrong sample (``scores``: per prompt, the
    first verifier's score of each sample)."""
    rows = []
    for item, group, score in zip(prompts, completions, scores):
        right = [c for c, s in zip(group, score) if s >= 1.0]
        wrong = [c for c, s in zip(group, score) if s <= 0.0]
        if not right or not wrong:
            continue
        text = [tokenizer.decode(c.token_ids, skip_special_tokens=True).strip()
                for c in (right[0], wrong[0])]
        if not text[0] or not text[1] or text[0] == text[1]:
            continue
        rows.append({"prompt": item.raw_prompt, "chosen": text[0], "rejected": text[1],
                     "answer": item.answer})
    return rows


def _sample(args, rank: int, world: int):
    """This rank's share of the prompts, sampled and scored: (its pairs, the engine)."""
    from transformers import AutoTokenizer

    from mindspeed_rl.config.schema import SamplingConfig
    from mindspeed_rl.data import load_prompt_dataset
    from mindspeed_rl.metrics import rank0_progress
    from mindspeed_rl.rewards import compute_rewards
    from mindspeed_rl.rollout import RolloutEngine

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_prompt_dataset(args.data, tokenizer, args.max_prompt_length,
                               prompt_key=args.prompt_key, answer_key=args.answer_key,
                               shuffle=False, data_path_key="--data")
    items = list(data)[: args.max_prompts or len(data)][rank::world]
    raw = _raw_prompts(args)
    engine = RolloutEngine(args.model, max_num_seqs=64,
                           max_model_len=args.max_prompt_length + args.max_tokens,
                           gpu_memory_utilization=0.05, seed=args.seed)
    sampling = SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
    completions = []  # per prompt, its samples; in chunks, for the progress bar
    with rank0_progress(total=len(items) * world, desc="sampling", unit="prompt",
                        rank=rank) as bar:
        for start in range(0, len(items), _CHUNK):
            chunk = items[start:start + _CHUNK]
            completions += engine.generate([i.prompt_ids for i in chunk], args.samples,
                                           sampling,
                                           seeds=[args.seed + i.source_row for i in chunk]
                                           ).completions
            bar.update(len(chunk) * world)
    names = args.verifiers.split(",")
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True)
             for group in completions for c in group]
    answers = [i.answer for i in items for _ in range(args.samples)]
    _, per_verifier = compute_rewards(texts, answers, names, [1.0] * len(names))
    first = per_verifier[names[0]].view(len(items), args.samples).tolist()
    prompts = [_Prompt(raw[i.source_row], i.answer) for i in items]
    return pairs_of(prompts, completions, first, tokenizer), engine


class _Prompt:
    def __init__(self, raw_prompt: str, answer: str) -> None:
        self.raw_prompt, self.answer = raw_prompt, answer


def _raw_prompts(args) -> list[str]:
    """The prompt file's own prompt texts, by row (the pairs keep them untemplated)."""
    from mindspeed_rl.data.prompts import read_prompt_rows

    return [str(r.prompt) for r in read_prompt_rows(args.data, args.prompt_key,
                                                     args.answer_key, data_path_key="--data")]


def main(argv=None) -> int:
    args = parse_args(argv)
    from mindspeed_rl.metrics.console import quiet_known_noise

    quiet_known_noise()  # before vLLM is imported
    import torch.distributed as dist

    from mindspeed_rl.parallel.groups import init_distributed
    from mindspeed_rl.platform import setup_platform

    init_distributed(setup_platform())
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mine, engine = _sample(args, rank, world)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    engine.shutdown()  # after the last collective: vLLM's shutdown ends the process group
    if rank == 0:
        rows = [row for part in gathered for row in part]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(args.out + ".tmp", args.out)  # no half-written file under the final name
        print(f"wrote {len(rows)} pairs to {args.out} (from {args.max_prompts or 'all'} "
              f"prompts x {args.samples} samples)")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
