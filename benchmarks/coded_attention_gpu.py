"""One decode step of one layer's attention on a CUDA GPU: stock SDPA over a float16 K/V cache against the int4 /
int2 coded cache read two ways, (a) the decode path (dequantise the whole store, then attend) and (b) the fused
Triton kernel (kernels.triton_coded_attention: dequantise each coded block in registers as it attends), once with
one program per (request, KV head) walking the whole cache (`splits=1`) and once split over the sequence
(flash-decoding, the kernel's default `split_count`).

Shapes: SmolLM2-135M's layer (9 query heads, 3 KV heads, head_dim 64) at p = 0.5 with packed (non-latent) keys,
key and value ranks 32 per KV head, batch 8, contexts 2K / 8K / 32K; random data (the cost does not depend on the
values). The fused output is checked against the decode path's before timing. Times: triton.testing.do_bench
(median, CUDA events). Run on the GPU machine:

    python3 benchmarks/coded_attention_gpu.py --out benchmarks/results/coded_attention_gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kvrewrite.runtime.codecs import build_layer_codecs, parse_codec
from kvrewrite.runtime.codecs.cache import CodecLayer
from kvrewrite.runtime.kernels.coded_attention import readout_chunks
from kvrewrite.runtime.kernels.reference import PackedLayout, packed_attention
from kvrewrite.runtime.kernels.triton_coded_attention import split_count, triton_coded_attention

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM, RANK = 8, 9, 3, 64, 32
CODECS = ("int4:group_size=32", "int2:group_size=32")


def coded_readout(codec: str, context: int, device: torch.device):
    """A codec layer filled with `context - 1` random latents, then the readout of one decode step."""
    ranks = [RANK] * KV_HEADS
    layer_codec = build_layer_codecs(parse_codec(codec), [ranks], [ranks])[0]
    layer = CodecLayer(layer_codec, layer_codec.config.residual)
    width = RANK * KV_HEADS
    layer.update(
        torch.randn(BATCH, 1, context - 1, width, device=device),
        torch.randn(BATCH, 1, context - 1, width, device=device),
    )
    return layer.update_coded(
        torch.randn(BATCH, 1, 1, width, device=device), torch.randn(BATCH, 1, 1, width, device=device)
    )


def decode_then_attend(query, readout, layout):
    """The decode path: the whole store dequantised to float32, then attention over it."""
    keys, values = zip(*[(k, v) for _, k, v in readout_chunks(readout, torch.float32, chunk_tokens=1 << 30)])
    keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return packed_attention(query, keys, values, None, HEAD_DIM**-0.5, layout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    layout = PackedLayout((RANK,) * KV_HEADS, (RANK,) * KV_HEADS, Q_HEADS // KV_HEADS)
    rows = []
    for context in map(int, args.contexts.split(",")):
        q16 = torch.randn(BATCH, Q_HEADS, 1, HEAD_DIM, device=device, dtype=torch.float16)
        k16 = torch.randn(BATCH, KV_HEADS, context, HEAD_DIM, device=device, dtype=torch.float16)
        v16 = torch.randn_like(k16)
        stock_ms = do_bench(lambda: F.scaled_dot_product_attention(q16, k16, v16, enable_gqa=True))
        for codec in CODECS:
            readout = coded_readout(codec, context, device)
            query = torch.randn(BATCH, 1, layout.query_offsets[-1], device=device)
            splits = split_count(BATCH * KV_HEADS, readout.coded_blocks, device)
            reference = decode_then_attend(query, readout, layout)
            error = (
                (triton_coded_attention(query, readout, None, HEAD_DIM**-0.5, layout, splits=1) - reference)
                .abs()
                .max()
                .item()
            )
            split_error = (
                (triton_coded_attention(query, readout, None, HEAD_DIM**-0.5, layout, splits=splits) - reference)
                .abs()
                .max()
                .item()
            )
            decode_ms = do_bench(lambda: decode_then_attend(query, readout, layout))
            fused_ms = do_bench(lambda: triton_coded_attention(query, readout, None, HEAD_DIM**-0.5, layout, splits=1))
            split_ms = do_bench(
                lambda: triton_coded_attention(query, readout, None, HEAD_DIM**-0.5, layout, splits=splits)
            )
            rows.append(
                {
                    "name": f"{context} {codec}",
                    "context": context,
                    "codec": codec,
                    "stock_fp16_sdpa_ms": stock_ms,
                    "decode_path_ms": decode_ms,
                    "fused_triton_ms": fused_ms,
                    "fused_vs_decode": decode_ms / fused_ms,
                    "fused_vs_stock": stock_ms / fused_ms,
                    "max_abs_diff_fused_vs_decode": error,
                    "splits": splits,
                    "fused_split_ms": split_ms,
                    "split_vs_decode": decode_ms / split_ms,
                    "split_vs_stock": stock_ms / split_ms,
                    "max_abs_diff_split_vs_decode": split_error,
                }
            )
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "command": "python3 benchmarks/coded_attention_gpu.py --out " + str(args.out),
        "commit": commit or "see note",
        "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {platform.machine()}",
        "date": datetime.date.today().isoformat(),
        "shapes": {
            "batch": BATCH,
            "query_heads": Q_HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "key_and_value_rank_per_kv_head": RANK,
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
