#!/usr/bin/env bash
# The CUDA-only checks of the test suite, then scripts/gpu_check.sh, as one command for a
# GPU machine with its own torch (not run in CI): the anchor sampler on CUDA, the pinned
# asynchronous slot copy, and fp8 rows copied as codes + scales and dequantized on the GPU
# bitwise as on the CPU; then the Inkling-dimension train step (tokens/s, MFU, memory).
#   bash scripts/gpu_issue_checks.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pytest -q -p no:cacheprovider -rs tests/test_fp8_rows.py tests/test_shm.py \
  tests/test_objective.py -k "cuda or gpu" 2>&1 | tee "$out/gpu_pytest.log"
test_rc=${PIPESTATUS[0]}
bash scripts/gpu_check.sh 2>&1 | tee "$out/gpu_check.log"
check_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$test_rc gpu_check rc=$check_rc"
exit $(( test_rc || check_rc ))
