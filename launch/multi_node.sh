#!/usr/bin/env bash
# Several nodes: run this on every node with the same NNODES, MASTER_ADDR and MASTER_PORT and
# that node's NODE_RANK (0 on the MASTER_ADDR node).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/multi_node.sh --config configs/ppo.yaml model.path=...
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch/multi_node.sh --config configs/ppo.yaml model.path=...
# The checkpoint folder (trainer.default_local_dir) must be on a file system every node sees.
# --dry-run (first argument): print this node's torchrun command instead of starting it.
# MAX_RESTARTS (default 3): torchrun restarts the job this many times after a failure, and each
# restart resumes from the newest intact checkpoint (trainer.resume_mode=auto).
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi

: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (host name or IP of the NODE_RANK=0 node)}"
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    NPROC_PER_NODE=$(nvidia-smi -L | wc -l)
  else
    NPROC_PER_NODE=1
  fi
fi
PYTHON=${PYTHON:-python}

# Static rendezvous at MASTER_ADDR:MASTER_PORT: a node restarts its workers when they fail, and
# the others' workers fail with them (a dead peer breaks their collectives), so every node is at
# the same restart count, which keys each attempt's process group (distributed/parallel.py).
CMD=("$PYTHON" -m torch.distributed.run
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE"
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" --max-restarts="$MAX_RESTARTS"
  -m verl_megatron.train "$@" trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$NPROC_PER_NODE")
if (( DRY_RUN )); then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
# Before torchrun, the start-up checks every rank runs (config, data, reward, distillation, memory),
# once: a bad input is one line and exit status 2, not a failed job restarted MAX_RESTARTS times.
"$PYTHON" -m verl_megatron.cli check --world-size="$((NNODES * NPROC_PER_NODE))" "$@" \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$NPROC_PER_NODE" || exit $?
exec "${CMD[@]}"
