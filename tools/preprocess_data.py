#!/usr/bin/env python
"""Tokenize a prompt dataset (GRPO/PPO) or a preference-pair dataset (DPO) once and write a
file the trainer reads directly.

Two output formats: `--output FILE.parquet`, or `--output-prefix P` for MindSpeed-RL's
packed Megatron indexed dataset (P_packed_{input_ids,attention_mask,labels}_document.{bin,idx},
written with megatron-core's IndexedDatasetBuilder; labels = the answer's token ids), which
MindSpeed-RL configs name as `data_path: P`.

The parquet output has a `prompt_ids` column (chat template applied, prompts longer than
--max-prompt-length dropped), `prompt_text` (the rendered prompt) and the answer
column under --answer-key. Point megatron_training.data_path at it: the trainer
sees the `prompt_ids` column and skips tokenization. The tokenizer, length limit
and drop count are stored in the parquet metadata (keys mindspeed_rl.*).

Preference pairs: `--handler-name AlpacaStylePairwiseHandler` (MindSpeed-RL's name; the
default, R1AlpacaStyleInstructionHandler, is the prompt handler above) reads MindSpeed-RL's
alpaca pairwise layout (columns instruction/input/chosen/rejected, renamed with --map-keys
as their preprocessing yaml's map_keys; see mindspeed_rl/data/pairwise.py) and writes
`--output-prefix P` as P_packed_{chosen,rejected}_{input_ids,labels}_document.{bin,idx}
(labels -100 on the prompt, then the response ids; data_path: P), or `--output F.parquet`
with list<int32> columns prompt_ids/chosen_ids/rejected_ids and prompt_text. A pair longer
than --seq-length, an empty response or chosen identical to rejected is an error naming the
row: nothing is dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EPILOG = """\
examples:
  python tools/preprocess_data.py --input data/gsm8k/train.jsonl \\
      --output data/gsm8k/train.tokenized.parquet --tokenizer ./Qwen2.5-0.5B-Instruct \\
      --max-prompt-length 256 --answer-key answer
  # MindSpeed-RL's packed indexed format (data_path: data/gsm8k/train)
  python tools/preprocess_data.py --input data/gsm8k/train.jsonl \\
      --output-prefix data/gsm8k/train --tokenizer ./Qwen2.5-0.5B-Instruct
  # DPO pairs from Intel/orca_dpo_pairs (system/question/chosen/rejected), as
  # MindSpeed-RL's configs/datasets/orca_rlhf.yaml (data_path: ./dataset/dpo)
  python tools/preprocess_data.py --handler-name AlpacaStylePairwiseHandler \\
      --input ./dataset/orca_rlhf.jsonl --output-prefix ./dataset/dpo \\
      --tokenizer ./model_from_hf/Qwen3 --seq-length 4096 \\
      --map-keys '{"prompt": "question", "query": "", "system": "system"}'
"""

PROMPT_HANDLER, PAIRWISE_HANDLER = "R1AlpacaStyleInstructionHandler", "AlpacaStylePairwiseHandler"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object {{target: column}}, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help=".jsonl/.json/.parquet file or directory")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--output", help="output .parquet file")
    out.add_argument("--output-prefix", help="output prefix of a MindSpeed-RL packed indexed "
                                             "dataset (.bin/.idx per field)")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (HF format)")
    p.add_argument("--handler-name", default=PROMPT_HANDLER,
                   choices=[PROMPT_HANDLER, PAIRWISE_HANDLER],
                   help=f"{PROMPT_HANDLER}: prompts with answers (GRPO/PPO, default); "
                        f"{PAIRWISE_HANDLER}: preference pairs (DPO)")
    p.add_argument("--map-keys", type=_json_object, default=None,
                   help="pairwise only: JSON {target: column} as MindSpeed-RL's map_keys, "
                        "targets prompt/query/system/history/chosen/rejected; \"\" = absent")
    p.add_argument("--seq-length", type=int, default=None,
                   help="pairwise only: a pair whose prompt + longer response has more tokens "
                        "is an error (megatron_training.seq_length)")
    p.add_argument("--prompt-key", default="prompt", help="prompts only")
    p.add_argument("--answer-key", default="answer", help="prompts only")
    p.add_argument("--max-prompt-length", type=int, default=None,
                   help="drop prompts with more tokens (rl_config.max_prompt_length)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="tokenize the raw prompt text instead of the chat template")
    p.add_argument("--system-prompt", default=None, help="system message put before each prompt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    pairwise = args.handler_name == PAIRWISE_HANDLER
    for flag, value in (("--max-prompt-length", args.max_prompt_length),
                        ("--system-prompt", args.system_prompt)):
        if pairwise and value is not None:
            p.error(f"{flag} is for prompts; pairs are limited by --seq-length and take their "
                    "system message from the data (map_keys.system)")
    for flag, value in (("--map-keys", args.map_keys), ("--seq-length", args.seq_length)):
        if not pairwise and value is not None:
            p.error(f"{flag} is for --handler-name {PAIRWISE_HANDLER}")
    return args


def preprocess(input_path: str, output_path: str, tokenizer, *, prompt_key: str = "prompt",
               answer_key: str = "answer", max_prompt_length: int | None = None,
               apply_chat_template: bool = True, system_prompt: str | None = None,
               progress: bool = True, output_format: str = "parquet") -> tuple[int, int]:
    """Write the tokenized prompts of ``input_path`` to ``output_path``.

    output_format: ``parquet`` (a file) or ``indexed`` (``output_path`` is the prefix of
    MindSpeed-RL's packed indexed dataset; answers stored as token ids).
    returns: (prompts written, prompts dropped as too long)
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mindspeed_rl.data.prompts import (PROMPT_IDS_COLUMN, PROMPT_TEXT_COLUMN,
                                           read_prompt_rows, tokenize_prompts)

    rows = read_prompt_rows(input_path, prompt_key, answer_key, data_path_key="--input")
    ids_column, text_column, answer_column = [], [], []
    num_dropped = 0
    for raw, (ids, text) in zip(rows, tokenize_prompts(rows, tokenizer, apply_chat_template,
                                                        system_prompt, prompt_key, progress)):
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            num_dropped += 1
            continue
        ids_column.append(ids)
        text_column.append(text)
        answer_column.append(raw.answer)
    if output_format == "indexed":
        from mindspeed_rl.data.indexed import write_indexed_prompts

        answers = tokenizer(answer_column, add_special_tokens=False)["input_ids"] if (
            answer_column) else []
        return write_indexed_prompts(output_path, zip(ids_column, answers)), num_dropped
    table = pa.table({PROMPT_IDS_COLUMN: pa.array(ids_column, type=pa.list_(pa.int32())),
                      PROMPT_TEXT_COLUMN: pa.array(text_column, type=pa.string()),
                      answer_key: pa.array(answer_column, type=pa.string())})
    metadata = {"mindspeed_rl.tokenizer": str(getattr(tokenizer, "name_or_path", "")),
                "mindspeed_rl.max_prompt_length": json.dumps(max_prompt_length),
                "mindspeed_rl.apply_chat_template": json.dumps(apply_chat_template),
                "mindspeed_rl.num_dropped": str(num_dropped), "mindspeed_rl.source": input_path}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    tmp_path = output_path + ".tmp"
    pq.write_table(table, tmp_path)
    os.replace(tmp_path, output_path)  # no half-written file under the final name
    return len(ids_column), num_dropped


def preprocess_pairs(input_path: str, output_path: str, tokenizer, *,
                     map_keys: dict | None = None, seq_length: int | None = None,
                     apply_chat_template: bool = True, output_format: str = "parquet") -> int:
    """Write the tokenized preference pairs of ``input_path`` to ``output_path``.

    output_format: ``parquet`` (prompt_ids/chosen_ids/rejected_ids/prompt_text columns) or
    ``indexed`` (``output_path`` is the prefix of MindSpeed-RL's packed pairwise dataset).
    returns: pairs written (every row: a bad one is an error naming it)
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mindspeed_rl.data.pairwise import load_pair_dataset

    pairs = load_pair_dataset(input_path, tokenizer, seq_length, map_keys=map_keys,
                              shuffle=False, data_path_key="--input",
                              apply_chat_template=apply_chat_template)
    if output_format == "indexed":
        from mindspeed_rl.data.indexed import write_indexed_pairs

        return write_indexed_pairs(output_path, ((p.prompt_ids, p.chosen_ids, p.rejected_ids)
                                                 for p in pairs))
    ids = pa.list_(pa.int32())
    table = pa.table({
        "prompt_ids": pa.array([p.prompt_ids for p in pairs], type=ids),
        "chosen_ids": pa.array([p.chosen_ids for p in pairs], type=ids),
        "rejected_ids": pa.array([p.rejected_ids for p in pairs], type=ids),
        "prompt_text": pa.array([p.prompt_text for p in pairs], type=pa.string())})
    metadata = {"mindspeed_rl.tokenizer": str(getattr(tokenizer, "name_or_path", "")),
                "mindspeed_rl.seq_length": json.dumps(seq_length),
                "mindspeed_rl.apply_chat_template": json.dumps(apply_chat_template),
                "mindspeed_rl.source": input_path}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    pq.write_table(table, output_path + ".tmp")
    os.replace(output_path + ".tmp", output_path)  # no half-written file under the final name
    return len(pairs)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    output_format = "indexed" if args.output_prefix else "parquet"
    where = args.output or args.output_prefix + "_packed_*"
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        if args.handler_name == PAIRWISE_HANDLER:
            written = preprocess_pairs(
                args.input, args.output or args.output_prefix, tokenizer,
                map_keys=args.map_keys, seq_length=args.seq_length,
                apply_chat_template=not args.no_chat_template, output_format=output_format)
            print(f"wrote {written} pairs to {where}")
            return 0
        written, dropped = preprocess(
            args.input, args.output or args.output_prefix, tokenizer, prompt_key=args.prompt_key,
            answer_key=args.answer_key, max_prompt_length=args.max_prompt_length,
            apply_chat_template=not args.no_chat_template, system_prompt=args.system_prompt,
            progress=not args.no_progress,
            output_format=output_format)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written} prompts to {where} "
          f"({dropped} dropped as longer than "
          f"--max-prompt-length={args.max_prompt_length})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
