"""Decode speed of rewritten SmolLM2 checkpoints against stock transformers, measured in the same run.

Run on demand (heavy: take the machine lock):
  flock /tmp/kvrewrite-heavy.lock .venv/bin/python benchmarks/decode.py            # compile (once) + measure
  .venv/bin/python benchmarks/decode.py --plot-only                                 # redraw the plot

Writes benchmarks/results/decode_<device>.json and decode_<device>.png.

What is measured, per model (stock; freq and post-rope at p = 0, 0.3, 0.5, 0.7; latent at p = 0.5) and per
(context, batch):
- decode: the cache is filled with random tensors of the model's own cache shapes and dtype (a DynamicCache
  with [B, H_kv, S, d] for stock and the packed latents for rewritten layers, in the memory order the layer
  stores them: column-major [B, sum r, S, 1] for the CPU rank-bucket runner; prefilling 8K x 8
  through the model would take many minutes on 2 CPU cores and attention cost does not depend on the cache
  values), then `steps` single-token forward passes; tokens/s = batch / median step time;
- attention time: wall time inside the attention function (stock: transformers' sdpa function; rewritten:
  the packed attention, or the latent attention that rebuilds keys), the same timer for both, summed over
  layers, median over steps; attention-layer time: the whole self-attention module (projections, RoPE,
  cache update, attention, o_proj);
- prefill: one forward over a random prompt at the (affordable) sizes in --prefill;
- memory: bytes of the filled cache tensors; process peak RSS after each configuration (one subprocess per
  model, configurations in increasing cache size, so the figure is that configuration's peak).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CONFIGS = [(512, 1), (2048, 1), (512, 8), (8192, 1), (2048, 8), (8192, 8)]  # increasing cache size
MODELS = {
    "stock": None,
    "freq p=0.0": ("freq", 0.0),
    "freq p=0.3": ("freq", 0.3),
    "freq p=0.5": ("freq", 0.5),
    "freq p=0.7": ("freq", 0.7),
    "post-rope p=0.0": ("post-rope", 0.0),
    "post-rope p=0.3": ("post-rope", 0.3),
    "post-rope p=0.5": ("post-rope", 0.5),
    "post-rope p=0.7": ("post-rope", 0.7),
    "latent p=0.5": ("latent", 0.5),
}


def compile_checkpoints(root: Path, calib_tokens: int) -> None:
    """One p = 0.5 checkpoint per key mode (statistics shared); other rates come from its rate table."""
    import kvrewrite
    from kvrewrite.compile.plan import Plan

    modes = sorted({spec[0] for spec in MODELS.values() if spec})
    missing = [m for m in modes if not (root / m / "config.json").exists()]
    if not missing:
        return
    plan = Plan(
        model="smollm2-135m",
        target_rate=0.5,
        calib_tokens=calib_tokens,
        allocation="greedy",
        overwrite=True,
        progress=False,
    )
    kvrewrite.compress_variants(plan, {m: {"rope_mode": m} for m in missing}, root)


def run_provenance(threads: int, note: str) -> dict:
    """command, commit, date and machine of a benchmark run (the header every such result file starts with); `note`
    says what else the machine was doing, or what the run's timings can be compared with."""
    import datetime
    import platform
    import subprocess
    import sys

    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    return {
        "command": " ".join(
            [f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", Path(sys.executable).name, *sys.argv]
        ),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{threads} torch thread(s); {note}",
    }


def timed_decode_steps(
    model, cache, batch: int, context: int, steps: int, attention_times: list, layer_times: list
) -> tuple[list[float], list[float], list[float]]:
    """`steps` single-token decode steps on a filled cache after one warm-up: wall, attention and attention-layer
    seconds per step (the hooks that fill attention_times / layer_times are the caller's)."""
    import torch

    vocab = model.config.vocab_size
    step_s, attn_s, layer_s = [], [], []
    for step in range(steps + 1):  # the first step warms up
        ids = torch.randint(0, vocab, (batch, 1))
        mask = torch.ones(batch, context + step + 1, dtype=torch.long)
        attention_times.clear()
        layer_times.clear()
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        if step:
            step_s.append(time.perf_counter() - t0)
            attn_s.append(sum(attention_times))
            layer_s.append(sum(layer_times))
    return step_s, attn_s, layer_s


@contextmanager
def _timed(owner, name: str, sink: list[float]):
    original = getattr(owner, name) if not isinstance(owner, dict) else owner[name]

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        sink.append(time.perf_counter() - t0)
        return out

    if isinstance(owner, dict):
        owner[name] = wrapper
    else:
        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        if isinstance(owner, dict):
            owner[name] = original
        else:
            setattr(owner, name, original)


def _fill_cache(model, batch: int, context: int, stock: bool):
    import torch
    from transformers import DynamicCache

    from kvrewrite.runtime.kernels.cache_layout import to_storage

    cfg = model.config
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.model.layers):
        if stock:
            shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
            keys, values = torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)
        else:  # the packed latents in the memory order the layer itself stores them in
            attn = layer.self_attn
            order = attn.cache_order(cache, torch.device("cpu"))
            keys = to_storage(torch.randn(batch, context, sum(attn.key_ranks), generator=g, dtype=dtype), order)
            values = to_storage(torch.randn(batch, context, sum(attn.value_ranks), generator=g, dtype=dtype), order)
        cache.update(keys.contiguous(), values.contiguous(), i)
    nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return cache, nbytes


def measure_model(
    name: str, root: Path, steps: int, configs: list[tuple[int, int]], prefill: list[tuple[int, int]]
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import kvrewrite
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.runtime.modeling.attention import PACKED_ATTENTION, CompressedAttention

    spec = MODELS[name]
    if spec is None:
        path = resolve_model_source("smollm2-135m").path
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    else:
        model = kvrewrite.load(root / spec[0], rate=spec[1]).eval()
    stock = spec is None
    attention_times: list[float] = []
    layer_times: list[float] = []
    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    timers = [_timed(mapping, "sdpa" if stock else PACKED_ATTENTION, attention_times)]
    if not stock:
        timers.append(_timed(CompressedAttention, "_latent_attention", attention_times))
    starts: dict[int, float] = {}
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda m, a, kw=None: starts.__setitem__(id(m), time.perf_counter()))
        layer.self_attn.register_forward_hook(lambda m, a, o: layer_times.append(time.perf_counter() - starts[id(m)]))
    record = {"decode": [], "prefill": []}
    vocab = model.config.vocab_size
    with torch.inference_mode():
        for t in timers:
            t.__enter__()
        try:
            for context, batch in configs:
                cache, cache_bytes = _fill_cache(model, batch, context, stock)
                step_s, attn_s, layer_s = timed_decode_steps(
                    model, cache, batch, context, steps, attention_times, layer_times
                )
                del cache
                entry = {
                    "context": context,
                    "batch": batch,
                    "steps": steps,
                    "step_s": round(statistics.median(step_s), 5),
                    "tokens_per_s": round(batch / statistics.median(step_s), 2),
                    "attention_s": round(statistics.median(attn_s), 5),
                    "attention_layer_s": round(statistics.median(layer_s), 5),
                    "cache_bytes": cache_bytes,
                    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                }
                record["decode"].append(entry)
                print(name, entry, flush=True)
            for length, batch in prefill:
                ids = torch.randint(0, vocab, (batch, length))
                times = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    model(input_ids=ids, use_cache=True)
                    times.append(time.perf_counter() - t0)
                record["prefill"].append({"length": length, "batch": batch, "prefill_s": round(min(times), 4)})
                print(name, record["prefill"][-1], flush=True)
        finally:
            for t in timers:
                t.__exit__(None, None, None)
    if not stock:
        attn = model.model.layers[0].self_attn
        runner = attn.packed_attention_runner(torch.device("cpu"))
        record["attention_backend"] = type(runner).__name__
        record["cache_order"] = attn.cache_order(_fill_cache(model, 1, 1, False)[0], torch.device("cpu"))
        record["kv_elements_per_token"] = model.kv_elements_per_token()
    return record


def add_ratios(results: dict) -> None:
    base = {(e["context"], e["batch"]): e for e in results["stock"]["decode"]}
    base_prefill = {(e["length"], e["batch"]): e for e in results["stock"]["prefill"]}
    for name, rec in results.items():
        if name == "stock":
            continue
        for e in rec["decode"]:
            b = base[(e["context"], e["batch"])]
            e["vs_stock"] = {
                "tokens_per_s": round(e["tokens_per_s"] / b["tokens_per_s"], 3),
                "attention_s": round(e["attention_s"] / b["attention_s"], 3),
                "attention_layer_s": round(e["attention_layer_s"] / b["attention_layer_s"], 3),
                "cache_bytes": round(e["cache_bytes"] / b["cache_bytes"], 3),
            }
        for e in rec["prefill"]:
            e["vs_stock"] = round(e["prefill_s"] / base_prefill[(e["length"], e["batch"])]["prefill_s"], 3)


def plot(record: dict, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = record["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for batch, ax in zip((1, 8), axes):
        for name, rec in results.items():
            pts = [e for e in rec["decode"] if e["batch"] == batch]
            style = "k-o" if name == "stock" else "-o"
            ax.plot([e["context"] for e in pts], [e["tokens_per_s"] for e in pts], style, label=name, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"SmolLM2-135M decode, batch {batch} ({record['device']})")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("/tmp/kvrewrite-decode-bench"), help="compiled checkpoints")
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--prefill", nargs="*", default=["512x1", "1024x1"], help="LENGTHxBATCH prompt sizes")
    parser.add_argument(
        "--configs",
        nargs="*",
        default=[f"{c}x{b}" for c, b in CONFIGS],
        help="CONTEXTxBATCH decode sizes, in increasing cache size",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per model process (1: on a shared machine a descheduled OpenMP thread "
        "stalls every parallel op for a time slice, which swamps millisecond kernels)",
    )
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    prefill = [tuple(int(x) for x in p.split("x")) for p in args.prefill]
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs]

    if args.worker:  # one model per process, so its peak RSS is its own
        import torch

        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(measure_model(args.worker, args.root, args.steps, configs, prefill)))
        return

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = RESULTS / f"decode_{device}.json"
    if args.plot_only:
        plot(json.loads(target.read_text()), target.with_suffix(".png"))
        return
    t0 = time.perf_counter()
    compile_checkpoints(args.root, args.calib_tokens)
    compile_s = round(time.perf_counter() - t0, 1)
    if args.compile_only:
        return
    results = {}
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device,
        "machine": f"{platform.node()}: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {args.threads} torch thread(s) per model; machine shared with other jobs "
        "(other compiles/tests ran during the measurement; ratios are same-run)",
        "gpu": "none available in this session (no device lent); Triton kernels verified under TRITON_INTERPRET=1 only"
        if device == "cpu"
        else torch.cuda.get_device_name(0),
        "dtype": "float32",
        "cache_fill": "decode caches filled with torch.randn tensors of each model's own cache shapes (no prefill)",
        "compile": {
            "calib_tokens": args.calib_tokens,
            "allocation": "greedy",
            "objective": "optimal",
            "seconds": compile_s,
        },
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    for name in ["stock", *[m for m in args.models if m != "stock"]]:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--root",
            str(args.root),
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--configs",
            *args.configs,
            "--prefill",
            *args.prefill,
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy()).stdout
        results[name] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        add_ratios(results)
        target.write_text(json.dumps(record, indent=1))  # after every model, so a cut-off run keeps its data
        print("measured", name, flush=True)
    plot(record, target.with_suffix(".png"))
    print("wrote", target)


if __name__ == "__main__":
    main()
