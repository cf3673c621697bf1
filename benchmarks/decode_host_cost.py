"""Host time of each decode kernel's Python wrapper per call: what an eager GPU step spends before each launch.

In eager mode a decode step at small batch runs as fast as the host enqueues it; on the H200 the `freq`,
`post-rope` and MLA steps took 1-3 ms longer than stock's outside their attention kernels at 1 x 32K
(benchmarks/results/gpu_decode_h200.json, 4 layers). Part of a step's host time is the kernel wrappers' own Python:
planning the splits, choosing tiles, allocating outputs and partials. This measures that part without a GPU: each
wrapper runs on CPU tensors of the GPU run's shapes (Llama-3-8B, bf16, allocated but never touched), its Triton
launches replaced by calls that do nothing, and a pretend H200 (132 multiprocessors) for the split plan. Triton's own
launcher and the driver's launch are not in the figures (not measured here); allocations go to the CPU allocator,
not CUDA's caching one; under CUDA graphs none of this runs.

    python benchmarks/decode_host_cost.py --out benchmarks/results/decode_host_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels' wrappers (the interpreter's launch path differs)

from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)
from decode_kernel_sweep import kernel_cases  # noqa: E402
from gpu_decode import GPU_CONFIGS, SHAPES, parse_configs  # noqa: E402

H200_MULTIPROCESSORS = 132


def stub_launches():
    """Every Triton kernel's kernel[grid](...) returns at once: only the wrapper's own Python is timed."""
    from triton.runtime.jit import JITFunction

    JITFunction.__getitem__ = lambda self, grid: lambda *args, **kwargs: None


def pretend_gpu() -> None:
    from kvrewrite.runtime.kernels import flash_decode_splits

    flash_decode_splits.multiprocessor_count = lambda device: H200_MULTIPROCESSORS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=GPU_CONFIGS)
    parser.add_argument("--calls", type=int, default=300, help="calls per timing (the best of 5 timings is kept)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--note", default=None, help="what else ran on the machine (recorded in `machine`)")
    args = parser.parse_args()
    stub_launches()
    pretend_gpu()
    torch.set_num_threads(1)
    record = {
        **run_provenance(1, args.note or "nothing noted"),
        "shape": "llama3-8b (per-head rank 64 of 128; MLA 512 + 64), bf16",
        "what": "host microseconds per call of each decode kernel wrapper, launches stubbed, pretend H200 split plan",
        "results": {},
    }
    print(f"{'kernel':8s} {'batch x context':>16s} {'host us / call':>15s}")
    for batch, context in parse_configs(args.configs):
        cases = kernel_cases(SHAPES["llama3-8b"], batch, context, torch.bfloat16, torch.device("cpu"), small=False,
                             filled=False, live_length=True)  # fmt: skip
        for name, (_module, _tile, _warps, wrapper, _bytes) in cases.items():
            call = lambda wrapper=wrapper: wrapper(None)  # noqa: E731  (the planner's own split count)
            call()  # tables and plans built once, as the first eager step builds them
            seconds = min(timeit.repeat(call, number=args.calls, repeat=5)) / args.calls
            row = {"batch": batch, "context": context, "host_us_per_call": round(seconds * 1e6, 1)}
            record["results"].setdefault(name, []).append(row)
            print(f"{name:8s} {batch:>6d} x {context:<7d} {row['host_us_per_call']:>15.1f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
