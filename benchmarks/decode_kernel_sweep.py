"""Launch settings of the decode kernels, swept on a GPU: key block, warps, pipeline stages and splits.

The H200 run measured our attention kernels at 0.41-0.43 of the part's peak bandwidth (`freq`, `post-rope`) and
0.14-0.19 (MLA, `latent`) at 64 x 8K (benchmarks/results/gpu_decode_h200.json). Whether that is their launch
settings or their design is one sweep: each kernel alone, at the GPU run's shapes (Llama-3-8B, bf16, per-head rank
64 of 128, MLA 512 + 64), for every setting in the grid, timed with CUDA events, its output checked against the
default settings' (a setting that changes the result is a bug, recorded, never ranked). Reported: milliseconds,
the cache bytes the kernel must read over its time, that as a share of peak, and the best setting per kernel and size.

    python benchmarks/decode_kernel_sweep.py --out benchmarks/results/decode_kernel_sweep_h200.json
    # end to end on CPU under Triton's interpreter, tiny shapes (checks the harness, times nothing meaningful):
    TRITON_INTERPRET=1 python benchmarks/decode_kernel_sweep.py --small

The settings are the kernels' module constants and planners (NUM_STAGES, NUM_WARPS / latent_warps, decode_tile /
mla_tile), replaced for one timing and put back; `splits` is the wrappers' own argument.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)
from gpu_decode import GPU_CONFIGS, PEAK_BANDWIDTH, SHAPES, parse_configs, patched  # noqa: E402

BLOCKS = (32, 64, 128)
WARPS = (4, 8)
STAGES = (1, 2, 3)
SPLIT_FACTORS = (None, 0.5, 2.0)  # None: the planner's own count; else that count times the factor


def replaced(module, name: str, value):
    """module.name set to value within the block (gpu_decode.patched, which takes a function of the original)."""
    return patched(module, name, lambda _original: value)


def kernel_cases(
    shape: dict, batch: int, context: int, dtype, device, small: bool, filled: bool = True, live_length: bool = False
) -> dict:
    """{kernel: (module, tile planner name, warps name, call(splits), bytes the kernel must read)}.

    filled=False allocates every input without writing it (host-side timing: nothing is read); live_length=True
    gives the wrappers a cache of 16 slots more than `context` and the live length as a device tensor, as a growing
    cache does (else every slot is live and no length is passed)."""
    from kvrewrite.runtime.kernels import flash_decode_latent, flash_decode_mla, flash_decode_packed
    from kvrewrite.runtime.kernels.reference import PackedLayout

    heads, n_kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    rank = d // 2
    layout = PackedLayout((rank,) * n_kv, (rank,) * n_kv, heads // n_kv)
    g = torch.Generator(device=device).manual_seed(0)
    s_cap = context + 16 if live_length else context
    kv_len = torch.tensor([context], device=device) if live_length else None

    def rand(*size):
        if not filled:
            return torch.empty(*size, device=device, dtype=dtype)
        return torch.randn(*size, generator=g, device=device, dtype=dtype)

    keys, values = rand(batch, s_cap, rank * n_kv), rand(batch, s_cap, rank * n_kv)
    allowed = torch.ones(batch, s_cap, dtype=torch.bool, device=device)
    query, rotated = rand(batch, heads * rank), rand(batch, heads * d)
    latent, rope = (64, 32) if small else shape["mla"]
    rows, q_rows = rand(batch, s_cap, latent + rope), rand(batch, heads, latent + rope)
    if filled:
        up = torch.linalg.qr(torch.randn(n_kv, d, d, generator=g, device=device))[0].to(dtype)
        angles = torch.arange(s_cap, device=device)[:, None] * torch.rand(1, d // 2, generator=g, device=device)
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    else:
        up, cos, sin = rand(n_kv, d, d), rand(s_cap, d), rand(s_cap, d)
    element = keys.element_size()
    per_head_bytes = 2 * batch * context * rank * n_kv * element
    return {
        "packed": (
            flash_decode_packed,
            "decode_tile",
            "NUM_WARPS",
            lambda s: flash_decode_packed.packed_flash_decode(query, keys, values, allowed, kv_len, 0.1, layout, s),
            per_head_bytes,
        ),
        "latent": (
            flash_decode_latent,
            "decode_tile",
            "latent_warps",
            lambda s: flash_decode_latent.latent_flash_decode(
                rotated, keys, values, allowed, kv_len, 0.1, layout, up, cos, sin, s
            ),
            per_head_bytes,
        ),
        "mla": (
            flash_decode_mla,
            "mla_tile",
            "NUM_WARPS",
            lambda s: flash_decode_mla.mla_flash_decode(q_rows, rows, allowed, kv_len, 0.1, latent, s),
            batch * context * (latent + rope) * element,
        ),
    }


def planned_splits(module, call) -> int:
    """The split count the wrapper's planner picks, read off its plan function's result."""
    seen = []
    plan_name = {"flash_decode_packed": "packed_plan", "flash_decode_latent": "latent_plan"}.get(
        module.__name__.rsplit(".", 1)[-1], "mla_plan"
    )
    original = getattr(module, plan_name)

    def spy(*args, **kwargs):
        plan = original(*args, **kwargs)
        seen.append(plan.max_splits)
        return plan

    with replaced(module, plan_name, spy):
        call(None)
    return seen[-1]


def timed_ms(call, splits, device, reps: int) -> tuple[float | None, str, torch.Tensor]:
    """Milliseconds per call, how they were timed, and the output. On a GPU the call is captured in a CUDA graph
    and replayed, so the wrapper's host time (tens of microseconds) does not hide a fast kernel; where capture fails,
    eager calls. Off a GPU: None (the interpreter's time means nothing)."""
    out = call(splits)
    if device.type != "cuda":
        return None, "none", out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(2):
            call(splits)
    torch.cuda.current_stream().wait_stream(stream)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(splits)
        run, how = graph.replay, "cuda graph"
    except Exception:  # noqa: BLE001 - a wrapper that cannot be captured is still timed, eagerly
        torch.cuda.synchronize()
        run, how = (lambda: call(splits)), "eager"
    run()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        run()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps, how, out


def measured(call, splits, device, reps: int, reference: torch.Tensor, must_read: int, peak) -> dict:
    """One setting's row: time, how it was timed, error against the default's output, bandwidth."""
    try:
        ms, how, out = timed_ms(call, splits, device, reps)
        error = ((out.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
    except Exception as exc:  # out of registers / shared memory, a launch error: recorded, the sweep goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    row = {"ms": None if ms is None else round(ms, 4), "timed": how, "max_rel_error": round(error, 5)}
    if ms:
        row["GBps"] = round(must_read / ms / 1e6, 1)
        if peak:
            row["peak_share"] = round(must_read / ms / 1e-3 / peak, 3)
    return row


def sweep(name: str, case, device, reps: int, peak: float | None) -> list[dict]:
    """The default settings first (as the runtime launches them), then every setting of the grid."""
    module, tile_name, warps_name, call, must_read = case
    reference = call(None).float()
    rows = [{"default": True, "splits": planned_splits(module, call), **measured(call, None, device, reps, reference,
                                                                               must_read, peak)}]  # fmt: skip
    for block, warps, stages in itertools.product(BLOCKS, WARPS, STAGES):
        warps_value = (lambda *_: warps) if callable(getattr(module, warps_name)) else warps
        with ExitStack() as stack:
            stack.enter_context(replaced(module, tile_name, lambda *_, b=block: b))
            stack.enter_context(replaced(module, warps_name, warps_value))
            stack.enter_context(replaced(module, "NUM_STAGES", stages))
            try:
                auto = planned_splits(module, call)  # the planner's count for this key block
            except Exception as exc:  # noqa: BLE001 - the setting cannot launch at all
                rows.append({"block_n": block, "num_warps": warps, "num_stages": stages, "error": str(exc)[:300]})
                continue
            for factor in SPLIT_FACTORS:
                splits = None if factor is None else max(1, round(auto * factor))
                row = {"block_n": block, "num_warps": warps, "num_stages": stages, "splits": splits or auto}
                rows.append({**row, **measured(call, splits, device, reps, reference, must_read, peak)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=None, help=f"batch x context list (default: {GPU_CONFIGS})")
    parser.add_argument("--kernels", default="packed,latent,mla")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="CPU, Triton's interpreter, tiny shapes (no timing)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("no GPU: run with TRITON_INTERPRET=1 and --small (checks the harness, times nothing)")
    shape = dict(SHAPES["llama3-8b"])
    if args.small:
        global BLOCKS, WARPS, STAGES
        shape.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        BLOCKS, WARPS, STAGES = (16,), (4,), (2,)
    configs = parse_configs(args.configs or ("2x64" if args.small else GPU_CONFIGS))
    dtype = torch.float32 if args.small else torch.bfloat16
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = next((bw for part, bw in PEAK_BANDWIDTH.items() if gpu and part in gpu), None)
    record = {
        **run_provenance(torch.get_num_threads(), "the kernels alone, one process"),
        "gpu": gpu or "none (CPU, Triton's interpreter)",
        "peak_bandwidth_GBps": peak / 1e9 if peak else None,
        "results": {},
    }
    out = args.out or Path(f"/tmp/decode_kernel_sweep_{device.type}.json")
    for batch, context in configs:
        cases = kernel_cases(shape, batch, context, dtype, device, args.small)
        for name in [k.strip() for k in args.kernels.split(",") if k.strip()]:
            rows = sweep(name, cases[name], device, args.reps, peak)
            timed = [r for r in rows if r.get("ms") and r["max_rel_error"] < 0.05]
            best = min(timed, key=lambda r: r["ms"], default=None)
            default = rows[0]
            record["results"].setdefault(name, []).append(
                {"batch": batch, "context": context, "best": best, "settings": rows}
            )
            shown = f"default {default.get('ms')} ms, best {best}" if best else "not timed"
            print(f"{name:7s} {batch:3d} x {context:6d}: {len(rows)} settings, {shown}", flush=True)
            if "error" in default:
                print(f"  the default settings failed: {default['error']}", flush=True)
            out.write_text(json.dumps(record, indent=1) + "\n")  # after every kernel: a time limit keeps these
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
