#!/usr/bin/env bash
# One node, NPROC processes (default: one per visible GPU, or 1 without GPUs).
#   NPROC=8 launch/single_node.sh --config configs/grpo.yaml model.path=/models/qwen parallel.tp=2
# Every argument goes to verl_megatron.train (a --config file and key=value overrides).
set -euo pipefail

if [[ -z "${NPROC:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    NPROC=$(nvidia-smi -L | wc -l)
  else
    NPROC=1
  fi
fi
PYTHON=${PYTHON:-python}

# --standalone: a private rendezvous on a free local port, so several jobs can share the node.
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC" \
  -m verl_megatron.train "$@"
