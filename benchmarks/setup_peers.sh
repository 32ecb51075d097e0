#!/usr/bin/env bash
# Installs the tools the benchmarks compare against (TRL and what it pulls: accelerate, datasets,
# psutil). They are benchmark-only, not dependencies of verl-megatron.
#
#   bash benchmarks/setup_peers.sh        # inside the project's virtual environment
#
# The installed torch is pinned with a constraint, so pip can never swap the CPU build for a
# multi-GB CUDA one; the script checks afterwards that torch is the same build as before.
set -euo pipefail

python=${PYTHON:-python}
before=$("$python" -c 'import torch; print(torch.__version__)') || {
    echo "setup_peers.sh: torch is not importable with '$python'; install the project first (see README.md)" >&2
    exit 1
}

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==${before%%+*}" >"$constraints"

"$python" -m pip install --constraint "$constraints" "trl>=1.0,<2" "datasets>=3" "matplotlib>=3.8"

after=$("$python" -c 'import torch; print(torch.__version__)')
if [[ "$after" != "$before" ]]; then
    echo "setup_peers.sh: torch changed from $before to $after; reinstall torch==$before" >&2
    exit 1
fi
"$python" -c 'import trl, accelerate; print(f"TRL {trl.__version__}, accelerate {accelerate.__version__}, torch unchanged ('"$after"')")'
