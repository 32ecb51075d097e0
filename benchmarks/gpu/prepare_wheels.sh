#!/usr/bin/env bash
# Download, on a connected machine, exactly the wheels the short-loan GPU machine lacks, into a
# git-ignored folder, check they fit the carry limit, and print the command to run there.
#
# The GPU machine has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, triton, numpy, pyarrow,
# safetensors, tokenizers, peft, pytest and their dependencies (typer -> rich among them); nothing
# can be downloaded there and at most 64 MiB travel with the working tree. What this project's
# GPU check and GRPO run import beyond that is below (versions: the ones this checkout is tested
# with). omegaconf 2.4 vendors its antlr4 runtime (2.3 needed antlr4-python3-runtime 4.9);
# math-verify is imported only by its math scorer, which the quickstart task does not use;
# matplotlib (curves.png) is skipped when absent; Transformer Engine and vLLM stay out (the
# local layer spec and the native engine run without them).
#
# usage: benchmarks/gpu/prepare_wheels.sh [--dry-run] [DIR]     (DIR default: .whl/)
set -euo pipefail

WHEELS=(
  megatron-core==0.16.1
  omegaconf==2.4.0
  tensordict==0.15.3
  cloudpickle==3.1.3  # tensordict's
  pyvers==0.2.3       # tensordict's
)
LIMIT_MIB=20

usage() { echo "usage: $0 [--dry-run] [DIR]   (DIR: where the wheels go, default .whl/)" >&2; exit 2; }

root="$(cd "$(dirname "$0")/../.." && pwd)"
dry=0
dir=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -h|--help) usage ;;
    -*) echo "prepare_wheels.sh: unknown option $arg" >&2; usage ;;
    *) [[ -z "$dir" ]] || { echo "prepare_wheels.sh: one DIR only, got $dir and $arg" >&2; usage; }; dir="$arg" ;;
  esac
done
dir="${dir:-$root/.whl}"

cmd=(python -m pip download --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
     --dest "$dir" "${WHEELS[@]}")
if (( dry )); then
  echo "${cmd[*]}"
  exit 0
fi
mkdir -p "$dir"
"${cmd[@]}"

bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "$(ls "$dir"/*.whl | wc -l) wheels, ${mib} MiB in $dir"
if (( bytes > LIMIT_MIB * 1048576 )); then
  echo "prepare_wheels.sh: ${mib} MiB is over the ${LIMIT_MIB} MiB budget for the carried wheels" >&2
  exit 1
fi
rel="${dir#"$root"/}"
echo "on the GPU machine (carry $rel with the working tree), from the repository root:"
echo "  bash benchmarks/gpu/run_on_gpu.sh --wheels $rel \"\${OUT:-gpu_out}\""
