#!/usr/bin/env bash
# The whole GPU check in one command on a short-loan GPU machine (no internet, ~15 minutes in all):
# install the carried wheels (benchmarks/gpu/prepare_wheels.sh), run gpu_check.py at the 0.5B
# shape (torchrun at dp = the GPU count when there are 2+), then, with the time left, a short GRPO
# run of configs/gpu_quickstart.yaml; everything within TOTAL_S seconds (8 minutes). JSON and logs
# go to OUT: gpu_check.json, gpu_check.log, grpo/ (metrics.jsonl), grpo.log and run_on_gpu.json
# (each stage's exit status and seconds).
#
# usage: benchmarks/gpu/run_on_gpu.sh [--dry-run] [--wheels DIR] [OUT]   (OUT default: $OUT)
set -uo pipefail

TOTAL_S=${RUN_ON_GPU_TOTAL_S:-480}   # the whole call: leaves room under a 10-minute command limit
CHECK_S=${RUN_ON_GPU_CHECK_S:-300}   # gpu_check.py at 0.5B: about 2-5 minutes
MIN_GRPO_S=60      # below this the GRPO run is skipped (start-up alone takes ~30 s)
GRPO_STEPS=20

usage() { echo "usage: $0 [--dry-run] [--wheels DIR] [OUT]   (OUT: output folder, default \$OUT)" >&2; exit 2; }

root="$(cd "$(dirname "$0")/../.." && pwd)"
dry=0
wheels="$root/.whl"
out=""
while (( $# )); do
  case "$1" in
    --dry-run) dry=1 ;;
    --wheels) [[ $# -ge 2 && -n "$2" ]] || { echo "run_on_gpu.sh: --wheels needs a folder" >&2; usage; }; wheels="$2"; shift ;;
    -h|--help) usage ;;
    -*) echo "run_on_gpu.sh: unknown option $1" >&2; usage ;;
    *) [[ -z "$out" ]] || { echo "run_on_gpu.sh: one OUT only, got $out and $1" >&2; usage; }; out="$1" ;;
  esac
  shift
done
out="${out:-${OUT:-}}"
[[ -n "$out" ]] || { echo "run_on_gpu.sh: no output folder: pass OUT or set \$OUT" >&2; usage; }
if (( ! dry )) && ! compgen -G "$wheels/*.whl" >/dev/null; then
  echo "run_on_gpu.sh: no wheels in $wheels: run benchmarks/gpu/prepare_wheels.sh on a connected machine and carry the folder" >&2
  exit 2
fi

out="$(realpath -m "$out")"
wheels="$(realpath -m "$wheels")"
cd "$root" || exit 2  # the commands below name the project's files from its root
site="${TMPDIR:-/tmp}/verl_megatron_gpu_site"
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
start=$SECONDS
declare -A rc secs

# run NAME LOG TIMEOUT CMD...: prints the command under --dry-run, else runs it with a timeout.
run() {
  local name=$1 log=$2 limit=$3; shift 3
  if (( dry )); then
    echo "timeout $limit ${*} > $log 2>&1"
    return 0
  fi
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  rc[$name]=$?
  secs[$name]=$(( SECONDS - t0 ))
  echo "$name: exit ${rc[$name]} after ${secs[$name]} s (log: $log)"
}

(( dry )) || mkdir -p "$out" "$site"
(( dry )) && echo "export PYTHONPATH=$PYTHONPATH"
run install "$out/install.log" 60 python -m pip install --no-deps --no-index --target "$site" "$wheels"/*.whl

gpus=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
check=(benchmarks/gpu/gpu_check.py --size 0.5b --out "$out/gpu_check.json" --workdir "${TMPDIR:-/tmp}/gpu_check_work")
if (( gpus >= 2 )); then  # the distributed optimizer sharded at dp = gpus
  check=(torchrun --standalone --nproc_per_node="$gpus" "${check[@]}")
else
  check=(python "${check[@]}")
fi
run gpu_check "$out/gpu_check.log" "$CHECK_S" "${check[@]}"

# --dry-run prints the worst case: gpu_check using all of its CHECK_S
left=$(( TOTAL_S - (dry ? CHECK_S : SECONDS - start) - 10 ))
if (( dry || left >= MIN_GRPO_S )); then
  run grpo "$out/grpo.log" "$left" python -m verl_megatron.cli train --config configs/gpu_quickstart.yaml \
    "trainer.default_local_dir=$out/grpo" "trainer.total_training_steps=$GRPO_STEPS" trainer.export_hf=false
else
  echo "grpo: skipped, ${left} s left"
fi
(( dry )) && exit 0

summary="{\"gpus\": $gpus, \"total_s\": $(( SECONDS - start ))"
for name in install gpu_check grpo; do
  [[ -n "${rc[$name]:-}" ]] && summary+=", \"$name\": {\"exit\": ${rc[$name]}, \"seconds\": ${secs[$name]}}"
done
echo "$summary}" > "$out/run_on_gpu.json"
cat "$out/run_on_gpu.json"
[[ -f "$out/gpu_check.json" ]] && cat "$out/gpu_check.json"
exit $(( ${rc[gpu_check]:-1} != 0 ))
