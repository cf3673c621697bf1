#!/usr/bin/env bash
# The GPU decode measurement for a lent GPU machine (torch and triton are there, no index is reachable), in two
# device calls that each fit the device's 10-minute limit per command; the second only if device time is left.
#
# Here, before the device calls (wheels into the ignored folder device-wheels/, which each call carries):
#   .venv/bin/pip download --no-deps -d device-wheels transformers==5.23.0
# Then, from the device tool, with carry=["device-wheels"]:
#   bash benchmarks/gpu_decode_device.sh first    # kernel check, compiled forms, kernel sweep: at most ~9 minutes
#   bash benchmarks/gpu_decode_device.sh second   # every form eager at four sizes, the CUDA tests: at most ~9 minutes
# At most 8 files come back from $OUT: the GPU line heads kernel_check.txt, the benchmarks' logs share logs.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PHASE="${1:-first}"
OUT="${OUT:-/tmp/gpu-decode-out}"
mkdir -p "$OUT"
# `python -m pip`: a bare pip there installs into another Python than the one that runs (the first run measured with
# the machine's transformers 5.17 for that reason).
python -m pip install --quiet --no-deps --no-index device-wheels/*.whl
export PYTHONPATH="$PWD" KVREWRITE_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$PHASE" = first ]; then
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$OUT/kernel_check.txt" || true
    # Correctness on the device first, compiled (not interpreted): every form's decode step through its kernels
    # against the torch path on the GPU.
    timeout 120 python benchmarks/decode_kernel_check.py --out "$OUT/kernel_check.json" >> "$OUT/kernel_check.txt" \
        2>&1 || echo "kernel check failed: see kernel_check.txt"
    # Our forms under CUDA graphs (static caches, compiled forward) beside compiled stock, at one size: never timed
    # yet (the first GPU run's compiled steps failed in inductor; the full tracebacks go to the log).
    timeout 200 python benchmarks/gpu_decode.py --configs 16x8192 \
        --forms stock-static,stock-compiled,freq-compiled,latent-compiled,mla-compiled,int4-compiled \
        --out "$OUT/gpu_decode_compiled.json" > "$OUT/logs.txt" 2>&1 \
        || echo "compiled forms failed or ran out of time: see logs.txt"
    # The attention kernels alone over their launch settings (key block, warps, stages, splits), captured in CUDA
    # graphs, at 64 x 8K (where the bandwidth targets are set) and 16 x 8K.
    timeout 200 python benchmarks/decode_kernel_sweep.py --configs 64x8192,16x8192 \
        --out "$OUT/decode_kernel_sweep.json" >> "$OUT/logs.txt" 2>&1 \
        || echo "kernel sweep failed or ran out of time: the kernels done are in decode_kernel_sweep.json"
elif [ "$PHASE" = second ]; then
    timeout 330 python benchmarks/gpu_decode.py --out "$OUT/gpu_decode.json" > "$OUT/logs.txt" 2>&1 \
        || echo "gpu_decode failed or ran out of time: the configurations done are in gpu_decode.json"
    # The tests that need CUDA: captured steps replayed as the cache grows, generate() capturing the int4 static
    # codec cache's steps by itself, export-mla on CUDA against the CPU export. The other kernel tests build CPU
    # tensors for Triton's interpreter, so they run in CI, not here.
    timeout 90 python -m pytest -q tests/test_flash_decode.py tests/test_flash_decode_coded.py -k "captured" \
        > "$OUT/tests.txt" 2>&1 || echo "CUDA graph tests failed: see tests.txt"
    timeout 90 python -m pytest -q tests/test_static_codec_cache.py -k "captured" >> "$OUT/tests.txt" 2>&1 \
        || echo "static codec capture test failed: see tests.txt"
    timeout 60 python -m pytest -q tests/test_mla_plan.py -k "on_cuda" >> "$OUT/tests.txt" 2>&1 \
        || echo "MLA export on CUDA failed: see tests.txt"
else
    echo "usage: bash benchmarks/gpu_decode_device.sh [first|second]" >&2
    exit 2
fi
