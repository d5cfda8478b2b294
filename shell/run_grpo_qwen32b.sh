#!/usr/bin/env bash
# GRPO on Qwen2.5-32B (configs/grpo_qwen25_32b.yaml): 32 devices = 4 nodes x 8.
# On every node:  NODE_RANK=<0..3> MASTER_ADDR=<node 0> bash shell/run_grpo_qwen32b.sh [dotted.key=value ...]
# Prepare once:
#   python tools/convert_ckpt.py --load-model-type hf --save-model-type mg \
#       --load-dir ./Qwen2.5-32B --save-dir ./ckpt/qwen25_32b_mg
#   python pretrain_grpo.py --config configs/grpo_qwen25_32b.yaml --dry-run --world-size 32
export NNODES=${NNODES:-4}
exec bash "$(dirname "${BASH_SOURCE[0]}")/launch_grpo.sh" configs/grpo_qwen25_32b.yaml "$@"
