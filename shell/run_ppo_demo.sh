#!/usr/bin/env bash
# The PPO demo: PPO teaches SmolLM2-135M-Instruct small additions on 2 CPU ranks, with a critic
# started from the same model (a new value head).
#   bash shell/run_ppo_demo.sh [dotted.key=value ...]       e.g. megatron_training.train_iters=20
# Same preparation as run_grpo_demo.sh (.venv, the SmolLM2 GGUF -> HF, the arithmetic data);
# runs pretrain_ppo.py under torchrun (megatron PP=2 for actor, critic and reference, vLLM
# TP_g=1 x DP_g=2), evaluates greedy accuracy before and after, and plots the metrics
# (value loss and explained variance among them).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo_common.sh"
prepare_demo
OUT=outputs/ppo_smollm2_demo
echo "[demo] PPO on 2 CPU ranks; metrics: $OUT/logs/metrics.jsonl"
"$PY" -m torch.distributed.run --standalone --nproc_per_node 2 pretrain_ppo.py \
  --config configs/ppo_smollm2_demo.yaml "$@"
summarize_demo "$OUT"
