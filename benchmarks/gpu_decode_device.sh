#!/usr/bin/env bash
# The whole GPU decode measurement as one command for a lent GPU machine (torch and triton are there, no index is
# reachable): install the carried wheels, check the kernels on the GPU, run benchmarks/gpu_decode.py, write to $OUT.
#
# Here, before the device call (wheels into the ignored folder device-wheels/, which the call carries):
#   .venv/bin/pip download --no-deps -d device-wheels transformers==5.23.0
# Then, from the device tool, with carry=["device-wheels"] and a timeout that leaves room for a rerun:
#   bash benchmarks/gpu_decode_device.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-decode-out}"
mkdir -p "$OUT"
pip install --quiet --no-deps --no-index device-wheels/*.whl
export PYTHONPATH="$PWD" KVREWRITE_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$OUT/gpu.txt" || true
# Correctness on the device first: the kernels against their dense references, compiled (not interpreted).
python -m pytest -q tests/test_flash_decode.py tests/test_in_place_decode.py -k "not compiles" \
    > "$OUT/tests.txt" 2>&1 || echo "kernel tests failed: see tests.txt"
timeout 420 python benchmarks/gpu_decode.py --out "$OUT/gpu_decode.json" 2>&1 | tee "$OUT/gpu_decode.log"
