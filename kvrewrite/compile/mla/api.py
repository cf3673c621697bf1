"""Python API of the MLA compiler: `kvrewrite.export_mla(source, plan)` writes the MLA form of `source` as a stock
DeepSeek-V3 checkpoint, as an MLAPlan says, and verifies it; `kvrewrite export-mla` is this call plus its flags and
printing.

What the source's config decides is checked first, then the statistics are collected once (the per-head compiler's
statistics passes), then the MLA passes run over one frozen MLAContext, each by the per-head compiler's `run_pass`
(compile/mla/passes/pipeline.py: form, allocate, refit_output, distill, refit_rates, export, verify).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvrewrite.compile.mla.deepseek_v3_export import ExportSummary
from kvrewrite.compile.mla.distill import MLADistillResult
from kvrewrite.compile.mla.plan import MLAPlan
from kvrewrite.compile.mla.rate_refit import RateRefitResult
from kvrewrite.compile.mla.refit import MLARefitResult
from kvrewrite.method.mla import MLALayer

if TYPE_CHECKING:
    from kvrewrite.compile.mla.form import MLAWidths
    from kvrewrite.compile.mla.passes.context import MLAContext


@dataclass(frozen=True)
class MLAExport:
    """What `export_mla` wrote and measured."""

    output: Path
    layers: list[MLALayer]  # the exported form, per layer
    summary: ExportSummary  # the written checkpoint: its dtype and each layer's kv_a_layernorm neutraliser
    source_values: int  # the source's cached K+V values per token and layer (2 n_kv d)
    served_rates: dict[str, list[int]] | None  # the rate table kvrewrite.load(dir, rate=p) serves, if any
    full_width_diff: float  # max |Δlogit| of the full-width form (every RoPE component, full latent) vs the original
    export_diff: float  # max |Δlogit| of the checkpoint in stock transformers vs our maths
    rate_diffs: dict[str, float] = field(default_factory=dict)  # per refitted rate: kvrewrite.load at it vs our maths
    refit: MLARefitResult | None = None  # the single-rate o_proj refit
    rate_refit: RateRefitResult | None = None  # the per-rate o_proj refits (refit_rates)
    distilled: MLADistillResult | None = None
    # per layer, the trained form's measured kv_a_layernorm neutralisation error on calibration tokens (distill)
    latent_norm_errors: list[float] | None = None


def export_mla(source: str, plan: MLAPlan) -> MLAExport:
    """Write the MLA form of `source` (Hub id, local directory or 'smollm2-135m') to plan.output and verify it.

    Everything the source's config decides is checked before any weight is read: the family, the widths the share
    or exact ranks give, the latent every trained or refitted rate leaves, the output location."""
    ctx = run_mla_export(source, plan)
    geometry = ctx.prepared.ctx.geometry
    return MLAExport(
        output=plan.output,
        layers=ctx.layers,
        summary=ctx.summary,
        source_values=2 * geometry.num_key_value_heads * geometry.head_dim,
        served_rates=ctx.served_rates,
        full_width_diff=ctx.full_width_diff,
        export_diff=ctx.export_diff,
        rate_diffs=ctx.rate_diffs,
        refit=ctx.refit,
        rate_refit=ctx.rate_refit,
        distilled=ctx.distilled,
        latent_norm_errors=ctx.latent_norm_errors,
    )


def run_mla_export(source: str, plan: MLAPlan, passes: list | None = None) -> MLAContext:
    """The context after the MLA passes (default: mla_passes()): the config checks, the output location, the
    statistics, then every pass by run_pass."""
    from kvrewrite.compile.mla.export import check_source_exportable, prepare_source
    from kvrewrite.compile.mla.passes.context import MLAContext
    from kvrewrite.compile.mla.passes.pipeline import run_mla_passes
    from kvrewrite.compile.passes.pipeline import prepare_output

    statistics = plan.statistics_plan(source)
    check_source_exportable(statistics)  # the family, before any weight is read
    widths, uniform_rates = _checked_widths(plan, statistics)
    prepare_output(plan.output, statistics)  # leftovers of interrupted exports, then a safe, writable location
    prepared = prepare_source(statistics, position_free_queries=plan.position_free_queries)
    ctx = MLAContext(plan=plan, prepared=prepared, widths=widths, uniform_rates=uniform_rates)
    return run_mla_passes(ctx, passes)


def _checked_widths(plan: MLAPlan, statistics) -> tuple[MLAWidths, dict[str, list[int]] | None]:
    """From the config alone, before any weight is read: the uniform widths, the latent every trained or refitted
    rate leaves (their mean width where allocated), and a uniform export's per-rate widths (per-rate refits)."""
    from kvrewrite.adapters import adapter_for
    from kvrewrite.compile.mla.allocation import check_rate_latents
    from kvrewrite.compile.mla.form import widths_for_ranks, widths_for_share
    from kvrewrite.compile.passes.load_checkpoint import load_config
    from kvrewrite.io.sources import resolve_model_source

    config = load_config(resolve_model_source(statistics.model, revision=statistics.revision).path)
    geometry = adapter_for(config).geometry(config)
    widths = (
        widths_for_share(geometry, plan.kv_share)
        if plan.kv_lora_rank is None
        else widths_for_ranks(geometry, plan.kv_lora_rank, plan.qk_rope_head_dim)
    )
    values = 2 * geometry.num_key_value_heads * geometry.head_dim
    if statistics.distill_rates:
        named = "`serve_rates`" if plan.serve_by == "distill" else "`distill_rates`"
        check_rate_latents(statistics.distill_rates, values, widths.qk_rope_head_dim, named)
    uniform_rates = None
    if plan.per_rate_refits and plan.layer_widths == "uniform":
        from kvrewrite.compile.mla.rate_refit import uniform_rate_widths

        uniform_rates = uniform_rate_widths(
            plan.per_rate_refits, values, widths.qk_rope_head_dim, widths.kv_lora_rank, geometry.num_layers
        )
    elif plan.per_rate_refits:
        named = "`serve_rates`" if plan.serve_by == "refit" else "`refit_rates`"
        check_rate_latents(plan.per_rate_refits, values, widths.qk_rope_head_dim, named)
    elif plan.serve_by == "table":
        check_rate_latents(plan.serve_rates, values, widths.qk_rope_head_dim, "`serve_rates`")
    return widths, uniform_rates
