#!/usr/bin/env bash
# The CUDA checks, as one script for a GPU machine (the device tool's `run`; see RESULTS.md "On a GPU").
# Needs python3 with torch (CUDA), pytest, hypothesis, transformers; installs the pure-Python wheels it
# is given in .gpu/wheels (networkx, tqdm, pytest-timeout) when the machine lacks them.
#   OUT=/tmp/out bash tools/gpu_check.sh [benchmark-args...]
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
if [ -d .gpu/wheels ]; then
  python3 -m pip install --no-index --no-deps --find-links .gpu/wheels networkx tqdm pytest-timeout \
    >"$OUT/pip.txt" 2>&1 || echo "pip install from .gpu/wheels failed (see pip.txt)" >>"$OUT/pip.txt"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, \
transformers.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; } >"$OUT/gpu.txt" 2>&1
# the cuda-marked tests (addopts deselects them by default)
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -o addopts="" -m cuda --timeout=240 -rA \
  --junitxml="$OUT/cuda_tests.xml" tests >"$OUT/cuda_tests.txt" 2>&1
echo "pytest exit $?" >>"$OUT/cuda_tests.txt"
tail -n 30 "$OUT/cuda_tests.txt"
# one GPU: the Trainer on a one-stage plan vs a plain PyTorch loop, fp32 and bf16
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/gpu_single.py --out-dir "$OUT" "$@" >"$OUT/gpu_single.txt" 2>&1
echo "benchmark exit $?" >>"$OUT/gpu_single.txt"
grep -v "p2p channels" "$OUT/gpu_single.txt" | tail -n 12
