#!/usr/bin/env bash
# One node, NPROC processes (default: one per visible GPU, or 1 without GPUs).
#   NPROC=8 launch/single_node.sh --config configs/grpo.yaml model.path=/models/qwen parallel.tp=2
# Every argument goes to verl_megatron.train (a --config file and key=value overrides).
# --dry-run (first argument): print the torchrun command instead of starting it.
# MAX_RESTARTS (default 3): torchrun restarts the job this many times after a failure, and each
# restart resumes from the newest intact checkpoint (trainer.resume_mode=auto).
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi

if [[ -z "${NPROC:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    NPROC=$(nvidia-smi -L | wc -l)
  else
    NPROC=1
  fi
fi
PYTHON=${PYTHON:-python}
MAX_RESTARTS=${MAX_RESTARTS:-3}

# --standalone: a private rendezvous on a free local port, so several jobs can share the node.
CMD=("$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC"
  --max-restarts="$MAX_RESTARTS"
  -m verl_megatron.train "$@")
if (( DRY_RUN )); then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
# Before torchrun, the start-up checks every rank runs (config, data, reward, distillation, memory),
# once: a bad input is one line and exit status 2, not a failed job restarted MAX_RESTARTS times.
"$PYTHON" -m verl_megatron.cli check --world-size="$NPROC" "$@" || exit $?
exec "${CMD[@]}"
