#!/usr/bin/env bash
# The DAPO demo: DAPO teaches SmolLM2-135M-Instruct small additions on 2 CPU ranks.
#   bash shell/run_dapo_demo.sh [dotted.key=value ...]      e.g. megatron_training.train_iters=20
# Same preparation and layout as run_grpo_demo.sh; pretrain_grpo.py with
# configs/dapo_smollm2_demo.yaml (clip-higher, token-level loss, overlong shaping, dynamic
# sampling, no KL). shell/compare_grpo_dapo_demo.sh runs both for the same time and plots them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo_common.sh"
prepare_demo
OUT=outputs/dapo_smollm2_demo
echo "[demo] DAPO on 2 CPU ranks; metrics: $OUT/logs/metrics.jsonl"
"$PY" -m torch.distributed.run --standalone --nproc_per_node 2 pretrain_grpo.py \
  --config configs/dapo_smollm2_demo.yaml "$@"
summarize_demo "$OUT"
