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
import datetime
import json
import os
import platform
import subprocess
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels' wrappers (the interpreter's launch path differs)

from gpu_decode import GPU_CONFIGS, SHAPES, parse_configs  # noqa: E402

H200_MULTIPROCESSORS = 132


def stub_launches():
    """Every Triton kernel's kernel[grid](...) returns at once: only the wrapper's own Python is timed."""
    from triton.runtime.jit import JITFunction

    JITFunction.__getitem__ = lambda self, grid: lambda *args, **kwargs: None


def pretend_gpu() -> None:
    from kvrewrite.runtime.kernels import flash_decode_splits

    flash_decode_splits.multiprocessor_count = lambda device: H200_MULTIPROCESSORS


def wrappers(shape: dict, batch: int, context: int, dtype: torch.dtype) -> dict:
    """{kernel: a call of its wrapper} at the GPU run's per-head rank (half the head dim) and MLA widths."""
    from kvrewrite.runtime.kernels.flash_decode_latent import latent_flash_decode
    from kvrewrite.runtime.kernels.flash_decode_mla import mla_flash_decode
    from kvrewrite.runtime.kernels.flash_decode_packed import packed_flash_decode
    from kvrewrite.runtime.kernels.reference import PackedLayout

    heads, n_kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    rank = d // 2
    layout = PackedLayout((rank,) * n_kv, (rank,) * n_kv, heads // n_kv)
    s_cap = context + 16
    keys = torch.empty(batch, s_cap, rank * n_kv, dtype=dtype)
    values = torch.empty_like(keys)
    allowed = torch.ones(batch, s_cap, dtype=torch.bool)
    kv_len = torch.tensor([context])
    query = torch.empty(batch, heads * rank, dtype=dtype)
    rotated = torch.empty(batch, heads * d, dtype=dtype)
    up = torch.empty(n_kv, d, d, dtype=dtype)
    cos = torch.empty(s_cap, d, dtype=dtype)
    latent, rope = shape["mla"]
    rows = torch.empty(batch, s_cap, latent + rope, dtype=dtype)
    q_rows = torch.empty(batch, heads, latent + rope, dtype=dtype)
    return {
        "packed (freq, post-rope)": lambda: packed_flash_decode(query, keys, values, allowed, kv_len, 0.1, layout),
        "latent": lambda: latent_flash_decode(rotated, keys, values, allowed, kv_len, 0.1, layout, up, cos, cos),
        "mla": lambda: mla_flash_decode(q_rows, rows, allowed, kv_len, 0.1, latent),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=GPU_CONFIGS)
    parser.add_argument("--calls", type=int, default=300, help="calls per timing (the best of 5 timings is kept)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--note", default=None, help="recorded as machine_note (e.g. what else ran on the machine)")
    args = parser.parse_args()
    stub_launches()
    pretend_gpu()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    record = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit.stdout.strip() or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 torch thread",
        "shape": "llama3-8b (per-head rank 64 of 128; MLA 512 + 64), bf16",
        **({"machine_note": args.note} if args.note else {}),
        "what": "host microseconds per call of each decode kernel wrapper, launches stubbed, pretend H200 split plan",
        "results": {},
    }
    print(f"{'kernel':26s} {'batch x context':>16s} {'host us / call':>15s}")
    for batch, context in parse_configs(args.configs):
        for name, call in wrappers(SHAPES["llama3-8b"], batch, context, torch.bfloat16).items():
            call()  # tables and plans built once, as the first eager step builds them
            seconds = min(timeit.repeat(call, number=args.calls, repeat=5)) / args.calls
            row = {"batch": batch, "context": context, "host_us_per_call": round(seconds * 1e6, 1)}
            record["results"].setdefault(name, []).append(row)
            print(f"{name:26s} {batch:>6d} x {context:<7d} {row['host_us_per_call']:>15.1f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
