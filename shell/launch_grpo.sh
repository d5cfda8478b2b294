#!/usr/bin/env bash
# Megatron-style multi-node launcher: run the same command on every node.
#   NNODES=2 NODE_RANK=<0..NNODES-1> MASTER_ADDR=<node 0> bash shell/launch_grpo.sh CONFIG [dotted.key=value ...]
# Honours NNODES, NODE_RANK, NPROC_PER_NODE (devices per node), MASTER_ADDR, MASTER_PORT, and
# LAUNCHER (pretrain_grpo.py by default; pretrain_ppo.py for PPO configs).
set -euo pipefail
CONFIG=${1:?usage: launch_grpo.sh CONFIG [dotted.key=value ...]}
shift

# --- Ascend NPU environment (CANN); uncomment on Ascend nodes -----------------------------
# source /usr/local/Ascend/ascend-toolkit/set_env.sh
# source /usr/local/Ascend/nnal/atb/set_env.sh
# HCCL_CONNECT_TIMEOUT and HCCL_EXEC_TIMEOUT are set by the launcher from
# rl_config.collective_timeout_s (clamped to HCCL's ranges); export them only to differ.
# export HCCL_IF_BASE_PORT=48000
# export TASK_QUEUE_ENABLE=2
# export CPU_AFFINITY_CONF=1
# --- CUDA: megatron-core overlaps communication best with one hardware queue -------------
export CUDA_DEVICE_MAX_CONNECTIONS=1

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
LAUNCHER=${LAUNCHER:-pretrain_grpo.py}

cd "$(dirname "${BASH_SOURCE[0]}")/.."
NAME=$(basename "$CONFIG" .yaml)
mkdir -p logs
# torchrun through mindspeed_rl.fault.torchrun: same arguments and agent, but a failed job
# ends with its one-line cause (not torchrun's ChildFailedError traceback), and SIGTERM
# (preemption) saves a checkpoint and exits 0. A hung rank is bounded by
# rl_config.collective_timeout_s (docs/reliability.md).
"${PYTHON:-python}" -m mindspeed_rl.fault.torchrun --nproc_per_node "$NPROC_PER_NODE" \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" \
  --master_port "$MASTER_PORT" \
  "$LAUNCHER" --config "$CONFIG" "$@" 2>&1 | tee "logs/${NAME}_node${NODE_RANK}.log"
