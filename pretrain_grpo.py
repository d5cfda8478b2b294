#!/usr/bin/env python
"""GRPO launcher (one SPMD program; run it under torchrun).

  torchrun --nproc_per_node 2 pretrain_grpo.py --config configs/grpo_smollm2_demo.yaml \\
      [rl_config.n_samples_per_prompt=8 ...]
  python pretrain_grpo.py --config configs/grpo_qwen25_7b.yaml --dry-run --world-size 16

The config is validated for the launched world size before any process group exists.
"""

if __name__ == "__main__":  # vLLM and dist_checkpointing spawn helpers that re-import __main__
    from mindspeed_rl.trainer.launch import exit_process, launch

    exit_process(launch(None, prog="pretrain_grpo.py", algorithm="grpo"))
