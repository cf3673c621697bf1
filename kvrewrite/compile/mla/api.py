"""Python API of the MLA compiler: `kvrewrite.export_mla(source, plan)` writes the MLA form of `source` as a stock
DeepSeek-V3 checkpoint, as an MLAPlan says, and verifies it; `kvrewrite export-mla` is this call plus its flags and
printing.

The steps: statistics once (the per-head compiler's passes), the form at uniform widths or at per-layer widths
placed by measured sensitivity, then the o_proj refit (once, or at each of refit_rates), the distillation (single-rate
or nested over the rate table, then the per-rate refits where asked), the export and the checks against our maths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrewrite.compile.mla.deepseek_v3_export import ExportSummary
from kvrewrite.compile.mla.distill import MLADistillResult
from kvrewrite.compile.mla.plan import DTYPES, MLAPlan
from kvrewrite.compile.mla.rate_refit import RateRefitResult
from kvrewrite.compile.mla.refit import MLARefitResult
from kvrewrite.method.mla import MLALayer


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
    from kvrewrite.adapters import adapter_for
    from kvrewrite.compile.mla.allocation import check_rate_latents
    from kvrewrite.compile.mla.export import (
        check_source_exportable,
        export_at_share,
        export_matches_maths,
        full_width_max_logit_diff,
        mla_layers_at_widths,
        prepare_source,
    )
    from kvrewrite.compile.mla.form import widths_for_ranks, widths_for_share
    from kvrewrite.compile.passes.load_checkpoint import load_config
    from kvrewrite.compile.passes.pipeline import prepare_output
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.progress import progress_bar

    statistics = plan.statistics_plan(source)
    check_source_exportable(statistics)  # the family, before any weight is read
    # The widths, from the config alone, before any weight is read.
    config = load_config(resolve_model_source(statistics.model, revision=statistics.revision).path)
    geometry = adapter_for(config).geometry(config)
    widths = (
        widths_for_share(geometry, plan.kv_share)
        if plan.kv_lora_rank is None
        else widths_for_ranks(geometry, plan.kv_lora_rank, plan.qk_rope_head_dim)
    )
    # Every trained or refitted rate's widths (uniform) or mean width (allocated), from the config alone.
    values = 2 * geometry.num_key_value_heads * geometry.head_dim
    if statistics.distill_rates:
        named = "--serve-rates" if plan.serve_by == "distill" else "--distill-rates"
        check_rate_latents(statistics.distill_rates, values, widths.qk_rope_head_dim, named)
    uniform_rates = None
    if plan.per_rate_refits and plan.allocation == "uniform":
        from kvrewrite.compile.mla.rate_refit import uniform_rate_widths

        uniform_rates = uniform_rate_widths(
            plan.per_rate_refits, values, widths.qk_rope_head_dim, widths.kv_lora_rank, geometry.num_layers
        )
    elif plan.per_rate_refits:
        named = "--serve-rates" if plan.serve_by == "refit" else "--refit-rates"
        check_rate_latents(plan.per_rate_refits, values, widths.qk_rope_head_dim, named)
    elif plan.serve_by == "table":
        check_rate_latents(plan.serve_rates, values, widths.qk_rope_head_dim, "--serve-rates")
    prepare_output(plan.output, statistics)  # leftovers of interrupted exports, then a safe, writable location

    prepared = prepare_source(statistics, position_free_queries=plan.position_free_queries)
    ctx = prepared.ctx
    chosen = getattr(torch, DTYPES[plan.dtype]) if DTYPES[plan.dtype] else _source_dtype(ctx.config)
    weighting = {} if plan.key_weight is None else {"key_weight": plan.key_weight}
    allocation_record, served_rates = None, None
    if plan.allocation == "sensitivity":
        from kvrewrite.compile.mla.allocation import allocation_report
        from kvrewrite.compile.mla.export import allocated_at_share, probe_full_form

        with progress_bar(
            "MLA form at full width, then sensitivity probes", 2 * ctx.geometry.num_layers, statistics.progress
        ) as bar:
            probed = probe_full_form(prepared, progress=bar.advance, **weighting)
        allocated = allocated_at_share(prepared, probed, plan.kv_share, rates=plan.table_rates)
        layers, allocation_record = allocated.layers, allocation_report(allocated.sensitivity, allocated.allocation)
        # Narrower rates are prefixes of one removal order. A single-rate distillation trains the exported widths
        # only, so its export serves those alone; a nested one (distill_rates) keeps the rates it trained (below).
        served_rates = allocated.rate_table
    else:
        with progress_bar("MLA form per layer", ctx.geometry.num_layers, statistics.progress) as bar:
            layers = mla_layers_at_widths(prepared, widths, progress=bar.advance, **weighting)
    norms, provenance, distilled, rate_o_proj, rated, refitted = None, {}, None, None, None, None

    def refit_each_rate(layers, served_rates, norms):
        """refit_rates: o_proj refitted at every named rate (uniform widths, or the served table's rows)."""
        from kvrewrite.compile.mla.rate_refit import refit_mla_at_rates, served_refit_table

        table = (
            uniform_rates if plan.allocation == "uniform" else served_refit_table(plan.per_rate_refits, served_rates)
        )
        rated = refit_mla_at_rates(
            prepared,
            layers,
            table,
            plan.refit_method,
            statistics.refit_tokens,
            statistics.refit_ridge,
            statistics.progress,
        )
        bound = (
            rated.max_square_norms
            if norms is None
            else [max(a, b) for a, b in zip(norms, rated.max_square_norms, strict=True)]
        )
        return rated, bound

    if plan.per_rate_refits and not statistics.distill:
        rated, norms = refit_each_rate(layers, served_rates, norms)
        layers, rate_o_proj, served_rates = rated.layers, rated.rate_o_proj, rated.rate_table
        provenance = {"refit": rated.provenance()}
    elif statistics.refit != "none":
        from kvrewrite.compile.mla.refit import refit_mla_output

        refitted = refit_mla_output(
            prepared,
            layers,
            statistics.refit,
            statistics.refit_tokens,
            statistics.refit_ridge,
            statistics.progress,
            measure_inputs=not statistics.distill,
        )  # a distillation
        # after it measures its own form
        layers, norms, provenance = refitted.layers, refitted.max_square_norms, {"refit": refitted.provenance()}
        served_rates = None  # fitted for the exported widths: the narrower rates of a table are not served
    if statistics.distill:
        from kvrewrite.compile.mla.distill import distill_mla_layers, distill_provenance
        from kvrewrite.errors import InvalidArgumentError
        from kvrewrite.spec import rate_key

        nested = {}
        if statistics.distill_rates:  # the rates the table holds between A and B, each a prefix of the exported widths
            keys = [rate_key(r) for r in statistics.nested_distill_rates() if rate_key(r) in served_rates]
            missing = [rate_key(r) for r in statistics.distill_rates if rate_key(r) not in served_rates]
            if missing:
                raise InvalidArgumentError(
                    f"`distill_rates` {', '.join(missing)} are not in the export's rate table "
                    f"({', '.join(served_rates)})"
                )
            nested = {
                "rate_table": {k: served_rates[k] for k in keys},
                "named_rates": tuple(rate_key(r) for r in statistics.distill_rates),
            }
        distilled = distill_mla_layers(prepared, layers, progress=statistics.progress, **nested)
        layers, norms = distilled.layers, distilled.max_square_norms
        provenance.update(distill_provenance(distilled, statistics))
        served_rates = nested.get("rate_table")  # exactly the rates trained (none beside the export's own: single-rate)
        if plan.per_rate_refits:  # nested: each named rate's o_proj refitted on the trained weights
            rated, norms = refit_each_rate(layers, served_rates, norms)
            layers, rate_o_proj, served_rates = rated.layers, rated.rate_o_proj, rated.rate_table
            provenance["refit"] = {**rated.provenance(), "after": "distill"}
    provenance["position_free_queries"] = plan.position_free_queries
    if allocation_record is not None:  # kept in the marker: how the widths were placed (the probes stay out)
        provenance["allocation"] = {k: v for k, v in allocation_record.items() if k != "probes"}
    summary = export_at_share(
        prepared,
        layers,
        plan.output,
        dtype=chosen,
        overwrite=plan.overwrite,
        max_square_norms=norms,
        provenance=provenance,
        rate_table=served_rates,
        rate_o_proj=rate_o_proj,
    )

    tokens = ctx.calibration_tokens[:1, : plan.verify_tokens]
    full_diff = full_width_max_logit_diff(prepared, tokens)
    export_diff = export_matches_maths(prepared, layers, plan.output, tokens)
    rate_diffs = {}
    if rate_o_proj:
        from kvrewrite.compile.mla.rate_refit import rates_match_maths

        rate_diffs = rates_match_maths(prepared, rated, plan.output, tokens)
    latent_norm_errors = None
    if distilled is not None and distilled.report is not None:
        from kvrewrite.compile.mla.deepseek_v3_export import TRANSFORMERS_LATENT_NORM_EPS
        from kvrewrite.compile.mla.distill import measured_latent_norm_errors

        latent_norm_errors = measured_latent_norm_errors(distilled, summary.neutralisers, TRANSFORMERS_LATENT_NORM_EPS)
    return MLAExport(
        output=plan.output,
        layers=layers,
        summary=summary,
        source_values=2 * ctx.geometry.num_key_value_heads * ctx.geometry.head_dim,
        served_rates=served_rates,
        full_width_diff=full_diff,
        export_diff=export_diff,
        rate_diffs=rate_diffs,
        refit=refitted,
        rate_refit=rated,
        distilled=distilled,
        latent_norm_errors=latent_norm_errors,
    )


def _source_dtype(config) -> torch.dtype:
    """The source's dtype where it can hold the neutralised latent (bfloat16, float32); else float32."""
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name)) if name in ("bfloat16", "float32") else torch.float32
