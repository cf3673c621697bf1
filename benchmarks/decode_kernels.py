"""One decode step of one SmolLM2 layer's attention on CPU: stock SDPA against the packed-cache routes.

Run on demand (take the machine lock; ~1 GB, under a minute):
  flock /tmp/kvrewrite-heavy.lock .venv/bin/python benchmarks/decode_kernels.py

Writes benchmarks/results/decode_kernels_cpu.json. Shapes: batch 8, context 8192, 9 query heads, 3 KV heads,
head_dim 64, fp32, one torch thread, median of --repeats calls. Random data (attention cost does not depend
on the values). Rank mixes at p = 0.5 are real layers of the greedy SmolLM2 checkpoints (freq layer 0,
post-rope layers 1 and 3).

Why it exists: it is the evidence for the cache's memory order (kernels/cache_layout.py). On the
token-major packed rows every torch kernel that reads one head's columns (SDPA over a strided view,
per-head bmm) runs well below memory speed, and the whole-row block-diagonal GEMM wastes n_kv x flops;
column-major storage makes each head's keys one contiguous [r, S] block and a head one plain GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvrewrite.runtime.kernels.buckets import BucketedAttention
from kvrewrite.runtime.kernels.cache_layout import COLUMNS, ROWS, packed_view, to_storage
from kvrewrite.runtime.kernels.reference import PackedLayout

RESULTS = Path(__file__).parent / "results"
BATCH, CONTEXT, KV_HEADS, GROUP, HEAD_DIM = 8, 8192, 3, 3, 64
RANK_MIXES = {
    "p=0 (3 x 64 / 3 x 64)": ((64, 64, 64), (64, 64, 64)),
    "freq p=0.5 layer 0": ((60, 38, 56), (6, 10, 3)),
    "post-rope p=0.5 layer 1": ((18, 25, 25), (56, 7, 56)),
    "post-rope p=0.5 layer 3": ((21, 23, 16), (61, 37, 49)),
}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def _packed(layout: PackedLayout, order: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query = torch.randn(BATCH, 1, sum(layout.key_ranks) * GROUP, generator=g)
    key = to_storage(torch.randn(BATCH, CONTEXT, sum(layout.key_ranks), generator=g), order).contiguous()
    value = to_storage(torch.randn(BATCH, CONTEXT, sum(layout.value_ranks), generator=g), order).contiguous()
    return query, packed_view(key), packed_view(value)


def measure(repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows: list[dict] = []

    def add(what: str, ms: float, cache_elements: int) -> None:
        rows.append({"what": what, "ms": ms, "cache_elements_per_token": cache_elements})
        print(f"{what:78s} {ms:8.3f} ms", flush=True)

    stock_k = torch.randn(BATCH, KV_HEADS, CONTEXT, HEAD_DIM, generator=g)
    stock_v = torch.randn(BATCH, KV_HEADS, CONTEXT, HEAD_DIM, generator=g)
    q = torch.randn(BATCH, KV_HEADS * GROUP, 1, HEAD_DIM, generator=g)
    full = 2 * KV_HEADS * HEAD_DIM
    add(
        "stock SDPA, enable_gqa (what transformers runs at decode)",
        _median_ms(lambda: F.scaled_dot_product_attention(q, stock_k, stock_v, scale=scale, enable_gqa=True), repeats),
        full,
    )
    q_grouped = q.view(BATCH, KV_HEADS, GROUP, HEAD_DIM)
    add(
        "stock SDPA, GQA as query rows [B, 3, 3, 64]",
        _median_ms(lambda: F.scaled_dot_product_attention(q_grouped, stock_k, stock_v, scale=scale), repeats),
        full,
    )
    packed_rows = torch.randn(BATCH, CONTEXT, KV_HEADS * HEAD_DIM, generator=g)
    strided = packed_rows.view(BATCH, CONTEXT, KV_HEADS, HEAD_DIM).transpose(1, 2)  # [B, 3, S, 64] view of rows
    add(
        "token-major packed rows, p=0: SDPA on the strided [B, 3, S, 64] view",
        _median_ms(lambda: F.scaled_dot_product_attention(q_grouped, strided, strided, scale=scale), repeats),
        full,
    )
    for name, (key_ranks, value_ranks) in RANK_MIXES.items():
        layout = PackedLayout(key_ranks, value_ranks, GROUP)
        runner = BucketedAttention(layout)
        elements = sum(key_ranks) + sum(value_ranks)
        for order, route in (
            (ROWS, "token-major rows, block-diagonal GEMM"),
            (COLUMNS, "column-major, per-head GEMMs"),
        ):
            query, key, value = _packed(layout, order, g)
            add(f"{name}: {route}", _median_ms(lambda: runner(query, key, value, None, scale), repeats), elements)
    # The DynamicCache's per-step torch.cat of one layer's keys, for scale.
    new_rows = torch.randn(BATCH, 1, 1, KV_HEADS * HEAD_DIM)
    stored_rows = packed_rows.unsqueeze(1)
    add(
        "DynamicCache torch.cat of one layer's keys, token-major rows [B, 1, S, 192]",
        _median_ms(lambda: torch.cat([stored_rows, new_rows], dim=-2), repeats),
        full,
    )
    stored_columns = to_storage(packed_rows, COLUMNS).contiguous()
    new_columns = torch.randn(BATCH, KV_HEADS * HEAD_DIM, 1, 1)
    add(
        "DynamicCache torch.cat of one layer's keys, column-major [B, 192, S, 1]",
        _median_ms(lambda: torch.cat([stored_columns, new_columns], dim=-2), repeats),
        full,
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.repeats)
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        "1 torch thread; machine shared with other jobs",
        "shapes": {
            "batch": BATCH,
            "context": CONTEXT,
            "kv_heads": KV_HEADS,
            "group": GROUP,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "repeats": args.repeats,
        },
        "results": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    target = RESULTS / "decode_kernels_cpu.json"
    target.write_text(json.dumps(record, indent=1))
    print("wrote", target)


if __name__ == "__main__":
    main()
