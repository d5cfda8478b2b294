#!/usr/bin/env bash
# On-policy distillation demo: the base SmolLM2-135M-Instruct (the student) learns small
# additions from the GRPO demo's trained policy (the teacher) on 2 CPU ranks, by the
# per-token reverse KL on its own samples (docs/algorithms.md, configs/distill_smollm2_demo.yaml).
#   bash shell/run_distill_demo.sh [dotted.key=value ...]    e.g. megatron_training.train_iters=6
# The teacher is outputs/grpo_smollm2_demo/hf: when it is missing, the GRPO demo runs first
# (bash shell/run_grpo_demo.sh) and its checkpoint is exported to HF. At the end the greedy
# test accuracy of each evaluation is printed next to the teacher's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo_common.sh"
prepare_demo
CONFIG=configs/distill_smollm2_demo.yaml OUT=outputs/distill_smollm2_demo
GRPO_OUT=outputs/grpo_smollm2_demo TEACHER=outputs/grpo_smollm2_demo/hf
if [[ ! -f "$TEACHER/config.json" ]]; then
  if [[ ! -f "$GRPO_OUT/ckpt/latest_checkpointed_iteration.txt" ]]; then
    echo "[demo] no teacher yet: training it with the GRPO demo (bash shell/run_grpo_demo.sh)"
    bash shell/run_grpo_demo.sh
  fi
  echo "[demo] exporting the GRPO demo's policy to $TEACHER (the teacher)"
  "$PY" tools/convert_ckpt.py --load-model-type mg --save-model-type hf \
    --load-dir "$GRPO_OUT/ckpt" --save-dir "$TEACHER" --no-progress
fi
echo "[demo] on-policy distillation on 2 CPU ranks; metrics: $OUT/logs/metrics.jsonl"
"$PY" -m mindspeed_rl.fault.torchrun --standalone --nproc_per_node 2 pretrain_grpo.py \
  --config "$CONFIG" "teacher_config.load=$TEACHER" "$@"
summarize_demo "$OUT"
"$PY" - "$OUT/logs/metrics.jsonl" "$GRPO_OUT/logs/metrics.jsonl" <<'PY'
import json, os, sys
def evals(path):
    if not os.path.isfile(path):
        return []
    return [json.loads(l) for l in open(path) if '"eval/accuracy"' in l]
student, grpo = evals(sys.argv[1]), evals(sys.argv[2])
teacher = grpo[-1]["eval/accuracy"] if grpo else None
kl = {r["iteration"]: r["distill/reverse_kl"] for r in map(json.loads, open(sys.argv[1]))
      if "distill/reverse_kl" in r}
print("[demo] greedy test accuracy per evaluation (student; teacher = the GRPO demo's last "
      "evaluation" + (f", {teacher:.3f})" if teacher is not None else ": not found)"))
for r in student:
    it = r["iteration"]
    line = f"[demo]   iteration {it:3d}: student {r['eval/accuracy']:.3f}"
    if teacher is not None:
        line += f"  (teacher - student = {teacher - r['eval/accuracy']:+.3f})"
    if it in kl:
        line += f"  reverse KL/token {kl[it]:.4f}"
    print(line)
if grpo:
    print("[demo] the GRPO demo's curve: " + ", ".join(
        f"{r['iteration']}: {r['eval/accuracy']:.3f}" for r in grpo))
PY
