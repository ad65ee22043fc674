#!/usr/bin/env bash
# GPU check: the kernel tests and the engine tests on CUDA (greedy against transformers, sliding
# windows, speculative verification, graphs against eager), the kernel benchmark (every cache dtype,
# sliding windows), CUDA graphs against eager decode at batch 1 and 32, offline throughput of a
# Llama-3.2-1B-shaped random model beside transformers, and a sweep of Triton launch configs;
# everything (logs, JSON, plots, a status line per step) written to OUT_DIR.
#
#   bench/gpu_check.sh OUT_DIR
#   GPU_CHECK_STEPS="bench graphs" bench/gpu_check.sh OUT_DIR     # a rerun of some steps only
#
# Needs no network: uses the machine's python (PYTHON=... to choose) with its torch and triton, and
# imports nanoserve from a throw-away package folder (so that nothing is installed; the engine steps
# need safetensors, tokenizers, jinja2 and tqdm, which come with transformers; GPU_CHECK_BUILD_C=1
# builds the CPU kernels too). A failing step is recorded and the next one runs; the script ends
# within GPU_CHECK_SECONDS (460 by default).
set -euo pipefail

OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
DEADLINE=$(($(date +%s) + ${GPU_CHECK_SECONDS:-460}))
LOG="$OUT/gpu_check.log"
STATUS="$OUT/status.txt"
: >"$STATUS"
exec > >(tee -a "$LOG") 2>&1

# step NAME CAP_SECONDS CMD...: runs CMD with its output in OUT/NAME.log, for at most CAP seconds
# and never past the deadline; records "NAME ok|failed rc=N|skipped, seconds" in status.txt.
step() {
  local name=$1 cap=$2 left rc start
  shift 2
  if [[ -n ${GPU_CHECK_STEPS:-} && " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    return 0
  fi
  left=$((DEADLINE - $(date +%s)))
  ((cap < left)) || cap=$left
  if ((cap < 10)); then
    echo "$name skipped (out of time)" | tee -a "$STATUS"
    return 0
  fi
  echo "== $name (up to ${cap}s): $*"
  start=$(date +%s)
  rc=0
  timeout --kill-after=10 "$cap" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  tail -n 25 "$OUT/$name.log"
  if ((rc == 0)); then
    echo "$name ok, $(($(date +%s) - start))s" | tee -a "$STATUS"
  else
    echo "$name failed rc=$rc, $(($(date +%s) - start))s" | tee -a "$STATUS"
  fi
}

environment() {
  date -u
  nvidia-smi || true
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("no triton:", e)
for mod in ("pytest", "matplotlib", "setuptools", "numpy", "transformers", "safetensors",
            "tokenizers", "jinja2", "tqdm"):
    try:
        print(mod, __import__(mod).__version__)
    except ImportError:
        print(mod, "MISSING")
EOF
  gcc --version | head -n 1 || true
  git -C "$REPO" log -1 --format='commit %H %s' 2>/dev/null || true
}

# nanoserve without installing: a package folder of src/nanoserve whose kernels/ is this repo's
# kernels/python/ (where build_ext --inplace puts the C module).
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
cp -r "$REPO/src/nanoserve" "$SHIM/nanoserve"
ln -s "$REPO/kernels/python" "$SHIM/nanoserve/kernels"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"

export PY REPO
export -f environment
step environment 30 bash -c environment
# The C module is for CPU tensors only: its build (over 90 s on 16 cores) is CI's, not this script's.
if [[ -n ${GPU_CHECK_BUILD_C:-} ]]; then
  step build_c 240 "$PY" setup.py build_ext --inplace
fi
step import 60 "$PY" -c "from nanoserve import kernels; print(kernels.available_backends('cuda'), kernels.available_backends('cpu'))"

# The kernel tests' CUDA cases; the CPU cases and the interpreter subprocess are CI's.
# -c /dev/null and --noconftest: the tests need neither the project's pytest settings nor its plugins.
if "$PY" -c "import pytest" 2>/dev/null; then
  step tests 100 "$PY" -m pytest tests/test_kernels.py -c /dev/null --rootdir "$REPO" --noconftest \
    -p no:cacheprovider -k "cuda and not interpreter" -rA --durations=15 --junitxml="$OUT/tests.xml"
else
  echo "tests skipped: pytest is not installed" | tee -a "$STATUS"
fi

# The engine on CUDA: greedy against transformers (sliding windows too), speculative verification,
# graphs against eager, pool sizing.
if "$PY" -c "import pytest" 2>/dev/null; then
  step engine_tests 90 "$PY" -m pytest tests/test_cuda.py -c /dev/null \
    --rootdir "$REPO" -p no:cacheprovider -rA --junitxml="$OUT/engine_tests.xml"
fi

step bench 120 "$PY" -m bench.bench_kernels --device cuda --out "$OUT"
step graphs 100 "$PY" -m bench.bench_graphs --device cuda --out "$OUT"
step engine_bench 150 "$PY" -m bench.bench_engine --device cuda --shape 1b --requests 256 \
  --dtype bfloat16 --hf-batch 32 --skip-serial --out "$OUT"
step sweep 70 "$PY" -m bench.bench_kernels --device cuda --sweep --out "$OUT"

echo "== status"
cat "$STATUS"
echo "results in $OUT:"
ls -l "$OUT"
! grep -q "failed" "$STATUS"
