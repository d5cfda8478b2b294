#!/usr/bin/env bash
# PPO on Qwen2.5-7B (configs/ppo_qwen25_7b.yaml): 16 devices = 2 nodes x 8; actor, critic,
# reference, reward model and vLLM rollout co-located on every device.
# On every node:  NODE_RANK=<0|1> MASTER_ADDR=<node 0> bash shell/run_ppo_qwen25_7b.sh [dotted.key=value ...]
# Prepare once:
#   python tools/convert_ckpt.py --load-model-type hf --save-model-type mg \
#       --load-dir ./Qwen2.5-7B --save-dir ./ckpt/qwen25_7b_mg
#   python tools/convert_ckpt.py --load-model-type hf --save-model-type mg \
#       --load-dir ./Qwen2.5-7B-RM --save-dir ./ckpt/qwen25_7b_rm_mg   # a *ForSequenceClassification
#   python pretrain_ppo.py --config configs/ppo_qwen25_7b.yaml --dry-run --world-size 16
export NNODES=${NNODES:-2}
export LAUNCHER=pretrain_ppo.py
exec bash "$(dirname "${BASH_SOURCE[0]}")/launch_grpo.sh" configs/ppo_qwen25_7b.yaml "$@"
