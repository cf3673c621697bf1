"""MLA form exported as DeepSeek-V3, on SmolLM2-135M: held-out wiki perplexity at 30/50/70% of the K+V values, training-free.

    OMP_NUM_THREADS=1 python benchmarks/mla_quality.py [--calib-tokens 16384 --eval-tokens 8192]
    OMP_NUM_THREADS=1 python benchmarks/mla_quality.py --layer-widths uniform,sensitivity \
        --out benchmarks/results/mla_quality_allocated.json

Statistics once (16K wiki calibration tokens, as `kvrewrite demo`), then per share: the MLA form, exported (float32)
and loaded in stock transformers (AutoModelForCausalLM, DeepseekV3ForCausalLM), scored against the original on the
same held-out windows. Extra rows isolate the costs: the original with rms_norm_eps 1e-6 (what the export sets so the
engines agree), and our maths with a full latent at d_r = head_dim (only the RoPE dropped from the other components).
`--layer-widths sensitivity` adds, per share, the form with per-layer latent widths from measured sensitivity
(`export-mla --layer-widths sensitivity`), exported zero-padded and scored in kvrewrite's runtime (`kvrewrite.load`),
which caches each layer's true width. Writes benchmarks/results/mla_quality.json (or --out). `--allocations` is the
same option under the name the recorded runs used (mla_quality_allocated.json's command).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# A sweep with ablation rows, not one export: statistics and sensitivity probes are collected once and shared by
# every share and layer widths (kvrewrite.export_mla would recollect both per export), the rows isolate the RoPE drop
# and rms_norm_eps, and it scores the training-free form (refit none), so it calls the export's parts directly.
from kvrewrite.compile.mla.export import (
    allocated_at_share,
    export_at_share,
    export_matches_maths,
    mla_layers_at_share,
    prepare_source,
    probe_full_form,
)
from kvrewrite.compile.mla.form import MLAWidths, compute_mla_layers, mla_reference_model
from kvrewrite.compile.mla.plan import LAYER_WIDTHS, POSITION_FREE_QUERIES
from kvrewrite.compile.plan import Plan
from kvrewrite.io.calibration_data import evaluation_token_sequences
from kvrewrite.method.mla import DEFAULT_KEY_WEIGHT, full_latent_rank
from kvrewrite.publish.evaluation import kv_cache_bytes_per_token, perplexity_and_agreement_many

RESULTS = Path(__file__).parent / "results" / "mla_quality.json"
SHARES = (0.3, 0.5, 0.7)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--key-weight", type=float, default=DEFAULT_KEY_WEIGHT)
    parser.add_argument(
        "--layer-widths",
        "--allocations",  # the name the recorded runs used
        dest="layer_widths",
        default="uniform",
        help="export-mla's --layer-widths to score: uniform and/or sensitivity, comma-separated",
    )
    parser.add_argument(
        "--probe-windows", type=int, default=None, help="sensitivity probes' windows (default: the plan's)"
    )
    parser.add_argument(
        "--extra-rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the rms_norm_eps and RoPE-drop-only rows",
    )
    parser.add_argument(
        "--rope-frequency-stride",
        type=int,
        default=1,
        help="allocated forms: d_r = head_dim / stride (every stride-th frequency keeps its rotation)",
    )
    parser.add_argument(
        "--position-free-queries",
        default="source",
        choices=POSITION_FREE_QUERIES,
        help="source reproduces the committed mla_quality*.json; export-mla's default is expected-rotation",
    )
    parser.add_argument("--shares", default=",".join(str(s) for s in SHARES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    layer_widths = args.layer_widths.split(",")
    if not set(layer_widths) <= set(LAYER_WIDTHS):
        parser.error(f"--layer-widths: uniform and/or sensitivity, got {args.layer_widths}")
    started = time.perf_counter()
    plan = Plan(model="smollm2-135m", calibration="wiki", calib_tokens=args.calib_tokens, progress=False)
    prepared = prepare_source(plan, position_free_queries=args.position_free_queries)
    ctx = prepared.ctx
    original = ctx.original_model()
    windows = evaluation_token_sequences(ctx.tokenizer, args.eval_tokens, plan.seq_len)
    geo = ctx.geometry

    models, rows = {}, []
    if args.extra_rows:
        eps_model = copy.deepcopy(original)
        for module in eps_model.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = 1e-6
        models["original, rms_norm_eps 1e-6"] = eps_model
        widths_full = MLAWidths(1, geo.head_dim, full_latent_rank(geo, 1), None)
        models[f"ours: d_r={geo.head_dim}, full latent r={widths_full.kv_lora_rank} (RoPE-drop cost only)"] = (
            mla_reference_model(
                original,
                compute_mla_layers(
                    ctx, prepared.inputs, widths_full, key_weight=args.key_weight, rope_response=prepared.rope_response
                ),
            )
        )

    tmp = Path(tempfile.mkdtemp(prefix="mla_quality_"))
    from transformers import AutoModelForCausalLM

    import kvrewrite

    shares = {}
    probed = (
        probe_full_form(
            prepared,
            key_weight=args.key_weight,
            probe_windows=args.probe_windows,
            rope_frequency_stride=args.rope_frequency_stride,
        )
        if "sensitivity" in layer_widths
        else None
    )
    for share in (float(s) for s in args.shares.split(",")):
        if probed is not None:
            form = allocated_at_share(prepared, probed, share)
            out = tmp / f"allocated{share}"
            export_at_share(prepared, form.layers, out, dtype=torch.float32)
            ranks = list(form.allocation.ranks)
            name = (
                f"MLA allocated {share:.0%} of K+V (r={min(ranks)}..{max(ranks)}, mean {sum(ranks) / len(ranks):.1f}, "
                f"d_r={form.widths.qk_rope_head_dim}), kvrewrite runtime"
            )
            models[name] = kvrewrite.load(out).eval()
            shares[name] = {
                "share": (sum(ranks) / len(ranks) + form.widths.qk_rope_head_dim)
                / (2 * geo.num_key_value_heads * geo.head_dim),
                "kv_lora_ranks": ranks,
                "qk_rope_head_dim": form.widths.qk_rope_head_dim,
                "export_vs_maths_max_abs_logit_diff": export_matches_maths(
                    prepared, form.layers, out, windows[:1, :128]
                ),
                "probe_tokens": form.sensitivity.probe_tokens,
                "full_width_probe_kl": form.sensitivity.full_width_kl,
            }
        if "uniform" not in layer_widths:
            continue
        widths, layers = mla_layers_at_share(prepared, share, key_weight=args.key_weight)
        out = tmp / f"share{share}"
        export_at_share(prepared, layers, out, dtype=torch.float32)
        check = export_matches_maths(prepared, layers, out, windows[:1, :128])
        name = f"MLA export {share:.0%} of K+V (r={widths.kv_lora_rank}, d_r={widths.qk_rope_head_dim})"
        models[name] = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        shares[name] = {
            "share": widths.share,
            "kv_lora_rank": widths.kv_lora_rank,
            "qk_rope_head_dim": widths.qk_rope_head_dim,
            "export_vs_maths_max_abs_logit_diff": check,
            "model_class": type(models[name]).__name__,
            "rope_energy_kept_mean": sum(l.rope_energy_kept for l in layers) / len(layers),
        }
    for name in shares:  # what the model really caches per token (all layers, float32)
        key = "runtime_cache_bytes_per_token" if "kvrewrite runtime" in name else "stock_cache_bytes_per_token"
        shares[name][key] = kv_cache_bytes_per_token(models[name], 64)
    results = perplexity_and_agreement_many(models, windows, baseline=original, progress=False)
    base = next(iter(results.values())).baseline_perplexity
    rows.append(
        {
            "name": "SmolLM2-135M-Instruct (original)",
            "perplexity": base,
            "stock_cache_bytes_per_token": kv_cache_bytes_per_token(original, 64),
        }
    )
    for name, res in results.items():
        rows.append(
            {
                "name": name,
                "perplexity": res.perplexity,
                "ppl_increase_pct": 100 * (res.perplexity / base - 1),
                "kl_mean": res.kl_mean,
                "top1_agreement": res.top1_agreement,
                **shares.get(name, {}),
            }
        )
    for row in rows:
        print(json.dumps(row))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    document = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/mla_quality.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.system()} (no GPU)",
        "date": datetime.date.today().isoformat(),
        "calibration_tokens": int(ctx.calibration_tokens.numel()),
        "eval_tokens": int(windows.numel()),
        "key_weight": args.key_weight,
        "position_free_queries": args.position_free_queries,
        "export_dtype": "float32",
        "compare_with": "benchmarks/results/demo_smollm2_full.json: latent (kvrewrite-optimal) p=0.50 -> 33.29 (+35.7%)",
        "rows": rows,
        "total_time_s": round(time.perf_counter() - started, 1),
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
