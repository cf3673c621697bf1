"""What this CPU allows the torch decode paths: the measurements behind their choices and the limits they hit.

Run on demand (one torch thread, under a minute, nothing else running):
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_decode_limits.py --out benchmarks/results/cpu_decode_limits.json

At the CPU decode benchmark's shapes (SmolLM2: 30 layers, 9 query and 3 KV heads of 64, batch 8 x 8,192 tokens,
key and value rank 32 at p = 0.5; absorbed MLA rows 128 + 64), the median of --repeats calls of:
- matmul rates: a 1024^3 product (this core's float32 peak as torch reaches it), the latent key rebuild
  [n, 32] @ [32, 64] into a preallocated output, and the MLA score product [8192, 192] @ [192, N] for N = 9
  query heads and for 16 and 32 (how fast the product is when its narrow side is wider);
- a plain read of a 256 MiB tensor (one thread's memory bandwidth);
- the value product of kernels/latent_decode.py both ways round: probs @ V with V the column-major cache's
  transposed block, and V^T @ probs^T;
- taking a prompt's kept columns [8, 8176, 192] by index_select(-1) and by indexing (tiers/cache.take_columns);
- kernels/latent_decode.py on one layer, with the rotary phases (pairs rotated as complex numbers) and without
  (rotate_half on cos/sin), and at tile lengths 256 to 4096.
From the rates it derives the latent form's rebuild time per decode step at those shapes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_decode import PER_HEAD_RATE, SHAPES  # noqa: E402

from kvrewrite.runtime.kernels import latent_decode  # noqa: E402

# The CPU decode benchmark's configuration (gpu_decode.py --shape smollm2 --layers 30 --configs 8x8192), its shapes
# taken from gpu_decode's table.
LAYERS, BATCH, CONTEXT = 30, 8, 8192
_SHAPE = SHAPES["smollm2"]
HEADS, KV_HEADS, HEAD_DIM = _SHAPE["num_attention_heads"], _SHAPE["num_key_value_heads"], _SHAPE["head_dim"]
RANK = int(round(HEAD_DIM * (1 - PER_HEAD_RATE)))
MLA_WIDTH = sum(_SHAPE["mla"])


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch allocations and MKL's first-call set-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def gflops(flop: float, ms: float) -> float:
    return round(flop / ms / 1e6, 1)


def matmul_rates(repeats: int) -> dict:
    out = {}
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    out["square_1024"] = gflops(2 * 1024**3, median_ms(lambda: a @ b, repeats))
    n = CONTEXT
    latent, up, keys = torch.randn(n, RANK), torch.randn(RANK, HEAD_DIM), torch.empty(n, HEAD_DIM)
    out["latent_rebuild_8192x32x64_into_buffer"] = gflops(
        2 * n * RANK * HEAD_DIM, median_ms(lambda: torch.mm(latent, up, out=keys), repeats)
    )
    rows = torch.randn(CONTEXT, MLA_WIDTH)
    for width in (9, 16, 32):
        queries = torch.randn(MLA_WIDTH, width)
        out[f"mla_scores_8192x192x{width}"] = gflops(
            2 * CONTEXT * MLA_WIDTH * width, median_ms(lambda q=queries: rows @ q, repeats)
        )
    return out


def read_bandwidth(repeats: int) -> float:
    x = torch.randn(64 << 20)  # 256 MiB of float32
    return round(x.numel() * 4 / median_ms(lambda: x.sum(), repeats) / 1e6, 1)  # GB/s


def value_products(repeats: int) -> dict:
    store = torch.randn(BATCH, KV_HEADS * RANK, CONTEXT)  # the column-major cache: [B, K, S]
    block = store[:, RANK : 2 * RANK]  # one head's [B, rv, S] rows
    probs = torch.softmax(torch.randn(BATCH, HEADS // KV_HEADS, CONTEXT), dim=-1)
    return {
        "probs_at_v_ms": round(median_ms(lambda: torch.bmm(probs, block.transpose(1, 2)), repeats), 3),
        "vt_at_probs_t_ms": round(median_ms(lambda: torch.bmm(block, probs.transpose(1, 2)), repeats), 3),
    }


def column_takes(repeats: int) -> dict:
    keys = torch.randn(BATCH, 1, CONTEXT, KV_HEADS * HEAD_DIM)
    prompt = keys[:, 0, : CONTEXT - 16]  # what settling an 8K prompt past a 16-token window moves
    columns = torch.arange(KV_HEADS * HEAD_DIM)
    assert torch.equal(prompt.index_select(-1, columns), prompt[..., columns])
    return {
        "index_select_ms": round(median_ms(lambda: prompt.index_select(-1, columns), repeats), 1),
        "indexing_ms": round(median_ms(lambda: prompt[..., columns], repeats), 1),
    }


def latent_layer(repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(BATCH, HEADS, 1, HEAD_DIM, generator=gen)
    keys = torch.randn(BATCH, 1, KV_HEADS * RANK, CONTEXT, generator=gen).transpose(-1, -2)
    values = torch.randn(BATCH, 1, KV_HEADS * RANK, CONTEXT, generator=gen).transpose(-1, -2)
    allowed = torch.ones(1, 1, 1, CONTEXT, dtype=torch.bool)
    up = torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=gen) / 8
    angles = torch.arange(CONTEXT, dtype=torch.float32)[:, None] / 10000 ** (
        torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM
    )
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [S, d]
    phases = torch.complex(angles.cos(), angles.sin())
    ranks = [RANK] * KV_HEADS

    def layer(with_phases: bool):
        return latent_decode.latent_decode_attention(
            queries, keys, values, allowed, 0.125, ranks, ranks, up, cos.T.contiguous(), sin.T.contiguous(),
            phases if with_phases else None,
        )  # fmt: skip

    out = {"pairs_ms": round(median_ms(lambda: layer(True), repeats), 1)}
    out["rotate_half_ms"] = round(median_ms(lambda: layer(False), repeats), 1)
    default_tile = latent_decode.TILE
    try:
        for tile in (256, 512, 1024, 2048, 4096):
            latent_decode.TILE = tile
            out[f"pairs_tile_{tile}_ms"] = round(median_ms(lambda: layer(True), repeats), 1)
    finally:
        latent_decode.TILE = default_tile
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_decode_limits.json")
    parser.add_argument("--note", default="", help="Free text about the machine (recorded as machine_note).")
    args = parser.parse_args()
    torch.manual_seed(0)
    rates = matmul_rates(args.repeats)
    result = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/cpu_decode_limits.py " + shlex.join(sys.argv[1:]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)",
        "machine_note": args.note,
        "gflops": rates,
        "read_GBps": read_bandwidth(args.repeats),
        "latent_value_product": value_products(args.repeats),
        "kept_columns_8x8176x192": column_takes(args.repeats),
        "latent_decode_layer": latent_layer(args.repeats),
    }
    rebuild_flop = 2 * LAYERS * BATCH * CONTEXT * KV_HEADS * RANK * HEAD_DIM
    result["latent_rebuild_per_step"] = {
        "gflop": round(rebuild_flop / 1e9, 1),
        "seconds_at_rebuild_rate": round(rebuild_flop / (rates["latent_rebuild_8192x32x64_into_buffer"] * 1e9), 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
