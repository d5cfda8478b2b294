#!/usr/bin/env python
"""DPO launcher (one SPMD program; run it under torchrun): preference pairs, a frozen
reference, no rollout (MindSpeed-RL's ``stage: dpo``; docs/dpo.md).

  torchrun --nproc_per_node 2 pretrain_dpo.py --config configs/dpo_smollm2_demo.yaml \\
      [megatron_training.dpo_beta=0.1 ...]
  python pretrain_dpo.py --config dpo_qwen3_30b_a3b_A3.yaml --dry-run --world-size 16

The config is validated for the launched world size before any process group exists.
"""

if __name__ == "__main__":  # vLLM and dist_checkpointing spawn helpers that re-import __main__
    from mindspeed_rl.trainer.launch import exit_process, launch

    exit_process(launch(None, prog="pretrain_dpo.py", algorithm="dpo"))
