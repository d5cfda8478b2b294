#!/usr/bin/env bash
# DAPO on Qwen3-30B-A3B (MoE, GSPO loss) (configs/dapo_qwen3_30b_a3b.yaml): 16 devices = 2 nodes x 8.
# On every node:  NODE_RANK=<0|1> MASTER_ADDR=<node 0> bash shell/run_dapo_qwen3_30b_a3b.sh [dotted.key=value ...]
# Prepare once:
#   python tools/convert_ckpt.py --load-model-type hf --save-model-type mg \
#       --load-dir ./Qwen3-30B-A3B --save-dir ./ckpt/qwen3_30b_a3b_mg
#   python pretrain_grpo.py --config configs/dapo_qwen3_30b_a3b.yaml --dry-run --world-size 16
export NNODES=${NNODES:-2}
exec bash "$(dirname "${BASH_SOURCE[0]}")/launch_grpo.sh" configs/dapo_qwen3_30b_a3b.yaml "$@"
