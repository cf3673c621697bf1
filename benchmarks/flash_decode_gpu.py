"""Each flash-decoding kernel alone on a GPU: checked against a dense torch reference, then timed, as achieved
memory bandwidth against the device-to-device copy rate measured in the same run.

One decoder layer's attention at Llama-3-8B shapes (8 KV heads, 32 query heads, head_dim 128), p = 0.5 for the
per-head forms (key and value rank 64 per KV head), MLA 512 + 64 with 32 heads, the int4 KIVI store at the same
ranks (blocks of 32 tokens); batch x context 1 x 32K, 16 x 8K, 64 x 8K, 8 x 32K; bf16, random data. Bytes counted are
the fewest a kernel must read (its cache slots, queries, the latent kernel's cos/sin half rows, the codec's scales)
plus its output; caches smaller than ROTATE_BYTES are replicated and rotated so repeated calls do not run from L2.

  PYTHONPATH=. python benchmarks/flash_decode_gpu.py            # on a GPU, about a minute; writes the result file
  TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/flash_decode_gpu.py --small   # CPU: tiny shapes, end to end

Writes benchmarks/results/flash_decode_gpu.json (not with --small). The whole-model decode speed against stock
transformers is benchmarks/gpu_decode.py's job; this isolates the kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvrewrite.runtime.codecs.kivi import kivi_decode, kivi_encode
from kvrewrite.runtime.codecs.readout import QuantizedBlocks
from kvrewrite.runtime.kernels.flash_decode_coded import coded_flash_decode
from kvrewrite.runtime.kernels.flash_decode_latent import latent_flash_decode
from kvrewrite.runtime.kernels.flash_decode_mla import mla_flash_decode
from kvrewrite.runtime.kernels.flash_decode_packed import packed_flash_decode
from kvrewrite.runtime.kernels.reference import PackedLayout, packed_attention

RESULT = Path(__file__).parent / "results" / "flash_decode_gpu.json"
ROTATE_BYTES = 512 << 20
SHAPES = [(1, 32768), (16, 8192), (64, 8192), (8, 32768)]
SMALL_SHAPES = [(2, 40)]


def _time(fn, repeats: int) -> float:
    """Median seconds of one call (CUDA events around each call after a warm-up; host clock on CPU)."""
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second of a large device-to-device copy: the ceiling the kernels are held to."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / seconds


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _rope(s_cap: int, head_dim: int, device, dtype):
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.arange(s_cap, device=device, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def run_form(form: str, batch: int, context: int, small: bool, device, repeats: int) -> dict:
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    n_kv, group, head_dim, rank = (2, 2, 32, 16) if small else (8, 4, 128, 64)
    heads = n_kv * group
    layout = PackedLayout((rank,) * n_kv, (rank,) * n_kv, group)
    ks = vs = rank * n_kv
    allowed = torch.ones(batch, context, dtype=torch.bool, device=device)
    kv_len = torch.tensor([context], device=device)
    scaling = head_dim**-0.5

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if form in ("packed", "latent"):
        one = batch * context * (ks + vs) * 2
        copies = max(1, min(8, ROTATE_BYTES // one))
        caches = [randn(batch, context, ks + vs) for _ in range(copies)]
        if form == "packed":
            query = randn(batch, layout.query_offsets[-1])
            calls = [
                lambda c=c: packed_flash_decode(query, c[..., :ks], c[..., ks:], allowed, kv_len, scaling, layout)
                for c in caches
            ]
            c = caches[0][:1]
            ref = packed_attention(
                query[:1, None].float(), c[:, None, :, :ks].float(), c[:, None, :, ks:].float(), None, scaling, layout
            )[:, 0]
            read = one + query.numel() * 2
            out_bytes = batch * layout.output_offsets[-1] * 2
        else:
            query = randn(batch, heads * head_dim)
            k_up = randn(n_kv, head_dim, head_dim) * head_dim**-0.5
            cos, sin = _rope(context, head_dim, device, dtype)
            calls = [
                lambda c=c: latent_flash_decode(
                    query, c[..., :ks], c[..., ks:], allowed, kv_len, scaling, layout, k_up, cos, sin
                )
                for c in caches
            ]
            c = caches[0][:1].float()
            keys = []
            for g in range(n_kv):
                k = c[..., g * rank : (g + 1) * rank] @ k_up[g, :rank].float()
                half = head_dim // 2
                rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
                keys.append(k * cos.float() + rotated * sin.float())
            dense_keys = torch.cat(keys, dim=-1)  # [1, S, n_kv * d]: an equal-rank packed layout of width d
            ref = packed_attention(
                query[:1, None].float(),
                dense_keys[:, None],
                c[:, None, :, ks:],
                None,
                scaling,
                PackedLayout((head_dim,) * n_kv, (rank,) * n_kv, group),
            )[:, 0]
            read = one + query.numel() * 2 + k_up.numel() * 2 + 2 * context * (head_dim // 2) * 2
            out_bytes = batch * layout.output_offsets[-1] * 2
    elif form == "mla":
        r, dr = (32, 16) if small else (512, 64)
        one = batch * context * (r + dr) * 2
        copies = max(1, min(8, ROTATE_BYTES // one))
        caches = [randn(batch, context, r + dr) for _ in range(copies)]
        query = randn(batch, heads, r + dr)
        calls = [lambda c=c: mla_flash_decode(query, c, allowed, kv_len, scaling, r) for c in caches]
        c = caches[0][:1].float()
        ref = torch.softmax(query[:1].float() @ c.transpose(1, 2) * scaling, dim=-1) @ c[..., :r]
        read = one + query.numel() * 2
        out_bytes = batch * heads * r * 2
    else:  # int4 KIVI
        block = 16 if small else 32
        blocks = QuantizedBlocks(4, block, block)
        n_blocks, window = context // block, 0
        x = torch.randn(batch, n_blocks, block, ks, generator=gen, device=device)
        keys = kivi_encode(x, "key", 4, block)
        values = kivi_encode(x.flip(-1), "value", 4, block)
        key_window = torch.zeros(batch, max(window, 1), ks, dtype=torch.float16, device=device)
        value_window = torch.zeros_like(key_window)
        query = randn(batch, layout.query_offsets[-1])
        counts = torch.tensor([n_blocks], device=device), torch.tensor([window], device=device)
        one = sum(t.numel() * t.element_size() for t in (*keys.values(), *values.values()))
        calls = [
            lambda: coded_flash_decode(
                query, blocks, keys, values, key_window, value_window, allowed, *counts, scaling, layout
            )
        ]
        dense_k = kivi_decode({n: t[:1] for n, t in keys.items()}, "key", 4, block, block, ks).reshape(1, -1, ks)
        dense_v = kivi_decode({n: t[:1] for n, t in values.items()}, "value", 4, block, block, vs).reshape(1, -1, vs)
        ref = packed_attention(query[:1, None].float(), dense_k[:, None], dense_v[:, None], None, scaling, layout)[:, 0]
        read = one + query.numel() * 2
        out_bytes = batch * layout.output_offsets[-1] * 2
    error = _rel_error(calls[0]()[:1], ref)
    turn = iter(range(1 << 30))
    seconds = _time(lambda: calls[next(turn) % len(calls)](), repeats)
    moved = read + out_bytes
    return {
        "form": form,
        "batch": batch,
        "context": context,
        "relative_error_vs_fp32_torch": round(error, 6),
        "seconds": seconds,
        "bytes": moved,
        "bandwidth_bytes_per_s": moved / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1 works)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no GPU: run with --small under TRITON_INTERPRET=1")
    shapes = SMALL_SHAPES if args.small else SHAPES
    peak = _copy_bandwidth(device)
    rows = []
    for batch, context in shapes:
        for form in ("packed", "latent", "mla", "int4"):
            row = run_form(form, batch, context, args.small, device, 1 if args.small else args.repeats)
            row["share_of_copy_bandwidth"] = row["bandwidth_bytes_per_s"] / peak
            rows.append(row)
            print(
                f"{form:>7} {batch:>3} x {context:>6}: {row['seconds'] * 1e6:9.1f} us "
                f"{row['bandwidth_bytes_per_s'] / 1e12:6.2f} TB/s ({row['share_of_copy_bandwidth']:.0%} of copy)"
                f"  rel. error {row['relative_error_vs_fp32_torch']:.1e}",
                flush=True,
            )
            assert row["relative_error_vs_fp32_torch"] < 2e-2, row
    if args.small:
        return
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    RESULT.write_text(
        json.dumps(
            {
                "command": " ".join(["python", *sys.argv]),
                "commit": commit,
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                "machine": {
                    "gpu": torch.cuda.get_device_name(device),
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                },
                "copy_bandwidth_bytes_per_s": peak,
                "results": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
