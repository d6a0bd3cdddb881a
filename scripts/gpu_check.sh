#!/usr/bin/env bash
# memkern on a GPU machine in one call of ~10 minutes: build with the CUDA kernels, then the
# measurements that only a GPU settles (issue 37's, then other open issues' GPU figures), each
# under its own time limit, the limits of the plan adding up to the budget, the figures written
# to the record folder as each step ends. A summary table comes last.
#
#   bash scripts/gpu_check.sh [--dry-run] [BUDGET_SECONDS]   (default: $GPU_CHECK_BUDGET, else 590)
#
# --dry-run prints the plan (each step, its time limit, the latest it can start, the figure it
# is for, and whether it would run or why not) and runs nothing: no GPU needed.
#
# The plan, in order (limits in seconds; 590 in all):
#   build 70                  the extension with the CUDA kernels for this GPU
#   kernels 20                the AdamW step at 24M parameters vs copy bandwidth (norm pass + step)
#   modules 25                RMSNorm 768/4096, the GELU MLP's recompute modes, linear
#                             cross-entropy against Liger-Kernel
#   gpt2-compiled 50          memkern-full --compile against torch-amp-compiled (step, peak)
#   graph-breaks 25           profile_step.py --compile: dynamo's graph-break count
#   fit 40                    memkern-fit against torch-amp-compiled-budget at 4077 MiB
#   offload 30                memkern-full-offload unclipped (--max-grad-norm 1e9) vs memkern-full
#   offload-8bit 15           the same with 8-bit state, where the bench has that configuration
#   host-adamw 20             the host AdamW step alone against the host's copy bandwidth
#   overhead-bfloat16 35      host time per layer call, with the spread of the repetitions
#   overhead-float32 30
#   sanitizer 35              compute-sanitizer memcheck over the CUDA C++ kernels' tests
#   fsdp2 20                  FSDP2 at world size 1 with memkern vs without (issue 32), where
#                             benchmarks/bench_distributed.py exists with --device/--world-size
#   encoders 35               bench_hf.py --families bert,xlm-roberta,vit,dit (issue 34), where
#                             bench_hf.py knows those families
#   cuda-tests 140 + slack    the whole cuda-marked suite, in parallel: last, with whatever the
#                             steps before left unused; each test's result is logged as it ends,
#                             so a suite cut by its limit still records what ran
# A step that cannot run (a missing script, option or configuration, no compute-sanitizer)
# prints a line saying why and frees its time for the suite. Further steps that no default
# run has time for: gpt2-eager, hf (Llama 160M), front-end, lce-sweep (the linear
# cross-entropy's vocabulary block against its backward GEMMs), 8bit-step, one-gpu (issue 42:
# a 1.1B Llama with its optimizer on the GPU, on the host, with 8-bit state and with streamed
# gradients: each step's measured peak against its plan, step times against the GPU
# optimizer's; GPU_CHECK_STEPS="build one-gpu", 300 s); GPU_CHECK_STEPS="..."
# runs exactly the steps it names, in plan order (e.g. GPU_CHECK_STEPS="build hf front-end" for
# a second call), GPU_CHECK_SKIP="..." leaves the named ones out.
#
# Record: $GPU_CHECK_OUT, default benchmarks/results/<gpu>-<date>/ (e.g. h200-2026-11-27): a
# log per step, each benchmark's JSON, plan.txt and summary.txt, appended to after every step.
# GPU_CHECK_TAR=PATH also packs the record into PATH (.tar.gz) after every step, for a machine
# that returns a few files only: what a cut-off call leaves there is what ran. plan.txt names
# the tree by its commit, or by $GPU_CHECK_TREE where the copy has no .git.
#
# Liger-Kernel (the linear cross-entropy's peer) is not on the GPU machines: wheels in .whl/
# of the repository root (`pip download --no-deps liger-kernel==0.8.5 -d .whl`, carried with
# the tree) are installed into a temporary folder on the import path; without them the modules
# step says Liger-Kernel is absent and compares with torch only.
#
# Needs: an NVIDIA GPU, a CUDA build of torch 2.11-2.15, nvcc of the same CUDA major version,
# setuptools and ninja; pytest-xdist for the parallel suite (else it runs serially, and says
# so); compute-sanitizer on the PATH or under $CUDA_HOME/bin. Nothing is downloaded. Exit
# status: 0 when every step that ran passed (a skipped step is not a failure), 2 without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
  dry_run=1
  shift
fi
budget=${1:-${GPU_CHECK_BUDGET:-590}}
if ! [[ "$budget" =~ ^[0-9]+$ ]] || [ "$budget" -lt 1 ]; then
  echo "gpu_check.sh: BUDGET_SECONDS must be a whole number of seconds above 0, got '$budget'" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1

if [ "$dry_run" -eq 1 ]; then
  gpu="(dry run)" arch="9.0" versions="(dry run)"
  out=${GPU_CHECK_OUT:-benchmarks/results/<gpu>-$(date -u +%F)}
else
  if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: torch sees no CUDA GPU here ($("$python" -c 'import torch; print(torch.__version__)' 2>&1)); run it on a GPU machine, or --dry-run for the plan" >&2
    exit 2
  fi
  gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name())')
  arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
  versions=$("$python" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")' 2>&1)
  # "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100: the first word with a digit
  slug=$(echo "$gpu" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9\n' ' ' | tr ' ' '\n' | grep -m1 '[0-9]')
  out=${GPU_CHECK_OUT:-benchmarks/results/${slug:-gpu}-$(date -u +%F)}
  mkdir -p "$out"
fi

# Liger-Kernel and any other carried wheels (see above).
if [ "$dry_run" -eq 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d -t memkern-gpu-check-site-XXXX)
  if "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check.sh: the wheels in .whl/ did not install; the steps run without them"
  fi
fi

# Why a step's prerequisite is missing (empty: present).
missing_file() { [ -f "$1" ] || echo "$1 does not exist yet"; }
missing_options() {  # FILE OPTION...: the script exists and defines each option
  local file=$1 option
  shift
  [ -f "$file" ] || { echo "$file does not exist yet"; return; }
  for option in "$@"; do
    grep -q -- "\"$option\"" "$file" || { echo "$file has no $option option yet"; return; }
  done
}
missing_config() {
  grep -q "\"$1\"" memkern/bench/configs.py ||
    echo "memkern bench has no configuration $1 yet (memkern/bench/configs.py)"
}
missing_families() {  # comma-separated families bench_hf.py must know
  local family
  for family in ${1//,/ }; do
    grep -q "\"$family\"" benchmarks/bench_hf.py ||
      { echo "benchmarks/bench_hf.py has no family $family yet"; return; }
  done
}
sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
missing_sanitizer() {
  [ "$dry_run" -eq 1 ] || [ -x "$sanitizer" ] || echo "compute-sanitizer not found (PATH, \$CUDA_HOME/bin)"
}

# The graph breaks profile_step.py reports (its "dynamo graph_break: {reason: count}" line).
graph_breaks() {
  "$python" - "$1" <<'PY'
import ast, sys
lines = [l for l in open(sys.argv[1], errors="replace") if l.startswith("dynamo graph_break: ")]
counts = ast.literal_eval(lines[-1].split(": ", 1)[1]) if lines else {}
print(f"graph breaks per run: {sum(counts.values())} ({len(counts)} reasons)")
PY
}

# pytest's closing line, or for a suite its limit cut the results logged so far.
suite_result() {
  grep -E '^=+ .*(passed|failed|error)' "$1" | tail -n 1 | grep . ||
    echo "cut by its limit: $(grep -c ' PASSED ' "$1") passed, $(grep -c ' FAILED ' "$1") failed so far"
}

deadline=$((SECONDS + budget))
planned=0   # the limits of the steps so far: where the next one starts at the latest
rows=()
failed=0
summary_file="$out/summary.txt"
if [ "$dry_run" -eq 0 ]; then
  {
    echo "memkern GPU check on $gpu (sm_${arch/./}), $versions, $(date -u '+%F %T UTC')"
    echo "tree: ${GPU_CHECK_TREE:-$(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout (GPU_CHECK_TREE names it)')$(git status --porcelain 2>/dev/null | grep -q . && echo ' (with changes)')}"
    echo "budget ${budget}s; record $out"
  } >"$out/plan.txt"
  printf '%-18s %-8s %7s  %s\n' step result time detail >"$summary_file"
fi

pack() {
  if [ -n "${GPU_CHECK_TAR:-}" ] && [ "$dry_run" -eq 0 ]; then
    tar -czf "$GPU_CHECK_TAR.tmp" -C "$out" . && mv "$GPU_CHECK_TAR.tmp" "$GPU_CHECK_TAR"
  fi
}
record() {  # a summary row: shown at the end, and written at once
  rows+=("$1")
  [ "$dry_run" -eq 1 ] || { echo "$1" >>"$summary_file"; pack; }
}

# step NAME LIMIT FOR MISSING DETAIL -- COMMAND...: runs COMMAND under `timeout` with its output
# in $out/NAME.log, then DETAIL (a command reading that log) for the summary's last column.
# LIMIT: its seconds (N+: at least N, and all the budget left); FOR: what it measures; MISSING: why it cannot
# run (empty: it can). Its limit shrinks to the budget left when that is shorter. A step not
# in GPU_CHECK_STEPS (when given), or in GPU_CHECK_SKIP, is left out; one in neither list that
# belongs to the further steps (EXTRA=1) runs only when GPU_CHECK_STEPS names it.
EXTRA=0
step() {
  local name=$1 limit=$2 for=$3 missing=$4 detail=$5 rest=0
  shift 6
  if [[ "$limit" == *+ ]]; then
    rest=1
    limit=${limit%+}
  fi
  if [ -n "${GPU_CHECK_STEPS:-}" ]; then
    [[ " $GPU_CHECK_STEPS " == *" $name "* ]] || return 0
  elif [ "$EXTRA" -eq 1 ]; then
    return 0
  fi
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    echo "== $name: left out (GPU_CHECK_SKIP)"
    record "$(printf '%-18s %-8s %7s  %s' "$name" "left out" - "GPU_CHECK_SKIP")"
    return 0
  fi
  local latest=$planned
  planned=$((planned + limit))
  if [ "$dry_run" -eq 1 ]; then
    local shown=$limit state=run
    [ "$rest" -eq 1 ] && shown="$limit+"
    if [ "$planned" -gt "$budget" ]; then
      state="cut to $((budget - latest > 0 ? budget - latest : 0))s"
    fi
    [ -n "$missing" ] && state="skips: $missing"
    printf '%-18s %5s %6ss  %-48s %s\n' "$name" "$shown" "$latest" "$for" "$state"
    printf '%-18s %5s %7s  $' "" "" ""
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  if [ -n "$missing" ]; then
    echo "== $name: skipped, $missing"
    record "$(printf '%-18s %-8s %7s  %s' "$name" skipped - "$missing")"
    return 0
  fi
  local left=$((deadline - SECONDS))
  local limit_now=$left
  [ "$rest" -eq 0 ] && [ "$limit" -lt "$left" ] && limit_now=$limit
  if [ "$limit_now" -lt 5 ]; then
    echo "== $name: skipped, ${left}s of the budget left"
    record "$(printf '%-18s %-8s %7s  %s' "$name" skipped - "budget: ${left}s left")"
    return 0
  fi
  echo "== $name (limit ${limit_now}s; $for): $*"
  local start=$SECONDS status
  timeout --kill-after=10 "$limit_now" "$@" >"$out/$name.log" 2>&1
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
  record "$(printf '%-18s %-8s %6ss  %s' "$name" "$result" $((SECONDS - start)) "$summary")"
}

if [ "$dry_run" -eq 1 ]; then
  echo "memkern GPU check, dry run: budget ${budget}s, record $out"
  printf '%-18s %5s %7s  %-48s %s\n' step limit "starts" "for" "state (latest start: every step before ran to its limit)"
fi

step build 70 "the extension with the CUDA kernels" "" \
  "grep -E 'memkern .* backends' \"$out/build.log\"" -- \
  env MEMKERN_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" bash -c \
  "\"$python\" -m pip install --no-build-isolation --no-deps --no-index -e . &&
   \"$python\" -c 'import memkern; b = memkern.backends(); print(\"memkern\", memkern.__version__, \"backends:\", b); assert b[\"cuda\"] and b[\"triton\"], \"the CUDA and Triton backends must both be present\"'"

gpt2=(--device cuda --size gpt2-small --batch 8 --steps 12 --quiet)
step kernels 20 "#37.8 AdamW 24M: norm pass + step >= 80% copy" "" \
  "grep -E 'speed-up' \"$out/kernels.log\" | head -1" -- \
  "$python" benchmarks/bench_kernels.py --device cuda --save "$out/kernels.json"
step modules 25 "#37.3 RMSNorm/MLP <= 1.0x; #37.5 LCE vs Liger" "" \
  "grep -E 'RMSNorm 4096' \"$out/modules.log\" | head -1" -- \
  "$python" benchmarks/bench_modules.py --device cuda --save "$out/modules.json"
step gpt2-compiled 50 "#37.2 memkern-full+compile vs torch-amp-compiled" "" \
  "grep -E '^memkern-full' \"$out/gpt2-compiled.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" --compile \
  --configs torch-amp-compiled,memkern-full --json "$out/bench-gpt2-small-compiled.json"
step graph-breaks 25 "#37.2 0 graph breaks under --compile" "" \
  "graph_breaks \"$out/graph-breaks.log\"" -- \
  "$python" benchmarks/profile_step.py --device cuda --compile --steps 4 --profiled 1 --top 25
step fit 40 "#37.7 memkern-fit vs torch-amp-compiled-budget" "" \
  "grep -E '^memkern-fit' \"$out/fit.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" --memory-budget 4077MiB \
  --configs torch-amp-compiled-budget,memkern-fit --json "$out/bench-gpt2-small-fit.json"
step offload 30 "#37.6 offload unclipped vs memkern-full" "" \
  "grep -E '^memkern-full-offload ' \"$out/offload.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" --max-grad-norm 1e9 \
  --configs memkern-full,memkern-full-offload --json "$out/bench-gpt2-small-offload.json"
step offload-8bit 15 "#37.6 offload with 8-bit state" "$(missing_config memkern-full-8bit-offload)" \
  "grep -E '^memkern-full-8bit-offload ' \"$out/offload-8bit.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" --max-grad-norm 1e9 \
  --configs memkern-full-8bit-offload --json "$out/bench-gpt2-small-offload-8bit.json"
step host-adamw 20 "#37.6 host AdamW step vs host copy bandwidth" "" \
  "grep -E 'FusedAdamW.step\(\) bf16' \"$out/host-adamw.log\" | head -1" -- \
  "$python" benchmarks/bench_cpu_adamw.py --reps 5 --save "$out/host-adamw.json"
step overhead-bfloat16 35 "#37.4 host time per call <= 1.1x torch, bf16" "" \
  "grep -E 'memkern-full / torch-amp' \"$out/overhead-bfloat16.log\"" -- \
  "$python" benchmarks/bench_overhead.py --device cuda --dtype bfloat16 --reps 7 \
  --calls 60 --save "$out/overhead-bfloat16.json"
step overhead-float32 30 "#37.4 host time per call <= 1.1x torch, fp32" "" \
  "grep -E 'memkern-full / torch-amp' \"$out/overhead-float32.log\"" -- \
  "$python" benchmarks/bench_overhead.py --device cuda --dtype float32 --reps 7 \
  --calls 60 --save "$out/overhead-float32.json"

# The tests of the CUDA C++ kernels (flat-buffer ops, layer ops, cross-entropy); Triton's
# kernels are JIT-compiled by Triton itself and checked by the suite.
sanitized=()
for f in tests/test_flat_ops.py tests/test_adamw8bit_op.py tests/test_sgd8bit_op.py \
         tests/test_layer_kernels.py tests/test_nn_cross_entropy_ops.py; do
  [ -f "$f" ] && sanitized+=("$f")
done
step sanitizer 35 "#37.1 memcheck over the CUDA kernel tests: 0 errors" "$(missing_sanitizer)" \
  "grep -E 'ERROR SUMMARY|passed|failed' \"$out/sanitizer.log\" | tr '\n' ' '" -- \
  env MEMKERN_REQUIRE_EXT=cuda "$sanitizer" --tool memcheck --error-exitcode 1 \
  --print-limit 20 "$python" -m pytest -q -p no:cacheprovider -p no:benchmark -m cuda \
  -k "cuda and not triton and not interpreted" "${sanitized[@]}"
step fsdp2 20 "#32 FSDP2 world size 1, memkern vs without" \
  "$(missing_options benchmarks/bench_distributed.py --device --world-size)" \
  "tail -n 1 \"$out/fsdp2.log\"" -- \
  "$python" benchmarks/bench_distributed.py --device cuda --world-size 1 \
  --save "$out/fsdp2-world-size-1.json"
step encoders 35 "#34 encoder families (BERT, XLM-R, ViT, DiT)" \
  "$(missing_families bert,xlm-roberta,vit,dit)" "tail -n 1 \"$out/encoders.log\"" -- \
  "$python" benchmarks/bench_hf.py --device cuda --families bert,xlm-roberta,vit,dit \
  --reps 2 --save "$out/hf-encoders.json"

if [ "$dry_run" -eq 0 ]; then
  if "$python" -c 'import xdist' 2>/dev/null; then
    parallel=(-n auto)
  else
    parallel=()
    echo "gpu_check.sh: pytest-xdist is not installed, the suite runs serially"
  fi
else
  parallel=(-n auto)
fi
# Last, with all the time left (at least 140 s when every step before ran to its limit).
# -rA -v: each test's result is logged as it ends. MEMKERN_REQUIRE_EXT=cuda: a build whose
# CUDA kernels failed to load fails the tests instead of falling back to Triton unnoticed.
step cuda-tests 140+ "#37.1 the cuda-marked suite: 0 failures" "" \
  "suite_result \"$out/cuda-tests.log\"" -- \
  env MEMKERN_REQUIRE_EXT=cuda "$python" -m pytest -v -p no:cacheprovider -p no:benchmark \
  "${parallel[@]}" --durations=20 -m cuda tests

# Further steps: only when GPU_CHECK_STEPS names them (a second call).
EXTRA=1
step gpt2-eager 60 "GPT-2 small eager, with 8-bit state and offload" "" \
  "grep -E '^memkern-full ' \"$out/gpt2-eager.log\" | head -1" -- \
  "$python" -m memkern.cli bench "${gpt2[@]}" \
  --configs torch-amp,memkern-full,memkern-full-8bit,memkern-full-offload \
  --json "$out/bench-gpt2-small.json"
step hf 150 "HF Llama 160M against Liger-Kernel" "" "tail -n 1 \"$out/hf.log\"" -- \
  "$python" benchmarks/bench_hf.py --device cuda --size 160m --save "$out/hf.json"
step front-end 90 "the optimizer front ends" "" "tail -n 1 \"$out/front-end.log\"" -- \
  "$python" benchmarks/bench_front_end.py --device cuda --save "$out/front-end.json"
step lce-sweep 120 "#37.5 LCE backward GEMMs: vocab block sweep" "" \
  "grep -E 'memkern / liger' \"$out/lce-sweep.log\" | head -1" -- \
  "$python" benchmarks/bench_lce.py --device cuda --shapes 16384x50304x768:bfloat16 \
  --variants 960:768,960:1536,960:2304,1920:1536 --reps 5 --save "$out/lce-sweep.json"
step 8bit-step 120 "8-bit state step and bytes" "" "tail -n 1 \"$out/8bit-step.log\"" -- \
  "$python" benchmarks/bench_8bit_state.py --device cuda --sections step,bytes \
  --save "$out/8bit-step.json"
step one-gpu 300 "#42.5 1.1B Llama: optimizer on the GPU vs host; peak vs plan" \
  "$(missing_file benchmarks/bench_one_gpu.py)" \
  "grep -E 'the GPU optimizer' \"$out/one-gpu.log\" | tr '\n' ';'" -- \
  "$python" benchmarks/bench_one_gpu.py --save "$out/one-gpu.json"

if [ "$dry_run" -eq 1 ]; then
  echo "limits: ${planned}s of the ${budget}s budget (a step N+ counted as N; it takes all that is left)"
  [ "$planned" -le "$budget" ] || echo "the plan is longer than the budget: the last steps are cut or skipped"
  exit 0
fi
echo
echo "memkern GPU check on $gpu (sm_${arch/./}), $versions; budget ${budget}s, used ${SECONDS}s; record in $out"
printf '%-18s %-8s %7s  %s\n' step result time detail
for row in "${rows[@]}"; do
  echo "$row"
done
exit "$failed"
