#!/usr/bin/env bash
# GRPO and DAPO on the arithmetic demo for the same training wall-clock budget, one plot.
#   bash shell/compare_grpo_dapo_demo.sh [MINUTES]          (default 10 minutes each)
# Runs run_grpo_demo.sh and run_dapo_demo.sh with megatron_training.exit_duration_in_mins and
# draws both greedy test-accuracy curves against training time into
# outputs/grpo_vs_dapo_accuracy.png (tools/compare_runs.py).
set -euo pipefail
MINUTES=${1:-10}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUDGET=(megatron_training.exit_duration_in_mins="$MINUTES" megatron_training.train_iters=200
        megatron_training.test_interval=3)
bash shell/run_grpo_demo.sh "${BUDGET[@]}"
bash shell/run_dapo_demo.sh "${BUDGET[@]}"
"${MSRL_VENV:-.venv}/bin/python" tools/compare_runs.py \
  GRPO=outputs/grpo_smollm2_demo/logs/metrics.jsonl DAPO=outputs/dapo_smollm2_demo/logs/metrics.jsonl \
  --key eval/accuracy --out outputs/grpo_vs_dapo_accuracy.png
