#!/usr/bin/env python
"""Convert checkpoints between HF, megatron-core distributed checkpoints and GGUF.

The megatron checkpoint is a megatron-core dist_checkpointing checkpoint: tensors are
stored with their global shapes, so ONE converted checkpoint loads at any
tensor/pipeline/expert-parallel layout (TP/PP/EP) without reconversion.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = """\
examples:
  # HF -> megatron (loads at any TP/PP/EP layout; no target layout needed)
  python tools/convert_ckpt.py --load-model-type hf --save-model-type mg \\
      --load-dir ./Qwen2.5-0.5B-Instruct --save-dir ./ckpt/qwen25-mg
  # megatron -> HF (config, tokenizer files, safetensors)
  python tools/convert_ckpt.py --load-model-type mg --save-model-type hf \\
      --load-dir ./ckpt/qwen25-mg --save-dir ./qwen25-trained-hf
  # a reward model (*ForSequenceClassification, num_labels=1) -> megatron with its score
  # head (value_head.weight); mg -> hf writes a *ForSequenceClassification directory again
  python tools/convert_ckpt.py --load-model-type hf --save-model-type mg \\
      --load-dir ./Qwen2.5-RM --save-dir ./ckpt/qwen25-rm-mg
  # a Megatron-LM / MindSpeed-LLM checkpoint (legacy mp_rank_XX files or torch_dist, saved
  # at any TP/PP/EP) -> HF; the architecture and tokenizer come from the model's HF directory
  python tools/convert_ckpt.py --load-model-type mg --save-model-type hf \\
      --load-dir ./qwen25-7b-tp2-pp2 --hf-config-dir ./Qwen2.5-7B --save-dir ./qwen25-7b-hf
  # a LoRA run (actor_config.lora_target_modules) -> the merged HF model, and its adapters
  # in PEFT's format (an adapter-only checkpoint is merged onto the base model it recorded)
  python tools/convert_ckpt.py --load-model-type mg --save-model-type hf \\
      --load-dir ./ckpt/grpo-lora --save-dir ./lora-merged-hf --lora-adapter-dir ./lora-peft
  # GGUF (dequantised through transformers) -> HF or megatron
  python tools/convert_ckpt.py --load-model-type gguf --save-model-type mg \\
      --load-dir "$(python -c 'from mindspeed_rl.checkpoint.gguf import smollm2_gguf_path as p; print(p().parent)')" \\
      --save-dir ./ckpt/smollm2-mg

megatron checkpoint directory: config.json + tokenizer files + mindspeed_rl_meta.json +
latest_checkpointed_iteration.txt + release/ (or iter_XXXXXXX/ when saved by the trainer).
The output is written to a temporary directory and renamed at the end: a failure leaves
--save-dir untouched. Supported architectures: llama, qwen2, qwen3, qwen3_moe.
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-model-type", required=True, choices=["hf", "mg", "gguf"])
    p.add_argument("--save-model-type", required=True, choices=["hf", "mg"])
    p.add_argument("--load-dir", required=True,
                   help="HF directory, megatron checkpoint directory, or directory holding one *.gguf "
                        "(a .gguf file path also works)")
    p.add_argument("--save-dir", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --load-dir when it holds several")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --save-dir")
    p.add_argument("--save-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="mg -> hf: dtype of the safetensors (auto: the dtype config.json names)")
    p.add_argument("--hf-config-dir", default=None,
                   help="mg -> hf from a Megatron-LM / MindSpeed-LLM checkpoint: the model's HF "
                        "directory (config.json + tokenizer files); legacy files are read with "
                        "torch.load(weights_only=True)")
    p.add_argument("--lora-adapter-dir", default=None,
                   help="mg -> hf of a LoRA checkpoint: also write its adapters here in PEFT's "
                        "format (adapter_config.json + adapter_model.safetensors, loaded with "
                        "peft.PeftModel.from_pretrained onto the base model); --save-dir gets "
                        "the merged model either way")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read a megatron torch_dist checkpoint's pickled parts (.metadata, "
                        "common.pt) with plain pickle, which can run code the checkpoint names; "
                        "only for a checkpoint from someone you trust that the default "
                        "allow-list refuses (docs/models.md)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mindspeed_rl.checkpoint.convert import convert
    from mindspeed_rl.errors import CheckpointError
    from mindspeed_rl.models.architecture import UnsupportedConfigError
    from mindspeed_rl.checkpoint.safe_load import trust_checkpoints
    from mindspeed_rl.models.registry import UnsupportedArchitectureError

    trust_checkpoints(args.trust_checkpoint)
    try:
        out = convert(args.load_model_type, args.save_model_type, args.load_dir, args.save_dir,
                      overwrite=args.overwrite, gguf_file=args.gguf_file, dtype=args.save_dtype,
                      show_progress=not args.no_progress, hf_config_dir=args.hf_config_dir,
                      lora_adapter_dir=args.lora_adapter_dir)
    except (CheckpointError, UnsupportedArchitectureError, UnsupportedConfigError, ValueError) as exc:
        print(f"convert_ckpt: error: {exc}", file=sys.stderr)
        return 1
    print(f"convert_ckpt: wrote {args.save_model_type} checkpoint to {out}")
    return 0


if __name__ == "__main__":  # dist_checkpointing's Manager re-imports __main__: keep the guard
    sys.exit(main())
