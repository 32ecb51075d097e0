#!/usr/bin/env bash
# Run verl's own CPU unit tests for the API this package mirrors, against verl_megatron.
#
# verl's test files are copied into a scratch folder outside the checkout (they are not part
# of this repository), the only change being the import rename verl -> verl_megatron, then run
# with pytest. Usage:
#   tests/verl_upstream/run_verl_unit_tests.sh <verl git dir> [rev] [scratch dir]
# e.g. with a clone of github.com/verl-project/verl (volcengine/verl moved there):
#   tests/verl_upstream/run_verl_unit_tests.sh ~/verl/.git release/v0.9.0
# verl's async tests need pytest-asyncio; VERL_TEST_DEPS names a folder holding it (e.g.
# `pip install --no-deps --target /tmp/verl_test_deps pytest-asyncio`), kept out of the venv.
# verl's rate-limited reward manager tests load ~/models/Qwen/Qwen2.5-0.5B-Instruct's tokenizer;
# with VERL_STANDIN_TOKENIZER=1 a byte-level BPE stand-in is saved there under a scratch HOME
# (they only encode and decode text). Extra arguments after the third go to pytest.
set -euo pipefail
GIT_DIR=${1:?usage: $0 <verl git dir> [rev] [scratch dir]}
REV=${2:-release/v0.9.0}
OUT=${3:-/tmp/verl_tests}
FILES=(
  tests/__init__.py tests/trainer/__init__.py tests/trainer/ppo/__init__.py
  tests/trainer/ppo/test_core_algos_on_cpu.py
  tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py
  tests/trainer/ppo/test_loss_aggregation_on_cpu.py
  tests/trainer/ppo/test_metric_utils_on_cpu.py
  tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py
  tests/trainer/ppo/test_rollout_corr.py
  tests/trainer/ppo/test_rollout_corr_integration.py
  tests/trainer/ppo/test_rollout_moe_lb_metrics_on_cpu.py
  tests/trainer/ppo/test_spec_decode_metrics_on_cpu.py
  tests/trainer/ppo/test_value_loss_normalization_on_cpu.py
  tests/trainer/test_multi_trajectories_advantage_on_cpu.py
  tests/utils/reward_score/test_sandbox_on_cpu.py
  tests/utils/reward_score/reward_score/test_sandbox_fusion_on_cpu.py
  tests/utils/test_tokenizer_normalize_on_cpu.py
  tests/utils/test_turn_separator_on_cpu.py
  tests/experimental/reward_loop/test_async_token_bucket_on_cpu.py
  tests/experimental/reward_loop/test_rate_limited_reward_manager_on_cpu.py
  tests/workers/reward_manager/test_dapo_on_cpu.py
  tests/workers/reward_manager/test_naive_on_cpu.py
  tests/workers/reward_manager/test_registry_on_cpu.py
  tests/test_protocol_on_cpu.py
)
rm -rf "$OUT" && mkdir -p "$OUT"
for f in "${FILES[@]}"; do
  mkdir -p "$OUT/$(dirname "$f")"
  git --git-dir="$GIT_DIR" show "$REV:$f" > "$OUT/$f"
done
# The import rename, nothing else: `verl.` / `import verl` / `from verl ` become verl_megatron.
find "$OUT" -name '*.py' -print0 | xargs -0 sed -i -E \
  -e 's/(^|[^_A-Za-z0-9."\/])verl\./\1verl_megatron./g' \
  -e 's/"verl\./"verl_megatron./g' \
  -e 's/(import|from) verl( |$)/\1 verl_megatron\2/g'
cd "$OUT"
if [ "${VERL_STANDIN_TOKENIZER:-0}" = 1 ]; then
  export HOME="$OUT/home"
  python -c "from verl_megatron.utils.local_assets import build_bpe_tokenizer as b; b('$HOME/models/Qwen/Qwen2.5-0.5B-Instruct')"
fi
PYTHONPATH="${VERL_TEST_DEPS:-}${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python -m pytest -q -p no:cacheprovider --continue-on-collection-errors \
  -o addopts="" tests "${@:4}"
