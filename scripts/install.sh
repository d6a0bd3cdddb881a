#!/usr/bin/env bash
# Installs memkern from this checkout into the active Python environment.
#
#   bash scripts/install.sh          memkern and what it needs to run
#   bash scripts/install.sh --test   also the test dependencies (pytest, triton, transformers,
#                                    accelerate, diffusers, peft, trl, datasets, mmengine, ...)
#                                    and ruff, the linter .ci/run runs
#
# torch: an installed torch 2.11-2.15 is kept as it is (a GPU user's CUDA build is never
# replaced). Without one, torch==2.13.0 is installed: a pinned version, because an open range
# would pull the newest release, which on Linux is a multi-GB CUDA build even on CPU-only
# machines (where the 2.13.0 CPU wheel is at hand, pip takes that).
# memkern is then built with --no-build-isolation against that torch, in place (editable), so
# the compiled extension lands next to the sources and the tests run against this checkout.
# The compiled objects stay in build/ext (setup.py): a second run, e.g. `--test` after a plain
# install, recompiles only what changed since, and then links.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}

with_tests=0
for arg in "$@"; do
  case "$arg" in
    --test) with_tests=1 ;;
    *) echo "install.sh: unknown argument '$arg' (use --test or nothing)" >&2; exit 2 ;;
  esac
done

if torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  if ! "$python" - "$torch_version" <<'PY'
import re, sys
major, minor = map(int, re.match(r"(\d+)\.(\d+)", sys.argv[1]).groups())
sys.exit(0 if (2, 11) <= (major, minor) < (2, 16) else 1)
PY
  then
    echo "install.sh: torch $torch_version is installed; memkern supports torch 2.11 to 2.15." >&2
    echo "            Install one of those (e.g. pip install torch==2.13.0) and run again." >&2
    exit 1
  fi
  echo "install.sh: keeping the installed torch $torch_version"
else
  "$python" -m pip install "torch==2.13.0"
fi

"$python" -m pip install "setuptools>=64" wheel ninja numpy matplotlib "rich>=13"
if [ "$with_tests" = 1 ]; then
  # the installed torch is named with the test packages so that none of them replaces it
  "$python" -m pip install "pytest>=8" pytest-xdist expecttest "hypothesis>=6.100" "triton>=3.4" \
    "transformers>=5.23" "accelerate>=1.15" "diffusers>=0.42,<0.43" \
    "peft==0.22.0" "trl==1.16.0" "datasets==5.2.0" "mmengine==0.10.7" "bitsandbytes==0.50.2" \
    "ruff==0.17.6" \
    "torch==$("$python" -c 'import torch; print(torch.__version__)')"
fi
if [ "${MEMKERN_BUILD_EXT:-1}" = 0 ]; then
  :
elif [ -f build/ext/build.ninja ]; then
  echo "install.sh: building memkern (objects kept in build/ext: only what changed is recompiled)"
else
  echo "install.sh: building memkern's C++ extension: the first build compiles for about 5" \
    "minutes on 2 idle CPU cores (later builds recompile only what changed)"
fi
# The build's progress: ninja's "[n/m]" for each compiled unit (its source file, or "linking"),
# from pip's verbose output (which indents it); all of that output goes to build/install.log,
# whose end is shown if the build fails.
mkdir -p build
log=build/install.log
echo "install.sh: compiled units of the total as they finish (full output: $log)"
if ! "$python" -m pip install -v --no-build-isolation -e . 2>&1 | tee "$log" | awk '
    /^ *\[[0-9]+\/[0-9]+\] / {
      unit = "linking"
      for (i = 2; i < NF; i++) if ($i == "-c") unit = $(i + 1)
      sub(".*/csrc/", "csrc/", unit)
      print "  " $1 " " unit
      fflush()
    }'; then
  echo "install.sh: pip install failed; the end of $log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
"$python" -c 'import memkern; print("memkern", memkern.__version__, "backends:", memkern.backends())'
