"""`kvrewrite demo`: what a newcomer needs to see, on a laptop: SmolLM2-135M, its default compile, and the best
recipe at a quarter of the fp16 cache, against the original on held-out wiki text.

One compile with compress's defaults (latent keys, output-aware values, sensitivity allocation) on wiki text; its
rows are the checkpoint's own rates. The quarter-of-the-bytes row is the same checkpoint loaded at full rank with a
16-token full-rank window and re-scored eviction of 8-bit keys and 4-bit values beyond it (docs/tiers.md, the
frontier's best at 25%: docs/frontier.md); it is scored by chunked prefill through its cache, so the eviction
counts. `--mla` adds the allocated MLA export (several minutes more; docs/serving.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

# compress's defaults: query-aware pre-RoPE latent keys, output-aware values, ranks by measured sensitivity.
DEFAULT_VARIANT = "kvrewrite-default"
DEMO_CONFIGS = {DEFAULT_VARIANT: {}}
# docs/frontier.md's best recipe at 25% of the fp16 cache (benchmarks/frontier/kvrewrite_recipes.py), on the same
# checkpoint: no compile of its own.
QUARTER_VARIANT = "kvrewrite-W16-evict0.57-k8v4"
QUARTER_OPTIONS = {"rate": 0.0, "recent_window": 16, "kv_codec": "none", "evict": {"keep": 0.57, "bits": (8, 4)}}
# The DeepSeek-V3 MLA export with per-layer widths from measured sensitivity (docs/serving.md); only with --mla.
MLA_VARIANT = "mla-allocated"


def run_demo(
    output: Path, rates: list[float], calib_tokens: int, eval_tokens: int, console: Console, mla: bool = False
) -> list[dict]:
    from kvrewrite.cli.tables import eval_table
    from kvrewrite.compile.api import compress_variants
    from kvrewrite.compile.plan import Plan
    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.publish.checkpoint_eval import result_rows
    from kvrewrite.publish.evaluation import CODEC_EVAL_CHUNK, evaluate_many
    from kvrewrite.runtime.load import load

    started = time.perf_counter()
    plan = Plan(
        model="smollm2-135m",
        target_rate=max(rates),
        calibration="wiki",
        calib_tokens=calib_tokens,
        overwrite=True,
        rate_grid=tuple(sorted({*Plan.__dataclass_fields__["rate_grid"].default, *rates})),
    )

    def on_pass(variant: str, step) -> None:
        console.print(f"[cyan]{variant}[/] {step.name}: {step.description}")

    compiled = compress_variants(plan, DEMO_CONFIGS, output, on_pass=on_pass)
    compile_times = {name: result.report["variant_compile_s"] for name, result in compiled.results.items()}
    for name, result in compiled.results.items():
        exact = result.report["verification"]["full_rank_max_abs_logit_diff"]
        console.print(f"  {name}: full-rank max |Δlogit| = {exact:.2e}, wrote {result.output_dir}")
    names = [DEFAULT_VARIANT]
    if mla:
        mla_started = time.perf_counter()
        _export_mla(calib_tokens, rates, output / MLA_VARIANT, console)
        compile_times[MLA_VARIANT] = time.perf_counter() - mla_started
        names.append(MLA_VARIANT)

    windows = evaluation_token_sequences(compiled.tokenizer, eval_tokens, plan.seq_len)
    models, model_rates = {}, {}
    for name in names:
        for rate in rates:
            label = f"{name} p={rate:.2f}"
            models[label], model_rates[label] = load(output / name, rate=rate), rate
    # Eviction acts between forwards: scored by chunked prefill through its cache. The original's logits do not
    # depend on chunking, so it runs once, whole, for every row.
    models[QUARTER_VARIANT] = load(output / DEFAULT_VARIANT, **QUARTER_OPTIONS)
    baseline = compiled.original_model()
    console.print(f"evaluating {len(models)} variants and the original on {windows.numel()} held-out wiki tokens")
    # One window per forward: the [window, 512, 49K] float32 logits of a bigger batch would double the peak memory.
    results = evaluate_many(
        models, windows, baseline=baseline, batch_size=1, chunks={QUARTER_VARIANT: CODEC_EVAL_CHUNK}
    )
    del models
    model_rates[QUARTER_VARIANT] = QUARTER_OPTIONS["rate"]
    rows = result_rows("SmolLM2-135M-Instruct", results, model_rates)
    console.print(eval_table(rows, title=f"SmolLM2-135M on held-out wiki ({windows.numel()} tokens)"))

    summary = {
        "rows": rows,
        "calibration_tokens": int(compiled.calibration_tokens.numel()),
        "eval_tokens": int(windows.numel()),
        "shared_pass_time_s": compiled.statistics_report["timings_s"],
        "compile_time_s": compile_times,
        "total_time_s": time.perf_counter() - started,
        "configs": {
            **DEMO_CONFIGS,
            QUARTER_VARIANT: {
                "load": {**QUARTER_OPTIONS, "evict": {"keep": 0.57, "bits": [8, 4]}},
                "checkpoint": DEFAULT_VARIANT,
                "eval_chunk": CODEC_EVAL_CHUNK,
            },
        },
    }
    output.mkdir(parents=True, exist_ok=True)
    (output / "demo_results.json").write_text(json.dumps(summary, indent=2))
    _plot(rows, names + [QUARTER_VARIANT], output / "demo_ppl_vs_rate.png")
    console.print(f"results: {output / 'demo_results.json'}, plot: {output / 'demo_ppl_vs_rate.png'}")
    return rows


def _export_mla(calib_tokens: int, rates: list[float], output: Path, console: Console) -> None:
    """The allocated MLA form at the smallest rate's share, its rate table serving exactly the demo's rates:
    `kvrewrite.export_mla` (float32, as the per-head checkpoint is written)."""
    import kvrewrite
    from kvrewrite.compile.mla.plan import MLAPlan

    console.print(f"[cyan]{MLA_VARIANT}[/] statistics, full-width MLA form, sensitivity probes, per-layer widths")
    plan = MLAPlan(
        output=output,
        kv_share=1 - min(rates),
        layer_widths="sensitivity",
        serve_rates=tuple(rates),
        serve_rates_by="table",
        calibration="wiki",
        calib_tokens=calib_tokens,
        dtype="float32",
        overwrite=True,
    )
    result = kvrewrite.export_mla("smollm2-135m", plan)
    ranks = [layer.kv_lora_rank for layer in result.layers]
    console.print(
        f"  {MLA_VARIANT}: latent widths {min(ranks)}..{max(ranks)} per layer, export vs our maths max |Δlogit| = "
        f"{result.export_diff:.2e}, wrote {output}"
    )


def _plot(rows: list[dict], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvrewrite.io.atomic_files import atomic_write

    base = next(r for r in rows if r.get("baseline"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        pts = sorted(
            (r["kv_bytes_per_token"] / base["kv_bytes_per_token"], r["perplexity"])
            for r in rows
            if r["name"].startswith(name)
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    ax.axhline(base["perplexity"], color="gray", linestyle="--", label="original")
    ax.set_xlabel("KV bytes per token (share of original)")
    ax.set_ylabel("held-out wiki perplexity")
    ax.set_title("SmolLM2-135M: quality per KV byte")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)
