"""Decode speed of our absorbed MLA runtime against the stock Llama it replaces, measured in the same run.

  OMP_NUM_THREADS=2 .venv/bin/python benchmarks/mla_decode.py --threads 2     # -> results/mla_decode_cpu.json

Both models are built from a config with random weights (nothing is downloaded):
- stock: transformers' LlamaForCausalLM at SmolLM2-135M's shapes (hidden 576, 9 heads, 3 KV heads, head_dim 64,
  30 layers), sdpa attention, DynamicCache of [B, 3, S, 64] keys and values: 384 values per token per layer;
- mla: transformers' DeepseekV3ForCausalLM at the same hidden size, heads, layers, MLP and vocabulary, shaped as
  kvrewrite's MLA export at 50% of those K+V values (kv_lora_rank 128 + qk_rope_head_dim 64 = 192 per token per
  layer; qk_nope_head_dim = v_head_dim = 64; dense MLP in every layer), with its attention swapped for
  kvrewrite.runtime.mla's absorbed attention; same DynamicCache class, one [B, 1, S, 192] row tensor per layer.

Method (benchmarks/decode.py's): each decode cache is filled with torch.randn tensors of the model's own cache
shapes (prefilling 8K x 8 on 2 CPU cores would take many minutes; attention cost does not depend on the values),
then `steps` single-token forward passes after one warm-up; tokens/s = batch / median step time. Attention time:
wall time of the attention core (stock: transformers' sdpa function; mla: the absorbed scores-softmax-latent sum
and W_uv), summed over layers, median over steps; attention-layer time: the whole self-attention module
(projections, RoPE, cache append, attention, o_proj).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import _timed, run_provenance, timed_decode_steps  # noqa: E402  (the same timer and steps as the per-head decode benchmark)

RESULTS = Path(__file__).parent / "results"
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=16384,
    tie_word_embeddings=True,
)
MLA_WIDTHS = dict(kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64)


def build(name: str):
    """stock / stock-static (the same model; the latter decodes on a preallocated StaticCache) / mla."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    from kvrewrite.runtime.mla.checkpoint import absorb_attention

    torch.manual_seed(0)
    if name.startswith("stock"):
        config = LlamaConfig(head_dim=64, rope_theta=100000.0, **SMOLLM2)
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config).eval()
    config = DeepseekV3Config(
        q_lora_rank=None,
        first_k_dense_replace=SMOLLM2["num_hidden_layers"],
        n_routed_experts=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        **MLA_WIDTHS,
        **SMOLLM2,
    )
    config._attn_implementation = "sdpa"
    return absorb_attention(DeepseekV3ForCausalLM(config)).eval()


def fill_cache(model, name: str, batch: int, context: int, steps: int):
    """The cache a prefill of `context` tokens leaves, filled through the path the model's own forward takes."""
    import torch
    from transformers import DynamicCache, StaticCache

    from kvrewrite.runtime.mla.latent_cache import cache_latent_rows

    cfg = model.config
    # stock-static: room for the warm-up and timed steps, preallocated (transformers' in-place StaticCache).
    cache = (
        StaticCache(config=cfg, max_cache_len=context + steps + 1)
        if name == "stock-static"
        else DynamicCache(config=cfg)
    )
    g = torch.Generator().manual_seed(0)
    for i in range(cfg.num_hidden_layers):
        if name.startswith("stock"):
            shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
            cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), i)
        else:  # the latent rows [c | k_pe], appended as runtime.mla appends them (a growing buffer, in place)
            cache_latent_rows(
                cache, i, torch.randn(batch, 1, context, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g)
            )
    return cache


def measure(name: str, steps: int, configs: list[tuple[int, int]]) -> dict:
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
    from kvrewrite.runtime.mla.attention import AbsorbedMLAAttention

    model = build(name)
    attention_times: list[float] = []
    layer_times: list[float] = []
    timer = (
        _timed(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", attention_times)
        if name.startswith("stock")
        else _timed(AbsorbedMLAAttention, "_absorbed", attention_times)
    )
    starts: dict[int, float] = {}
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda m, a: starts.__setitem__(id(m), time.perf_counter()))
        layer.self_attn.register_forward_hook(lambda m, a, o: layer_times.append(time.perf_counter() - starts[id(m)]))
    record = {"parameters": sum(p.numel() for p in model.parameters()), "decode": []}
    with torch.inference_mode(), timer:
        for context, batch in configs:
            cache = fill_cache(model, name, batch, context, steps)
            cache_bytes = cache_tensor_bytes(cache)
            step_s, attn_s, layer_s = timed_decode_steps(
                model, cache, batch, context, steps, attention_times, layer_times
            )
            del cache
            gc.collect()
            entry = {
                "context": context,
                "batch": batch,
                "steps": steps,
                "step_s": round(statistics.median(step_s), 5),
                "tokens_per_s": round(batch / statistics.median(step_s), 2),
                "attention_s": round(statistics.median(attn_s), 5),
                "attention_layer_s": round(statistics.median(layer_s), 5),
                "cache_bytes": cache_bytes,
            }
            record["decode"].append(entry)
            print(name, entry, flush=True)
    return record


def add_ratios(results: dict) -> None:
    for reference, key in (("stock", "vs_stock"), ("stock-static", "vs_stock_static")):
        if reference not in results:
            continue
        base = {(e["context"], e["batch"]): e for e in results[reference]["decode"]}
        for e in results["mla"]["decode"]:
            b = base[(e["context"], e["batch"])]
            e[key] = {
                k: round(e[k] / b[k], 3) for k in ("tokens_per_s", "attention_s", "attention_layer_s", "cache_bytes")
            }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--configs", nargs="*", default=["512x8", "2048x8", "8192x8"], help="CONTEXTxBATCH")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--out", type=Path, default=RESULTS / "mla_decode_cpu.json")
    parser.add_argument("--models", default="stock,stock-static,mla", help="stock, stock-static and/or mla")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs]

    import torch

    if args.worker:  # one model per process: the other's freed cache does not shape this one's allocations
        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(measure(args.worker, args.steps, configs)))
        return

    results: dict = {}
    record = {
        **run_provenance(args.threads, "the machine may run other jobs; ratios are same-run"),
        "dtype": "float32",
        "models": {
            "stock": "LlamaForCausalLM, SmolLM2-135M shapes, random weights, sdpa; cache K+V = 2 x 3 x 64 = 384 "
            "values per token per layer; DynamicCache (transformers' default: torch.cat per step)",
            "stock-static": "the same stock model decoding on transformers' StaticCache, preallocated for the "
            "context plus the steps (in-place writes; attention over the preallocated length)",
            "mla": f"DeepseekV3ForCausalLM, same hidden/heads/layers/MLP/vocab, {MLA_WIDTHS}, random weights, "
            "attention swapped for kvrewrite.runtime.mla (absorbed); cache 128 + 64 = 192 values per token "
            "per layer (50%), appended in place into a buffer with spare rows (runtime/mla/latent_cache.py)",
        },
        "cache_fill": "caches filled with torch.randn tensors of each model's own cache shapes (no prefill), through "
        "the append path each model's forward uses",
        "attention_s": "stock: transformers' sdpa attention function; mla: AbsorbedMLAAttention._absorbed",
        "results": results,
    }
    args.out.parent.mkdir(exist_ok=True)
    for name in args.models.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--configs",
            *args.configs,
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy()).stdout
        results[name] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        print("measured", name, flush=True)
    add_ratios(results)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(results["mla"]["decode"], indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
