"""mindspeed_rl: distributed RL post-training (GRPO, PPO, DAPO) on megatron-core and vLLM."""

__version__ = "0.1.0"
