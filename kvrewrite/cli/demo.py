"""`kvrewrite demo`: SmolLM2-135M compressed two ways, and exported as an MLA form, evaluated at several rates.

Statistics are collected once and shared by both per-head configurations; every rate comes from the same
checkpoint's rate table, and all variants are scored in one pass over the held-out text. The MLA row
(`export-mla --allocation sensitivity` at the smallest rate's share) collects its own statistics (it also needs the
attention inputs' Gram) and serves its rates from its own rate table, loaded with kvrewrite's absorbed runtime.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

DEMO_CONFIGS = {
    # ZACK as published: [Q;K] SVD post-RoPE keys, [V; W_O^T] SVD values, shared removal rate (Eq. 6).
    "zack-faithful": {"objective": "zack", "allocation": "eps", "rope_mode": "post-rope"},
    # Our best so far: query-aware pre-RoPE latent keys, output-aware values, ranks by measured sensitivity.
    "kvrewrite-optimal": {"objective": "optimal", "allocation": "sensitivity", "rope_mode": "latent"},
}
# The DeepSeek-V3 MLA export with per-layer widths from measured sensitivity (docs/serving.md).
MLA_VARIANT = "mla-allocated"


def run_demo(output: Path, rates: list[float], calib_tokens: int, eval_tokens: int, console: Console) -> list[dict]:
    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.publish.checkpoint_eval import result_rows
    from kvrewrite.cli.tables import eval_table
    from kvrewrite.publish.evaluation import evaluate_many
    from kvrewrite.compile.passes.pipeline import compile_variants
    from kvrewrite.compile.plan import Plan
    from kvrewrite.runtime.load import load

    started = time.perf_counter()
    plan = Plan(model="smollm2-135m", target_rate=max(rates), calibration="wiki", calib_tokens=calib_tokens, overwrite=True,
                rate_grid=tuple(sorted({*Plan.__dataclass_fields__["rate_grid"].default, *rates})))

    def on_pass(variant: str, step) -> None:
        console.print(f"[cyan]{variant}[/] {step.name}: {step.description}")

    shared, compiled = compile_variants(plan, DEMO_CONFIGS, output, on_pass=on_pass)
    compile_times = {name: ctx.report["variant_compile_s"] for name, ctx in compiled.items()}
    for name, ctx in compiled.items():
        console.print(f"  {name}: full-rank max |Δlogit| = {ctx.verification['full_rank_max_abs_logit_diff']:.2e}, wrote {ctx.output_dir}")

    mla_started = time.perf_counter()
    _export_mla(plan, rates, output / MLA_VARIANT, console)
    compile_times[MLA_VARIANT] = time.perf_counter() - mla_started

    windows = evaluation_token_sequences(shared.tokenizer, eval_tokens, plan.seq_len)
    models, model_rates = {}, {}
    for name in (*DEMO_CONFIGS, MLA_VARIANT):
        for rate in rates:
            label = f"{name} p={rate:.2f}"
            models[label], model_rates[label] = load(output / name, rate=rate), rate
    console.print(f"evaluating {len(models)} variants and the original on {windows.numel()} held-out wiki tokens")
    results = evaluate_many(models, windows, baseline=shared.original_model())
    rows = result_rows("SmolLM2-135M-Instruct", results, model_rates)
    console.print(eval_table(rows, title=f"SmolLM2-135M on held-out wiki ({windows.numel()} tokens)"))

    summary = {
        "rows": rows,
        "calibration_tokens": int(shared.calibration_tokens.numel()),
        "eval_tokens": int(windows.numel()),
        "shared_pass_time_s": shared.report["timings_s"],
        "compile_time_s": compile_times,
        "total_time_s": time.perf_counter() - started,
        "configs": DEMO_CONFIGS,
    }
    output.mkdir(parents=True, exist_ok=True)
    (output / "demo_results.json").write_text(json.dumps(summary, indent=2))
    _plot(rows, output / "demo_ppl_vs_rate.png")
    console.print(f"results: {output / 'demo_results.json'}, plot: {output / 'demo_ppl_vs_rate.png'}")
    return rows


def _export_mla(plan, rates: list[float], output: Path, console: Console) -> None:
    """The allocated MLA form at the smallest rate's share, with a rate table serving every demo rate."""
    from dataclasses import replace

    import torch

    from kvrewrite.compile.mla.export import allocated_at_share, export_at_share, prepare_source, probe_full_form

    console.print(f"[cyan]{MLA_VARIANT}[/] statistics, full-width MLA form, sensitivity probes, per-layer widths")
    prepared = prepare_source(replace(plan, output=None))
    form = allocated_at_share(prepared, probe_full_form(prepared), 1 - min(rates), rates=plan.rate_grid)
    export_at_share(prepared, form.layers, output, dtype=torch.float32, overwrite=True, rate_table=form.rate_table)
    console.print(f"  {MLA_VARIANT}: latent widths {min(form.allocation.ranks)}..{max(form.allocation.ranks)} per layer, wrote {output}")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvrewrite.io.atomic_files import atomic_write

    base = next(r for r in rows if r.get("baseline"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in (*DEMO_CONFIGS, MLA_VARIANT):
        pts = sorted((r["kv_bytes_per_token"] / base["kv_bytes_per_token"], r["perplexity"]) for r in rows if r["name"].startswith(name))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    ax.axhline(base["perplexity"], color="gray", linestyle="--", label="original")
    ax.set_xlabel("KV bytes per token (share of original)")
    ax.set_ylabel("held-out wiki perplexity")
    ax.set_title("SmolLM2-135M: quality per KV byte")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)
