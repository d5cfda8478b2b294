#!/usr/bin/env python
"""PPO launcher (one SPMD program; run it under torchrun): actor, critic, reference,
reward model and rollout co-located on every rank.

  torchrun --nproc_per_node 2 pretrain_ppo.py --config configs/ppo_smollm2_demo.yaml
  python pretrain_ppo.py --config configs/ppo_qwen25_7b.yaml --dry-run --world-size 16

The config needs a critic_config section; it is validated for the launched world size
before any process group exists.
"""

if __name__ == "__main__":  # vLLM and dist_checkpointing spawn helpers that re-import __main__
    from mindspeed_rl.trainer.launch import exit_process, launch

    exit_process(launch(None, prog="pretrain_ppo.py", algorithm="ppo"))
