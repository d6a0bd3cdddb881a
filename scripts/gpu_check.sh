#!/usr/bin/env bash
# memkern on a GPU machine, decisive answers first, inside a time budget: build with the CUDA
# kernels, the cuda-marked tests in parallel, GPT-2 small eager (with CPU offload), the layers
# at real shapes (the linear cross-entropy against Liger-Kernel), host time per layer call, the
# optimizer kernels, GPT-2 small compiled, compute-sanitizer (memcheck) over the tests of the
# CUDA C++ kernels; then, budget permitting, the rest of the benchmark suite. Every step
# runs under its own time limit and is skipped, with a line saying so, when the budget left is
# shorter than it needs. A summary table comes last.
#
#   bash scripts/gpu_check.sh [BUDGET_SECONDS]        (default: $GPU_CHECK_BUDGET, else 540)
#
# Results (logs and each benchmark's JSON) go to $GPU_CHECK_OUT (default: a new temporary
# folder), named in the summary. GPU_CHECK_SKIP="cuda-tests sanitizer ..." skips the steps
# named (e.g. a second call on the same machine that only wants the benchmarks; the build
# step is then quick, ninja reusing the first call's objects). Needs: an NVIDIA GPU, a CUDA build of torch 2.11-2.15, nvcc of
# the same CUDA major version, setuptools and ninja; pytest-xdist for the parallel suite (else
# it runs serially, and says so); compute-sanitizer on the PATH or under $CUDA_HOME/bin.
# Nothing is downloaded: it runs on a machine without network. Exit status: 0 when every step
# that ran passed (a skipped step is not a failure; the summary lists it).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
budget=${1:-${GPU_CHECK_BUDGET:-540}}
out=${GPU_CHECK_OUT:-$(mktemp -d -t memkern-gpu-check-XXXX)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + budget))

if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check.sh: torch sees no CUDA GPU here ($("$python" -c 'import torch; print(torch.__version__)' 2>&1)); run it on a GPU machine" >&2
  exit 2
fi
gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name())')
arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
versions=$("$python" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")' 2>&1)

rows=()
failed=0
# step NAME LIMIT NEED DETAIL -- COMMAND...: runs COMMAND under `timeout LIMIT` (less when the
# budget has less left) with its output in $out/NAME.log, then DETAIL (a command reading that
# log) for the summary's last column. Skipped when fewer than NEED seconds of the budget are
# left: NEED is what the step takes on an H100/H200, so that a step is not started only to be
# cut short.
step() {
  local name=$1 limit=$2 need=$3 detail=$4
  shift 5
  local left=$((deadline - SECONDS))
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    echo "== $name: skipped (GPU_CHECK_SKIP)"
    rows+=("$(printf '%-18s %-8s %6s   %s' "$name" skipped - "GPU_CHECK_SKIP")")
    return
  fi
  if [ "$left" -lt "$need" ]; then
    echo "== $name: skipped, ${left}s of the budget left and it needs about ${need}s"
    rows+=("$(printf '%-18s %-8s %6s   %s' "$name" skipped - "budget: ${left}s left, needs ~${need}s")")
    return
  fi
  local limit_now=$((limit < left ? limit : left))
  echo "== $name (limit ${limit_now}s): $*"
  local start=$SECONDS status
  timeout --kill-after=15 "$limit_now" "$@" >"$out/$name.log" 2>&1
  status=$?
  tail -n 5 "$out/$name.log"
  local summary result=ok
  summary=$(eval "$detail" 2>/dev/null | tail -n 1)
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    result=TIMEOUT
    failed=1
  elif [ "$status" -ne 0 ]; then
    result=FAILED
    summary="$summary (exit $status)"
    failed=1
  fi
  rows+=("$(printf '%-18s %-8s %6ss  %s' "$name" "$result" $((SECONDS - start)) "$summary")")
}

step build 240 60 "grep -E 'memkern .* backends' \"$out/build.log\"" -- \
  env MEMKERN_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" bash -c \
  "\"$python\" -m pip install --no-build-isolation --no-deps --no-index -e . &&
   \"$python\" -c 'import memkern; b = memkern.backends(); print(\"memkern\", memkern.__version__, \"backends:\", b); assert b[\"cuda\"] and b[\"triton\"], \"the CUDA and Triton backends must both be present\"'"

if "$python" -c 'import xdist' 2>/dev/null; then
  parallel=(-n auto)
else
  parallel=()
  echo "gpu_check.sh: pytest-xdist is not installed, the suite runs serially"
fi
# MEMKERN_REQUIRE_EXT=cuda: a build whose CUDA kernels failed to load fails the tests instead
# of falling back to Triton unnoticed.
step cuda-tests 300 150 "grep -E '(passed|failed|error)' \"$out/cuda-tests.log\"" -- \
  env MEMKERN_REQUIRE_EXT=cuda "$python" -m pytest -q -p no:cacheprovider "${parallel[@]}" \
  -m cuda tests

# The GPU targets of issues 23, 24 and 29, each printed with its target by the benchmark
# itself, most decisive first: the GPT-2 small step (with offload), the layers at real shapes
# (the linear cross-entropy against Liger-Kernel among them), host time per layer call, the
# optimizer kernels; then compiled GPT-2, the fp32 host times and the sanitizer.
gpt2=(--device cuda --size gpt2-small --batch 8 --steps 12 --quiet)
step gpt2-eager 200 90 "grep -E '^memkern-full ' \"$out/gpt2-eager.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" \
  --configs torch-amp,memkern-full,memkern-full-8bit,memkern-full-offload \
  --json "$out/bench-gpt2-small.json"
step modules 240 90 "grep -E 'RMSNorm 768' \"$out/modules.log\" | head -1" -- \
  "$python" benchmarks/bench_modules.py --device cuda --save "$out/modules.json"
step overhead-bfloat16 200 90 "grep -E 'memkern-full / torch-amp' \"$out/overhead-bfloat16.log\"" -- \
  "$python" benchmarks/bench_overhead.py --device cuda --dtype bfloat16 --reps 5 \
  --calls 100 --save "$out/overhead-bfloat16.json"
step kernels 120 45 "grep -E 'speed-up' \"$out/kernels.log\" | head -1" -- \
  "$python" benchmarks/bench_kernels.py --device cuda --save "$out/kernels.json"
# The same offload comparison with a threshold clipping never reaches, as later in training:
# the bench's default (1.0) clips every one of its first steps, and a clipped window's host
# steps cannot start before the whole gradient's norm is known (memkern.optim.offload).
step offload-unclipped 150 60 "grep -E '^memkern-full-offload ' \"$out/offload-unclipped.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" --max-grad-norm 1e9 \
  --configs memkern-full,memkern-full-offload --json "$out/bench-gpt2-small-unclipped.json"
step gpt2-compiled 240 120 "grep -E '^memkern-full' \"$out/gpt2-compiled.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" --compile \
  --configs torch-amp-compiled,memkern-full --json "$out/bench-gpt2-small-compiled.json"
step overhead-float32 200 90 "grep -E 'memkern-full / torch-amp' \"$out/overhead-float32.log\"" -- \
  "$python" benchmarks/bench_overhead.py --device cuda --dtype float32 --reps 5 \
  --calls 100 --save "$out/overhead-float32.json"

# The tests of the CUDA C++ kernels (flat-buffer ops, layer ops, cross-entropy); Triton's
# kernels are JIT-compiled by Triton itself and checked by the suite.
sanitized=()
for f in tests/test_flat_ops.py tests/test_adamw8bit_op.py tests/test_sgd8bit_op.py \
         tests/test_layer_kernels.py tests/test_nn_cross_entropy_ops.py; do
  [ -f "$f" ] && sanitized+=("$f")
done
sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
if [ -x "$sanitizer" ] || [[ " ${GPU_CHECK_SKIP:-} " == *" sanitizer "* ]]; then
  step sanitizer 240 90 "grep -E 'ERROR SUMMARY|passed|failed' \"$out/sanitizer.log\" | tr '\n' ' '" -- \
    env MEMKERN_REQUIRE_EXT=cuda "$sanitizer" --tool memcheck --error-exitcode 1 \
    --print-limit 20 "$python" -m pytest -q -p no:cacheprovider -m cuda \
    -k "cuda and not triton and not interpreted" "${sanitized[@]}"
else
  failed=1
  rows+=("$(printf '%-18s %-8s %6s   %s' sanitizer MISSING - "compute-sanitizer not found (PATH, \$CUDA_HOME/bin)")")
fi

# The rest of the benchmark suite, budget permitting.
step hf 300 150 "tail -n 1 \"$out/hf.log\"" -- \
  "$python" benchmarks/bench_hf.py --device cuda --size 160m --save "$out/hf.json"
step front-end 180 90 "tail -n 1 \"$out/front-end.log\"" -- \
  "$python" benchmarks/bench_front_end.py --device cuda --save "$out/front-end.json"
step gpt2-others 240 120 "grep -E '^memkern-full-ckpt ' \"$out/gpt2-others.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" \
  --configs torch-amp-compiled-budget,memkern-full-ckpt --json "$out/bench-gpt2-small-others.json"
step 8bit-step 240 120 "tail -n 1 \"$out/8bit-step.log\"" -- \
  "$python" benchmarks/bench_8bit_state.py --device cuda --sections step,bytes \
  --save "$out/8bit-step.json"

echo
echo "memkern GPU check on $gpu (sm_${arch/./}), $versions; budget ${budget}s, used ${SECONDS}s; results in $out"
printf '%-18s %-8s %7s  %s\n' step result time detail
for row in "${rows[@]}"; do
  echo "$row"
done
exit "$failed"
