#!/usr/bin/env bash
# The DPO demo: SmolLM2-135M-Instruct learns small additions from pairs of its own samples.
#   bash shell/run_dpo_demo.sh [dotted.key=value ...]      e.g. megatron_training.dpo_beta=0.2
# On a fresh machine it sets up .venv, converts the model and writes the arithmetic data as
# the GRPO demo does, samples the pairs once with vLLM (tools/make_preference_pairs.py:
# 8 samples per prompt, a correct answer chosen and a wrong one rejected; cached in
# ./cache/dpo_pairs), runs pretrain_dpo.py under torchrun (DP 2), evaluates greedy
# accuracy on the held-out prompts before and after, and plots the metrics.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo_common.sh"
prepare_demo
CONFIG=configs/dpo_smollm2_demo.yaml OUT=outputs/dpo_smollm2_demo
if [[ ! -f cache/dpo_pairs/train.jsonl ]]; then
  echo "[demo] sampling preference pairs from the model (once; cached in cache/dpo_pairs)"
  "$PY" -m mindspeed_rl.fault.torchrun --standalone --nproc_per_node 2 \
    tools/make_preference_pairs.py --model "$MODEL_DIR" --data "$DATA_DIR/train.jsonl" \
    --out cache/dpo_pairs/train.jsonl --max-prompts 320 --samples 8 --temperature 1.0 \
    --max-tokens 48 --verifiers integer_answer,final_answer_format
fi
echo "[demo] DPO on 2 CPU ranks (docs/results.md lists measured times); metrics: $OUT/logs/metrics.jsonl"
"$PY" -m mindspeed_rl.fault.torchrun --standalone --nproc_per_node 2 pretrain_dpo.py \
  --config "$CONFIG" "$@"
summarize_demo "$OUT"
