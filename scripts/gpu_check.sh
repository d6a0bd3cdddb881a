#!/usr/bin/env bash
# One command that proves memkern on a GPU machine: build with the CUDA kernels, the whole test
# suite in parallel, compute-sanitizer (memcheck) over the CUDA kernel tests, every benchmark
# into benchmarks/results/cuda-*.json, and a summary table last.
#
#   bash scripts/gpu_check.sh
#
# Needs: an NVIDIA GPU, a CUDA build of torch 2.11-2.15, nvcc of the same CUDA major version,
# setuptools and ninja; pytest-xdist for the parallel suite (else it runs serially, and says
# so); compute-sanitizer on the PATH or under $CUDA_HOME/bin for the sanitizer step. Nothing
# is downloaded: it runs on a machine without network. Logs go to $GPU_CHECK_LOGS (default: a
# new temporary folder), named in the summary. Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
logs=${GPU_CHECK_LOGS:-$(mktemp -d -t memkern-gpu-check-XXXX)}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1

if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check.sh: torch sees no CUDA GPU here ($("$python" -c 'import torch; print(torch.__version__)' 2>&1)); run it on a GPU machine" >&2
  exit 2
fi
gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name())')
arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
versions=$("$python" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")' 2>&1)

rows=()
failed=0
# step NAME DETAIL-COMMAND -- COMMAND...: runs COMMAND with its output in $logs/NAME.log, then
# DETAIL-COMMAND (reading that log) for the summary's last column.
step() {
  local name=$1 detail=$2
  shift 3
  echo "== $name: $*"
  local start=$SECONDS status
  "$@" >"$logs/$name.log" 2>&1
  status=$?
  tail -n 5 "$logs/$name.log"
  local summary
  summary=$(eval "$detail" 2>/dev/null | tail -n 1)
  if [ "$status" -eq 0 ]; then
    rows+=("$(printf '%-12s %-6s %6ss  %s' "$name" ok $((SECONDS - start)) "$summary")")
  else
    failed=1
    rows+=("$(printf '%-12s %-6s %6ss  %s (exit %d)' "$name" FAILED $((SECONDS - start)) "$summary" "$status")")
  fi
}

step build "grep -E 'memkern .* backends' \"$logs/build.log\"" -- \
  env MEMKERN_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" bash -c \
  "\"$python\" -m pip install --no-build-isolation --no-deps --no-index -e . &&
   \"$python\" -c 'import memkern; b = memkern.backends(); print(\"memkern\", memkern.__version__, \"backends:\", b); assert b[\"cuda\"] and b[\"triton\"], \"the CUDA and Triton backends must both be present\"'"

if "$python" -c 'import xdist' 2>/dev/null; then
  parallel=(-n auto)
else
  parallel=()
  echo "gpu_check.sh: pytest-xdist is not installed, the suite runs serially"
fi
# MEMKERN_REQUIRE_EXT=cuda: a build whose CUDA kernels failed to load fails the suite instead
# of falling back to Triton unnoticed.
step suite "grep -E '(passed|failed|error)' \"$logs/suite.log\"" -- \
  env MEMKERN_REQUIRE_EXT=cuda "$python" -m pytest -q -p no:cacheprovider "${parallel[@]}" tests

sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
if [ -x "$sanitizer" ]; then
  # The CUDA C++ kernels (the cuda backend of the flat-buffer ops); Triton's are JIT-compiled
  # by Triton itself and checked by the suite.
  step sanitizer "grep -E 'ERROR SUMMARY|passed|failed' \"$logs/sanitizer.log\" | tr '\n' ' '" -- \
    "$sanitizer" --tool memcheck --error-exitcode 1 --print-limit 20 \
    "$python" -m pytest -q -p no:cacheprovider -m cuda tests/test_flat_ops.py -k "cuda and not triton"
else
  failed=1
  rows+=("$(printf '%-12s %-6s %6s   %s' sanitizer MISSING - "compute-sanitizer not found (PATH, \$CUDA_HOME/bin)")")
fi

step benchmarks "ls benchmarks/results/cuda-*.json | tr '\n' ' '" -- \
  "$python" benchmarks/run_all.py --device cuda

echo
echo "memkern GPU check on $gpu (sm_${arch/./}), $versions; logs in $logs"
printf '%-12s %-6s %7s  %s\n' step result time detail
for row in "${rows[@]}"; do
  echo "$row"
done
exit "$failed"
