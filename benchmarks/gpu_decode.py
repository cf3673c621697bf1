"""Decode speed of every cache form against stock transformers, in one run: tokens/s, cache bytes, attention bandwidth.

Models are built from a config with random weights (nothing is downloaded): right for speed and memory, never for
quality. Every cache is filled with random tensors of the form's own cache shapes through the cache's own update
(a prefill of the context's length would cost minutes and attention time does not depend on the values), then
`--steps` single-token decode steps are timed after warm-up (CUDA-synchronised), median.

  # the GPU measurement (Llama-3-8B shapes, 4 decoder layers, bf16):
  python benchmarks/gpu_decode.py --out benchmarks/results/gpu_decode_h100.json
  # the CPU targets (SmolLM2-135M shapes, fp32, 8K x 8):
  OMP_NUM_THREADS=1 python benchmarks/gpu_decode.py --device cpu --shape smollm2 --configs 8x8192 --steps 5
  # end to end on CPU in CI-sized shapes (not run in CI):
  python benchmarks/gpu_decode.py --small
  # the GPU run's bounds, without a GPU: the bytes each step reads at Llama-3-8B shapes, nothing timed:
  python benchmarks/gpu_decode.py --device cpu --dtype bf16 --configs 1x32768,16x8192,64x8192,8x32768 --bytes-only

Forms (`--forms`):
- stock-static: transformers' LlamaForCausalLM on its StaticCache, eager (sdpa): the baseline every ratio uses;
- stock-compiled: the same under torch.compile (mode reduce-overhead, i.e. CUDA graphs, on CUDA; default on CPU);
- stock-dynamic: the same on a DynamicCache (what generate() uses by default);
- freq / post-rope / latent: kvrewrite per-head forms at p = 0.5 (key and value rank half the head dim on every KV
  head), on the cache kvrewrite's generate() builds (runtime.inplace_cache, sized for the run);
- mla: DeepseekV3 with kvrewrite's absorbed attention (runtime.mla), latent + RoPE widths per shape;
- int4: the per-head `freq` form at full rank (p = 0) with the int4 codec (KIVI blocks read in place);
- FORM-compiled for freq, post-rope, latent, mla and int4 (only when named in --forms: each compiles per
  configuration, minutes a default device run cannot spare): the form on a static cache (transformers' StaticCache;
  for int4 its own, runtime.codecs.static_cache) under torch.compile, mode reduce-overhead (CUDA graphs) on CUDA,
  as `cache_implementation="static"` with a compiled forward runs it;
- evict: the frontier's re-scored eviction recipe at about a quarter of the original's bytes
  (`kvrewrite-W16-evict0.57-k8v4`, benchmarks/frontier/kvrewrite_recipes.py: the `latent` form at full rank, a
  16-token full-rank window, beyond it 57% of the tokens kept with 8-bit keys and 4-bit values); its cache is
  filled through the layer's update and settle, the kept tokens chosen by random scores.
Attention time is the wall time of each form's attention call (stock: the sdpa function; per-head: the packed or
latent attention; mla: the absorbed attention), CUDA events on a GPU; its bandwidth is the bytes of the filled
cache that call must read over that time.

A step also reads every weight of the model once (all but the input embedding's table, of which it reads a row per
token), whatever the cache holds. `bytes_bound_vs_stock_static` is stock's step bytes (weights + cache) over the
form's: the most tokens/s over stock a form can gain by reading fewer bytes, at equal bandwidth. With 4 decoder
layers of Llama-3-8B under its full 128K-word output head, the head alone is over a third of a step's weights
(128,256 x 4,096 bf16 numbers, of the 2,795,577,856 bytes of weights stock's step reads in
benchmarks/results/gpu_decode_bytes_bound.json).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    # Llama-3-8B's decoder (the layer count is --layers: attention cost per layer is what is compared).
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        mla=(512, 64),
    ),
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        mla=(128, 64),
    ),
}
FORMS = ("stock-static", "stock-compiled", "stock-dynamic", "freq", "post-rope", "latent", "mla", "int4", "evict")
OPT_IN_FORMS = tuple(f"{form}-compiled" for form in ("freq", "post-rope", "latent", "mla", "int4"))
PER_HEAD_RATE = 0.5
# The frontier's best recipe at about 25% of the original's bytes (fp16 counting, as the frontier counts them).
EVICT_RECIPE = {"name": "kvrewrite-W16-evict0.57-k8v4", "window": 16, "keep": 0.57, "bits": (8, 4)}
GPU_CONFIGS = "1x32768,16x8192,64x8192,8x32768"
# Nominal memory bandwidth (bytes/s) of the parts the lent machines have, for the "share of peak" column.
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def parse_configs(text: str) -> list[tuple[int, int]]:
    """'16x8192,64x8192' -> [(batch, context), ...]"""
    configs = []
    for item in text.split(","):
        batch, context = item.lower().split("x")
        configs.append((int(batch), int(context)))
    return configs


# ---- models -------------------------------------------------------------------------------------------------------
def llama_config(shape: dict, layers: int):
    from transformers import LlamaConfig

    fields = {k: v for k, v in shape.items() if k != "mla"}
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=131072, tie_word_embeddings=False, **fields)
    config._attn_implementation = "sdpa"
    return config


def per_head_spec(config, mode: str):
    """A kvrewrite spec with every layer in `mode` at full rank (the weights' layout); ranks are cut after building."""
    from kvrewrite.key_modes import key_mode
    from kvrewrite.spec import CompressionSpec, LayerSpec

    n_kv, d = config.num_key_value_heads, config.head_dim
    order = [list(range(d // 2)) for _ in range(n_kv)] if mode == "freq" else None
    layers = [
        LayerSpec(mode, key_mode(mode).full_key_ranks(n_kv, d), [d] * n_kv, order)
        for _ in range(config.num_hidden_layers)
    ]
    return CompressionSpec(
        source_model="random",
        source_revision=None,
        base_model_type="llama",
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=n_kv,
        head_dim=d,
        objective="optimal",
        allocation="uniform",
        target_rate=0.0,
        layers=layers,
    )


def base_form(form: str) -> str:
    """The form a compiled variant runs ("latent-compiled" -> "latent"); stock's own names stay."""
    return form if form.startswith("stock") else form.removesuffix("-compiled")


def build_model(form: str, shape: dict, layers: int, device: torch.device, dtype: torch.dtype):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaForCausalLM

    import kvrewrite  # noqa: F401  (registers the compressed model types)
    from kvrewrite.runtime.mla.checkpoint import absorb_attention
    from kvrewrite.runtime.modeling.families import COMPRESSED_FAMILIES

    form = base_form(form)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init straight in the measured dtype, on the device
    try:
        with torch.device(device):
            config = llama_config(shape, layers)
            if form.startswith("stock"):
                return LlamaForCausalLM(config).eval()
            if form == "mla":
                rank, rope = shape["mla"]
                d = shape["head_dim"]
                mla = DeepseekV3Config(
                    hidden_size=shape["hidden_size"],
                    intermediate_size=shape["intermediate_size"],
                    num_attention_heads=shape["num_attention_heads"],
                    num_key_value_heads=shape["num_attention_heads"],
                    num_hidden_layers=layers,
                    vocab_size=shape["vocab_size"],
                    q_lora_rank=None,
                    kv_lora_rank=rank,
                    qk_rope_head_dim=rope,
                    qk_nope_head_dim=d,
                    v_head_dim=d,
                    first_k_dense_replace=layers,
                    n_routed_experts=1,
                    n_group=1,
                    topk_group=1,
                    num_experts_per_tok=1,
                    rope_interleave=True,
                    max_position_embeddings=131072,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
                )
                mla._attn_implementation = "sdpa"
                return absorb_attention(DeepseekV3ForCausalLM(mla)).eval()
            spec = per_head_spec(config, {"int4": "freq", "evict": "latent"}.get(form, form))
            config_class, model_class = COMPRESSED_FAMILIES["kvrewrite_llama"]
            fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")}
            model = model_class(config_class(**fields, kvrewrite=spec.to_dict())).eval()
    finally:
        torch.set_default_dtype(previous)
    if form == "int4":  # full-rank latents, coded
        model.set_kv_codec("int4")
        return model
    d, n_kv = config.head_dim, config.num_key_value_heads
    if form == "evict":  # full rank (the recipe's rate 0), the eviction policy in place of cut ranks
        model.tier_policy = evict_policy(n_kv, d, layers)
    else:
        rank = int(round(d * (1 - PER_HEAD_RATE)))
        model.set_ranks([[rank] * n_kv] * layers, [[rank] * n_kv] * layers)
    # The key mode's own parameters are allocated uninitialised (a checkpoint fills them): orthogonal maps, so rebuilt
    # or projected keys have realistic magnitudes (and no garbage, NaN included, reaches the logits).
    for attn in model.compressed_attentions():
        for name in ("k_up", "q_map", "k_map"):
            if hasattr(attn, name):
                for block in getattr(attn, name).data:
                    # QR has no bfloat16 / float16 kernel (CPU or CUDA): drawn in float32, then stored.
                    block.copy_(torch.nn.init.orthogonal_(torch.empty_like(block, dtype=torch.float32)))
    return model


def evict_policy(n_kv: int, d: int, layers: int):
    """EVICT_RECIPE as the EvictionPolicy load() builds for it (rate 0: every head's kept ranks are full)."""
    from kvrewrite.runtime.tiers.eviction import EvictionPolicy

    full = ((d,) * n_kv,) * layers
    return EvictionPolicy(
        window=EVICT_RECIPE["window"],
        kept_key_ranks=full,
        kept_value_ranks=full,
        keep=(EVICT_RECIPE["keep"],) * layers,
        bits=EVICT_RECIPE["bits"],
    )


# ---- caches -------------------------------------------------------------------------------------------------------
def filled_cache(model, form: str, batch: int, context: int, capacity: int, device, dtype):
    """The cache a prefill of `context` tokens leaves, written through the cache's own update."""
    from transformers import DynamicCache, StaticCache

    from kvrewrite.runtime.inplace_cache import in_place_cache, in_place_layer
    from kvrewrite.runtime.kernels.cache_layout import to_storage
    from kvrewrite.runtime.mla.latent_cache import cache_latent_rows
    from kvrewrite.runtime.tiers.build import make_tiered_cache

    cfg = model.config
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    if form.startswith("stock"):
        cache = DynamicCache(config=cfg) if form == "stock-dynamic" else StaticCache(config=cfg, max_cache_len=capacity)
        for i in range(cfg.num_hidden_layers):
            shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
            cache.update(rand(*shape), rand(*shape), i)
        return cache
    static = form.endswith("-compiled")  # what cache_implementation="static" builds
    form = base_form(form)
    if form == "mla":
        cache = StaticCache(config=cfg, max_cache_len=capacity) if static else DynamicCache(config=cfg)
        for i in range(cfg.num_hidden_layers):
            if not static:
                in_place_layer(cache, i)
                cache.layers[i].capacity = capacity  # as generate() sizes it
            cache_latent_rows(cache, i, rand(batch, 1, context, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
        return cache
    if form == "int4":  # the codec cache generate() builds; the prefill's blocks coded as it codes them
        cache = model.make_static_kv_cache(capacity) if static else model.make_kv_cache()
        for i, attn in enumerate(model.compressed_attentions()):
            cache.update_coded(
                rand(batch, 1, context, sum(attn.key_ranks)), rand(batch, 1, context, sum(attn.value_ranks)), i
            )
        return cache
    if form == "evict":  # a one-chunk prefill: the context enters the window, settle keeps the budget's tokens
        cache = make_tiered_cache(model, model.tier_policy, capacity=capacity)  # sized as generate() sizes it
        c = cfg.num_key_value_heads * cfg.head_dim
        for layer in cache.layers:
            layer.update(rand(batch, 1, context, c), rand(batch, 1, context, c))
            scores = torch.rand(batch, context, generator=g, device=device)
            layer.add_scores(scores, [scores.new_zeros(batch, 0)], None)
            layer.settle()
        return cache
    # What kvrewrite's generate() builds, or transformers' StaticCache (the layers then mask its unwritten slots).
    cache = StaticCache(config=cfg, max_cache_len=capacity) if static else in_place_cache(cfg, capacity=capacity)
    for i, attn in enumerate(model.compressed_attentions()):
        order = attn.cache_order(cache, device)
        cache.update(
            to_storage(rand(batch, context, sum(attn.key_ranks)), order),
            to_storage(rand(batch, context, sum(attn.value_ranks)), order),
            i,
        )
    return cache


def filled_bytes(model, form: str, batch: int, context: int, dtype) -> int:
    """Bytes of cache a decode step must read at this context (all layers), whatever room the cache holds."""
    cfg = model.config
    element = torch.empty((), dtype=dtype).element_size()
    form = base_form(form)
    if form.startswith("stock"):
        per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers
    elif form == "mla":
        per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers
    elif form in ("int4", "evict"):  # codes plus their scales: measured on a filled cache by the caller
        return -1
    else:
        per_token = model.kv_elements_per_token()
    return per_token * batch * context * element


# ---- timing -------------------------------------------------------------------------------------------------------
class Stopwatch:
    """Wall time of wrapped calls: CUDA events on a GPU (no sync inside the step), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                stop.record()
                self.marks.append((start, stop))
            else:
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                self.marks.append(time.perf_counter() - t0)
            return out

        return timed

    def total(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.marks) / 1e3
        return sum(self.marks)


@contextmanager
def patched(owner, name: str, replacement):
    original = owner[name] if isinstance(owner, dict) else getattr(owner, name)
    if isinstance(owner, dict):
        owner[name] = replacement(original)
    else:
        setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        if isinstance(owner, dict):
            owner[name] = original
        else:
            setattr(owner, name, original)


def attention_timers(form: str, watch: Stopwatch):
    """Context managers that route the form's attention call through the stopwatch."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvrewrite.runtime.mla.attention import AbsorbedMLAAttention
    from kvrewrite.runtime.modeling.attention import PACKED_ATTENTION, CompressedAttention

    def method(fn):
        return watch.wrap(fn)

    if form.startswith("stock"):
        return [patched(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", method)]
    if form == "mla":
        return [patched(AbsorbedMLAAttention, "_absorbed", method)]
    if form == "latent":
        return [patched(CompressedAttention, "_latent_attention", method)]
    if form == "int4":
        return [patched(CompressedAttention, "attend_coded", method)]
    if form == "evict":  # the tiered attention reads the kept store (TieredCache.attend imports it per call)
        from kvrewrite.runtime.tiers import attention as tiered

        return [patched(tiered, "tiered_attention", method)]
    return [patched(ALL_ATTENTION_FUNCTIONS._global_mapping, PACKED_ATTENTION, method)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_step(step_fn, ids, device, watch: Stopwatch | None) -> tuple[float, float | None]:
    """Seconds of one decode step and of its attention calls."""
    if watch is not None:
        watch.marks.clear()
    sync(device)
    t0 = time.perf_counter()
    step_fn(ids)
    sync(device)
    return time.perf_counter() - t0, (watch.total() if watch is not None else None)


class FormRun:
    """One form's model (shared by the stock forms) and, per configuration, its filled cache and compiled step."""

    def __init__(self, form: str, model, device):
        self.form, self.model, self.device = form, model, device
        self.forward = model.forward
        if form.endswith("-compiled"):
            mode = "reduce-overhead" if device.type == "cuda" else "default"
            self.forward = torch.compile(model.forward, mode=mode, fullgraph=True)
        self.watch = None if form.endswith("-compiled") else Stopwatch(device)

    def step(self, cache, ids) -> tuple[float, float | None]:
        with torch.inference_mode(), ExitStack() as stack:
            if self.watch is not None:
                for timer in attention_timers(self.form, self.watch):
                    stack.enter_context(timer)
            return one_step(
                lambda x: self.forward(input_ids=x, past_key_values=cache, use_cache=True), ids, self.device, self.watch
            )


def measure_config(runs: dict, batch: int, context: int, args, device, dtype) -> dict:
    """Every form at one (batch, context), steps interleaved round-robin so all forms see the same machine state."""
    from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

    capacity = context + args.steps + args.warmup + 4
    caches, rows, times = {}, {}, {}
    for form, run in runs.items():
        try:
            caches[form] = filled_cache(run.model, form, batch, context, capacity, device, dtype)
        except torch.OutOfMemoryError:
            rows[form] = {"batch": batch, "context": context, "error": "out of memory filling the cache"}
            continue
        held = cache_tensor_bytes(caches[form])
        must_read = filled_bytes(run.model, form, batch, context, dtype)
        rows[form] = {
            "batch": batch,
            "context": context,
            "weight_bytes_read": weight_bytes_read(run.model),
            "cache_bytes_read": held if must_read < 0 else must_read,
            "cache_bytes_held": held,
            # floats at 2 bytes each, as the frontier counts (a CPU run holds stock's cache in fp32)
            "cache_bytes_held_fp16": cache_tensor_bytes(caches[form], float_bytes=2),
        }
        if form == "evict":
            rows[form]["policy"] = {**EVICT_RECIPE, "bits": list(EVICT_RECIPE["bits"])}
        times[form] = ([], [])
    g = torch.Generator(device=device).manual_seed(1)
    vocab = next(iter(runs.values())).model.config.vocab_size
    warmup = args.warmup + (3 if any(f.endswith("-compiled") for f in runs) else 0)  # CUDA graphs record first
    for step in range(warmup + args.steps):
        ids = torch.randint(0, vocab, (batch, 1), generator=g, device=device)
        for form in list(times):
            try:
                step_s, attention_s = runs[form].step(caches[form], ids)
            except Exception as exc:  # out of memory, a compile failure: recorded, the other forms go on
                rows[form]["error"] = f"decode failed: {type(exc).__name__}: {exc}"[:500]
                print(f"{form}: {rows[form]['error']}", file=sys.stderr, flush=True)
                traceback.print_exc(file=sys.stderr)  # the whole of it in the log: a compile failure's cause is deep
                del times[form]
                continue
            if step >= warmup:
                times[form][0].append(step_s)
                if attention_s is not None:
                    times[form][1].append(attention_s)
    for form, (step_s, attention_s) in times.items():
        row = rows[form]
        median = statistics.median(step_s)
        row.update(step_s=round(median, 6), tokens_per_s=round(batch / median, 2))
        if attention_s:
            row["attention_s"] = round(statistics.median(attention_s), 6)
            row["attention_bandwidth_GBps"] = round(row["cache_bytes_read"] / row["attention_s"] / 1e9, 1)
        print(
            f"{form:18s} {batch:3d} x {context:6d}: {row['tokens_per_s']:9.1f} tok/s  "
            f"attention {row.get('attention_s', float('nan')) * 1e3:8.2f} ms "
            f"({row.get('attention_bandwidth_GBps', float('nan'))} GB/s)",
            flush=True,
        )
    caches.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def weight_bytes_read(model) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer once, but of the input embedding only the
    rows looked up (none counted) unless it is tied to the output head."""
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight.data_ptr() == embedding.data_ptr()
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() in seen or (tensor.data_ptr() == embedding.data_ptr() and not tied):
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def add_ratios(results: dict) -> None:
    for name, base_name in (("vs_stock_static", "stock-static"), ("vs_stock_compiled", "stock-compiled")):
        if base_name not in results:
            continue
        base = {(r["batch"], r["context"]): r for r in results[base_name] if "tokens_per_s" in r}
        base_bytes = {key: r["cache_bytes_read"] for key, r in base.items()}
        for rows in results.values():
            for row in rows:
                ref = base.get((row["batch"], row["context"]))
                if ref is None or "tokens_per_s" not in row:
                    continue
                row[name] = round(row["tokens_per_s"] / ref["tokens_per_s"], 3)
                row["cache_share"] = round(row["cache_bytes_read"] / base_bytes[(row["batch"], row["context"])], 3)

                held_fp16 = ref.get("cache_bytes_held_fp16")
                if held_fp16 and "cache_bytes_held_fp16" in row:
                    row["cache_share_fp16"] = round(row["cache_bytes_held_fp16"] / held_fp16, 3)


def add_bytes_bounds(results: dict) -> None:
    """Each row's bytes_bound_vs_stock_static: stock's step bytes (weights + cache) over the form's, the most tokens/s
    over stock that reading fewer bytes can give when both read at one speed."""
    base = {(r["batch"], r["context"]): r for r in results.get("stock-static", []) if "cache_bytes_read" in r}
    for rows in results.values():
        for row in rows:
            ref = base.get((row.get("batch"), row.get("context")))
            if ref is not None and "cache_bytes_read" in row:
                step_bytes = row["weight_bytes_read"] + row["cache_bytes_read"]
                stock_bytes = ref["weight_bytes_read"] + ref["cache_bytes_read"]
                row["bytes_bound_vs_stock_static"] = round(stock_bytes / step_bytes, 3)


def bytes_only(forms: list[str], shape: dict, layers: int, configs, device, dtype) -> dict:
    """Rows of weight and cache bytes a step reads at each (batch, context), nothing timed; one model in memory at a
    time. A codec or eviction store is filled at batch 1 and its bytes scaled by the batch (each sequence holds its
    own)."""
    from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

    results = {}
    for form in forms:
        model = build_model(form, shape, layers, device, dtype)
        weights = weight_bytes_read(model)
        results[form] = []
        for batch, context in configs:
            cache_bytes = filled_bytes(model, form, batch, context, dtype)
            if cache_bytes < 0:
                cache = filled_cache(model, form, 1, context, context + 4, device, dtype)
                cache_bytes = batch * cache_tensor_bytes(cache)
                del cache
            results[form].append(
                {"batch": batch, "context": context, "weight_bytes_read": weights, "cache_bytes_read": cache_bytes}
            )
        del model
        gc.collect()
    add_bytes_bounds(results)
    return results


def add_peak_shares(record: dict) -> None:
    """Each attention call's achieved bandwidth as a share of the GPU's nominal peak (GPU runs only)."""
    peak = record.get("peak_bandwidth_GBps")
    for rows in record["results"].values():
        for row in rows:
            if peak and "attention_bandwidth_GBps" in row:
                row["attention_share_of_peak"] = round(row["attention_bandwidth_GBps"] / peak, 3)


def provenance(args, device: torch.device) -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = next((bw for part, bw in PEAK_BANDWIDTH.items() if gpu and part in gpu), None)
    return {
        "command": " ".join([f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", "python", *sys.argv]),
        "commit": commit or os.environ.get("KVREWRITE_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s)",
        "gpu": gpu or "none (CPU run)",
        "peak_bandwidth_GBps": peak / 1e9 if peak else None,
        "shape": args.shape,
        "layers": args.layers,
        "dtype": args.dtype,
        "per_head_rate": PER_HEAD_RATE,
        "steps": args.steps,
        "cache_fill": "random tensors of each form's cache shapes, through the cache's update",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--configs", default=None, help=f"batch x context list (default on a GPU: {GPU_CONFIGS})")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--small", action="store_true", help="CI-sized shapes on CPU: SmolLM2 shapes, 2 layers, 2 x 256 and 4 x 512"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", action="store_true", help="also write tokens/s against context as OUT.png")
    parser.add_argument("--note", default=None, help="recorded as machine_note (e.g. what else ran on the machine)")
    parser.add_argument(
        "--bytes-only",
        action="store_true",
        help="time nothing: the bytes each form's step reads (weights, cache) and the bound they set against stock",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        nargs="+",
        default=None,
        help="only redraw the plot from these result files (their forms' points joined) into --out",
    )
    args = parser.parse_args()
    if args.replot:
        records = [json.loads(path.read_text()) for path in args.replot]
        joined = {**records[0], "results": {}}
        for record in records:
            for form, rows in record["results"].items():
                joined["results"].setdefault(form, []).extend(rows)
        plot(joined, args.out or args.replot[0].with_suffix(".png"))
        return
    if args.small:
        args.device, args.shape, args.layers = "cpu", "smollm2", 2
        args.configs = args.configs or "2x256,4x512"
        args.steps = min(args.steps, 3)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible (use --device cpu or --small)")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    configs = parse_configs(args.configs or (GPU_CONFIGS if device.type == "cuda" else "8x8192"))
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = sorted(set(forms) - set(FORMS + OPT_IN_FORMS))
    if unknown:
        parser.error(f"unknown forms {unknown}; choose from {', '.join(FORMS + OPT_IN_FORMS)}")
    shape = SHAPES[args.shape]
    record = {
        **provenance(args, device),
        **({"machine_note": args.note} if args.note else {}),
        "results": {form: [] for form in forms},
    }
    out = args.out or (RESULTS / f"gpu_decode_{'small' if args.small else device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.bytes_only:
        record["results"] = bytes_only(forms, shape, args.layers, configs, device, dtype)
        out.write_text(json.dumps(record, indent=1) + "\n")
        for form, rows in record["results"].items():
            for row in rows:
                bound = row.get("bytes_bound_vs_stock_static")  # absent without stock-static among the forms
                shown = "" if bound is None else f"{bound:.3f}"
                print(f"{form:14s} {row['batch']:>3d} x {row['context']:<6d} {shown}")
        print(f"wrote {out}")
        return
    runs, stock_model = {}, None
    for form in forms:
        try:
            if form.startswith("stock"):  # one stock model serves its three forms
                stock_model = stock_model or build_model(form, shape, args.layers, device, dtype)
                model = stock_model
            else:
                model = build_model(form, shape, args.layers, device, dtype)
            runs[form] = FormRun(form, model, device)
        except Exception as exc:  # one form failing must not lose the others
            record["results"][form] = [{"error": f"{type(exc).__name__}: {exc}"[:500]}]
            print(f"{form}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    for batch, context in configs:
        for form, row in measure_config(runs, batch, context, args, device, dtype).items():
            record["results"][form].append(row)
        add_ratios(record["results"])
        add_bytes_bounds(record["results"])
        add_peak_shares(record)
        out.write_text(json.dumps(record, indent=1) + "\n")  # after every configuration: a later crash keeps these
    print_table(record)
    print(f"wrote {out}")
    if args.plot:
        plot(record, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")


def plot(record: dict, target: Path) -> None:
    """tokens/s against context, one line per form, one panel per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for rows in record["results"].values() for r in rows if "tokens_per_s" in r})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for form, rows in record["results"].items():
            points = sorted(
                (r["context"], r["tokens_per_s"]) for r in rows if r.get("batch") == batch and "tokens_per_s" in r
            )
            if points:
                style = "--" if form.startswith("stock") else "-"
                ax.plot(*zip(*points), style, marker="o", label=form)
        contexts = sorted(
            {
                r["context"]
                for rows in record["results"].values()
                for r in rows
                if r.get("batch") == batch and "tokens_per_s" in r
            }
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" if c >= 1024 else str(c) for c in contexts])
        ax.minorticks_off()
        ax.set(xlabel="context (tokens)", ylabel="tokens/s", title=f"batch {batch}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(
        f"decode, {record['shape']} x {record['layers']} layers, {record['dtype']}, {record['gpu']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)


def print_table(record: dict) -> None:
    print(
        f"\n{'form':18s} {'B x ctx':>12s} {'tok/s':>10s} {'vs static':>10s} {'vs compiled':>12s} {'bytes':>6s} "
        f"{'attn GB/s':>10s} {'bound':>6s}"
    )
    for form, rows in record["results"].items():
        for row in rows:
            if "tokens_per_s" not in row:
                print(f"{form:18s} {row.get('error', '')}")
                continue
            print(
                f"{form:18s} {row['batch']:>4d} x {row['context']:<6d} {row['tokens_per_s']:>10.1f} "
                f"{row.get('vs_stock_static', float('nan')):>10.3f} {row.get('vs_stock_compiled', float('nan')):>12.3f} "
                f"{row.get('cache_share', float('nan')):>6.2f} {row.get('attention_bandwidth_GBps', float('nan')):>10} "
                f"{row.get('bytes_bound_vs_stock_static', float('nan')):>6.2f}"
            )


if __name__ == "__main__":
    main()
