"""Decode speed with KV codecs: the fused int4/int2 reads against the decode path, beside the plain compressed
model and the stock one, measured in the same run.

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/codec_decode.py          # -> results/codec_decode_cpu.json

Variants, per compressed checkpoint (default /work/ckpt/p50 and /work/ckpt/p32refit):
- `none`: the compressed model's plain cache (a DynamicCache of packed latents);
- `CODEC decode`: a CodecCache with read_mode "decode", the reference path (update() decodes the whole coded
  store and appends the float16 window, every layer, every step); this is what every codec did before;
- `CODEC fused`: read_mode "fused": attention reads the packed int4/int2 blocks chunk by chunk
  (kernels.coded_attention). Only codecs with a fused layout have this row.
and the stock model (transformers' SmolLM2-135M, sdpa, DynamicCache) at the same contexts.

Method (benchmarks/decode.py's): every cache is filled with torch.randn tensors of the model's own cache shapes
(codec caches: the random latents go through the codec's encode, as one update per layer; attention cost does not
depend on the values), then decode.timed_decode_steps runs `steps` single-token forward passes after one
warm-up. On a shared machine the load drifts, so the variants of one (checkpoint, context, batch) take turns:
`rounds` rounds, each variant's steps in one go, the order reversed every other round; tokens/s = batch / median
step time over all its rounds' steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from decode import _fill_cache, run_provenance, timed_decode_steps  # noqa: E402  (the same cache fill and steps as decode.py)

RESULTS = Path(__file__).parent / "results"
CHECKPOINTS = {
    "p50": ("/work/ckpt/p50", ["int4", "int2", "gear"]),
    # every codec at its defaults (gear and csr as their papers; tada at 4 bits everywhere; csr with the
    # dictionaries given by --csr-tables, fitted for this checkpoint's compiled rate)
    "p50-every": ("/work/ckpt/p50", ["int4", "int2", "gear", "gear-l", "tada", "csr"]),
    "p32refit": ("/work/ckpt/p32refit", ["int4:group_size=128", "int2:group_size=128"]),
}


def fill_codec_cache(model, codec_cache, batch: int, context: int) -> None:
    """Random packed latents [B, 1, S, C] through each layer's codec (one update codes every whole block)."""
    import torch

    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        keys = torch.randn(batch, 1, context, sum(attn.key_ranks), generator=g)
        values = torch.randn(batch, 1, context, sum(attn.value_ranks), generator=g)
        codec_cache.update(keys, values, i)


CSR_TABLES: list[Path] = []  # --csr-tables


def timing_tables(codec: str, model) -> dict:
    """Tables a trained codec needs to run; a step's cost does not depend on their values. tada: 4 bits for every
    layer and side; csr: the dictionaries of --csr-tables (their shapes must fit the model's ranks)."""
    import torch
    from safetensors.torch import load_file

    name = codec.split(":")[0]
    if name == "tada":
        return {"tada.bits": torch.full((len(model.model.layers), 2), 4, dtype=torch.int32)}
    if name == "csr":
        if not CSR_TABLES:
            raise SystemExit("csr needs --csr-tables FILE (e.g. benchmarks/csr_faithful.py's fitted dictionaries)")
        return load_file(str(CSR_TABLES[0]))
    return {}


def variants_for(name: str, batch: int, context: int):
    """(label, model, cache) of one checkpoint at one size."""
    import torch

    import kvrewrite
    from kvrewrite.runtime.codecs import parse_codec

    directory, codecs = CHECKPOINTS[name]
    model = kvrewrite.load(directory, kv_codec="none").eval()
    out = [("none", model, _fill_cache(model, batch, context, stock=False)[0])]
    for codec in codecs:
        coded = kvrewrite.load(directory, kv_codec="none").eval()
        coded.set_kv_codec(codec, timing_tables(codec, coded))
        modes = ["decode", "fused"] if coded.make_kv_cache().reads_coded(0) else ["decode"]
        for mode in modes:
            cache = coded.make_kv_cache()
            cache.read_mode = mode
            with torch.inference_mode():
                fill_codec_cache(coded, cache, batch, context)
            out.append((f"{parse_codec(codec).describe()} {mode}", coded, cache))
    return out


def run_rounds(variants, batch: int, steps: int, rounds: int) -> dict:
    import torch

    from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

    times: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    bytes_before = {label: cache_tensor_bytes(cache) for label, _, cache in variants}
    with torch.inference_mode():
        for r in range(rounds):
            for label, model, cache in variants if r % 2 == 0 else variants[::-1]:
                step_s, _, _ = timed_decode_steps(model, cache, batch, cache.get_seq_length(0), steps, [], [])
                times[label] += step_s
    return {
        label: {
            "steps": len(t),
            "step_s": round(statistics.median(t), 5),
            "tokens_per_s": round(batch / statistics.median(t), 3),
            "cache_bytes": bytes_before[label],
        }
        for label, t in times.items()
    }


def summarize(record: dict) -> None:
    """One `summary` record per (checkpoint, context, batch, codec): tokens/s of the decode and fused paths beside
    the plain compressed model and stock, and their ratios (what docs/codecs.md quotes)."""
    sizes: dict[tuple, dict[str, dict]] = {}
    for entry in record["results"]:
        sizes.setdefault((entry["checkpoint"], entry["context"], entry["batch"]), {})[entry["variant"]] = entry
    summary = []
    for (checkpoint, context, batch), variants in sizes.items():
        stock, none = variants["stock"]["tokens_per_s"], variants["none"]["tokens_per_s"]
        codecs = dict.fromkeys(label.rsplit(" ", 1)[0] for label in variants if label not in ("stock", "none"))
        for codec in codecs:
            decode = variants[f"{codec} decode"]["tokens_per_s"]
            fused = variants.get(f"{codec} fused", {}).get("tokens_per_s")
            summary.append(
                {
                    "name": f"{checkpoint} {context}x{batch} {codec}",
                    "checkpoint": checkpoint,
                    "context": context,
                    "batch": batch,
                    "codec": codec,
                    "stock_tokens_per_s": stock,
                    "none_tokens_per_s": none,
                    "decode_tokens_per_s": decode,
                    "fused_tokens_per_s": fused,
                    "decode_vs_stock": round(decode / stock, 2),
                    "decode_vs_none": round(decode / none, 2),
                    "fused_vs_stock": round(fused / stock, 2) if fused else None,
                    "fused_vs_none": round(fused / none, 2) if fused else None,
                    "fused_vs_decode": round(fused / decode, 2) if fused else None,
                    "none_vs_stock": round(none / stock, 2),
                    "coded_bytes_vs_none": round(
                        variants[f"{codec} decode"]["cache_bytes"] / variants["none"]["cache_bytes"], 3
                    ),
                }
            )
    record["summary"] = summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="*", default=["2048x1", "8192x1", "2048x8"], help="CONTEXTxBATCH")
    parser.add_argument("--checkpoints", nargs="*", default=list(CHECKPOINTS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "codec_decode_cpu.json")
    parser.add_argument("--summarize-only", action="store_true", help="recompute `summary` of an existing --out")
    parser.add_argument("--csr-tables", type=Path, help="csr dictionaries for the checkpoint's compiled rate")
    args = parser.parse_args()
    if args.csr_tables:
        CSR_TABLES.append(args.csr_tables)
    if args.summarize_only:
        record = json.loads(args.out.read_text())
        summarize(record)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        return

    import torch
    from transformers import AutoModelForCausalLM

    from kvrewrite.io.sources import resolve_model_source

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    results: list[dict] = []
    record = {
        **run_provenance(
            threads,
            "the machine may run other jobs; variants of one size take turns, so ratios within a size are same-run",
        ),
        "dtype": "float32",
        "checkpoints": {
            name: {"directory": d, "codecs": c} for name, (d, c) in CHECKPOINTS.items() if name in args.checkpoints
        },
        "cache_fill": "torch.randn latents of each model's own cache shapes; codec caches code them with the codec",
        "method": f"decode.timed_decode_steps, {args.steps} steps after a warm-up per turn, {args.rounds} turns per "
        "variant (order reversed every other turn); tokens/s = batch / median step time",
        "results": results,
    }
    stock = AutoModelForCausalLM.from_pretrained(
        resolve_model_source("smollm2-135m").path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    started = time.perf_counter()
    for config in args.configs:
        context, batch = (int(x) for x in config.split("x"))
        for name in args.checkpoints:
            variants = [("stock", stock, _fill_cache(stock, batch, context, stock=True)[0])]
            variants += variants_for(name, batch, context)
            measured = run_rounds(variants, batch, args.steps, args.rounds)
            base = measured["stock"]["tokens_per_s"]
            for label, entry in measured.items():
                entry["vs_stock"] = round(entry["tokens_per_s"] / base, 3)
                results.append({"checkpoint": name, "context": context, "batch": batch, "variant": label, **entry})
                print(name, context, batch, label, entry, flush=True)
            del variants
            record["seconds"] = round(time.perf_counter() - started, 1)
            summarize(record)
            args.out.write_text(json.dumps(record, indent=1) + "\n")  # after every size: a cut-off run keeps its data
    print("wrote", args.out)


if __name__ == "__main__":
    main()
