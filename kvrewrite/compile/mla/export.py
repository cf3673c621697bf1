"""`export-mla` end to end: check the family, collect statistics once, compute the MLA form at a K+V share, write
the DeepSeek-V3 checkpoint, verify it (used by the CLI and by benchmarks/mla_quality.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvrewrite.compile.mla.allocation import (
    LatentAllocation,
    LatentSensitivity,
    allocate_latent_ranks,
    latent_rate_table,
    measure_latent_sensitivity,
    sensitivity_tokens,
)
from kvrewrite.compile.mla.deepseek_v3_export import ExportSummary, export_deepseek_v3
from kvrewrite.compile.mla.form import (
    AttentionInputStatistics,
    MLAWidths,
    check_exportable,
    compute_mla_layers,
    mla_reference_model,
    run_statistics_with_attention_inputs,
    widths_for_share,
)
from kvrewrite.compile.mla.plan import DEFAULT_POSITION_FREE_QUERIES, check_position_free_queries
from kvrewrite.compile.mla.rope_response import measure_rope_response
from kvrewrite.compile.on_device import whole_model_on
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.load_checkpoint import load_config
from kvrewrite.compile.passes.pipeline import statistics_passes
from kvrewrite.compile.plan import DEFAULT_RATE_GRID, Plan
from kvrewrite.io.sources import resolve_model_source
from kvrewrite.method.mla import DEFAULT_KEY_WEIGHT, MLALayer, full_latent_rank, truncate_latent


@dataclass
class PreparedSource:
    ctx: CompileContext  # after the statistics passes: source, adapter, geometry, statistics, calibration windows
    inputs: AttentionInputStatistics
    rope_response: torch.Tensor | None = None  # [layers, heads, head_dim / 2]; None: position-free queries unrotated


def check_source_exportable(plan: Plan) -> None:
    """Before any work: the source's config alone says whether the family fits."""
    resolved = resolve_model_source(plan.model, revision=plan.revision)
    check_exportable(load_config(resolved.path))


def prepare_source(
    plan: Plan, passes: list | None = None, position_free_queries: str = DEFAULT_POSITION_FREE_QUERIES
) -> PreparedSource:
    """The statistics every MLA width is computed from, and (expected-rotation) each head's measured rotation."""
    check_position_free_queries(position_free_queries)
    check_source_exportable(plan)
    ctx = CompileContext(plan=plan)
    ctx, inputs = run_statistics_with_attention_inputs(ctx, passes if passes is not None else statistics_passes())
    response = None
    if position_free_queries == "expected-rotation":
        with whole_model_on(ctx.original_model(), plan.device) as model:
            response = measure_rope_response(model, ctx.calibration_tokens)
    return PreparedSource(ctx, inputs, response)


def mla_layers_at_share(
    prepared: PreparedSource, kv_share: float, key_weight: float = DEFAULT_KEY_WEIGHT, progress=None
) -> tuple[MLAWidths, list[MLALayer]]:
    widths = widths_for_share(prepared.ctx.geometry, kv_share)
    return widths, mla_layers_at_widths(prepared, widths, key_weight=key_weight, progress=progress)


def mla_layers_at_widths(
    prepared: PreparedSource, widths: MLAWidths, key_weight: float = DEFAULT_KEY_WEIGHT, progress=None
) -> list[MLALayer]:
    return compute_mla_layers(
        prepared.ctx,
        prepared.inputs,
        widths,
        key_weight=key_weight,
        progress=progress,
        rope_response=prepared.rope_response,
    )


@dataclass(frozen=True)
class ProbedForm:
    """Every layer at its full latent width, with the measured sensitivity of narrowing each: serves every share."""

    full_layers: list[MLALayer]
    sensitivity: LatentSensitivity
    rope_frequency_stride: int = 1  # d_r = head_dim / stride (every stride-th frequency keeps its rotation)


@dataclass(frozen=True)
class AllocatedForm:
    widths: MLAWidths  # the uniform widths of the same share (target_rank per layer)
    layers: list[MLALayer]  # each at its allocated latent width
    allocation: LatentAllocation
    sensitivity: LatentSensitivity
    rate_table: dict[str, list[int]]  # rate key -> per-layer widths, every one a prefix of `layers`' widths


def probe_full_form(
    prepared: PreparedSource,
    key_weight: float = DEFAULT_KEY_WEIGHT,
    progress=None,
    probe_windows: int | None = None,
    rope_frequency_stride: int = 1,
) -> ProbedForm:
    """Every layer computed once at full latent width (d_r = head_dim / rope_frequency_stride), then probed
    (compile/mla/allocation.py). progress: called once per layer computed and once per layer probed."""
    ctx = prepared.ctx
    geometry = ctx.geometry
    full = MLAWidths(
        1,
        geometry.head_dim // rope_frequency_stride,
        full_latent_rank(geometry, 1, rope_frequency_stride),
        1.0,
        rope_frequency_stride,
    )
    full_layers = compute_mla_layers(
        ctx, prepared.inputs, full, key_weight=key_weight, progress=progress, rope_response=prepared.rope_response
    )
    windows = ctx.plan.probe_windows if probe_windows is None else probe_windows
    tokens = sensitivity_tokens(ctx.calibration_tokens, windows)
    with whole_model_on(ctx.original_model(), ctx.plan.device) as original:
        sensitivity = measure_latent_sensitivity(original, full_layers, tokens.to(ctx.plan.device), progress)
    return ProbedForm(full_layers, sensitivity, rope_frequency_stride)


def allocated_at_share(
    prepared: PreparedSource, probed: ProbedForm, kv_share: float, rates: tuple[float, ...] = DEFAULT_RATE_GRID
) -> AllocatedForm:
    """Per-layer latent widths keeping the uniform form's cached values at this share, placed by measured KL, with a
    rate table over `rates` (those this share can serve)."""
    widths = widths_for_share(prepared.ctx.geometry, kv_share, rope_frequency_stride=probed.rope_frequency_stride)
    allocation = allocate_latent_ranks(probed.full_layers, probed.sensitivity, widths.kv_lora_rank)
    layers = [truncate_latent(layer, rank) for layer, rank in zip(probed.full_layers, allocation.ranks)]
    geometry = prepared.ctx.geometry
    table = latent_rate_table(
        probed.full_layers,
        probed.sensitivity,
        2 * geometry.num_key_value_heads * geometry.head_dim,
        widths.qk_rope_head_dim,
        widths.kv_lora_rank,
        rates,
    )
    return AllocatedForm(widths, layers, allocation, probed.sensitivity, table)


def mla_layers_allocated(
    prepared: PreparedSource,
    kv_share: float,
    key_weight: float = DEFAULT_KEY_WEIGHT,
    progress=None,
    probe_windows: int | None = None,
) -> AllocatedForm:
    return allocated_at_share(prepared, probe_full_form(prepared, key_weight, progress, probe_windows), kv_share)


def export_at_share(
    prepared: PreparedSource,
    layers: list[MLALayer],
    output: Path,
    *,
    dtype: torch.dtype,
    overwrite: bool = False,
    max_square_norms: list[float] | None = None,
    provenance: dict | None = None,
    rate_table: dict[str, list[int]] | None = None,
    rate_o_proj: dict[str, list[torch.Tensor]] | None = None,
) -> ExportSummary:
    """max_square_norms: the attention inputs' largest ||x||^2 per layer for the latent-norm bound (default: the
    original's on the calibration windows; a distilled form passes its own, distill.py); rate_table: narrower
    per-layer widths that kvrewrite.load(dir, rate=p) serves from the same file (AllocatedForm.rate_table);
    rate_o_proj: each narrower rate's own refitted o_proj (rate_refit.py)."""
    norms = prepared.inputs.max_square_norms if max_square_norms is None else max_square_norms
    # The source as compress records it (an absolute path for a local directory, else the Hub id or bundled name):
    # `kvrewrite eval` compares the export with it, from whatever directory it is run.
    marker = {"source_model": prepared.ctx.source_id, **(provenance or {})}
    return export_deepseek_v3(
        prepared.ctx.source,
        layers,
        norms,
        output,
        dtype=dtype,
        overwrite=overwrite,
        provenance=marker,
        rate_table=rate_table,
        rate_o_proj=rate_o_proj,
    )


def full_width_max_logit_diff(prepared: PreparedSource, tokens: torch.Tensor) -> float:
    """The exactness check: the MLA form with every RoPE component kept and a full latent against the original."""
    ctx = prepared.ctx
    n_kv, d = ctx.geometry.num_key_value_heads, ctx.geometry.head_dim
    widths = MLAWidths(n_kv, n_kv * d, full_latent_rank(ctx.geometry, n_kv), 1.0)
    layers = compute_mla_layers(ctx, prepared.inputs, widths)
    tokens = tokens.to(ctx.plan.device)
    with whole_model_on(ctx.original_model(), ctx.plan.device) as model, torch.no_grad():
        return float((mla_reference_model(model, layers)(tokens).logits - model(tokens).logits).abs().max())


def export_matches_maths(prepared: PreparedSource, layers: list[MLALayer], output: Path, tokens: torch.Tensor) -> float:
    """max |Δlogit| between the exported checkpoint in stock transformers (float32) and our maths at the same widths."""
    from transformers import AutoModelForCausalLM

    device = prepared.ctx.plan.device
    exported = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32, trust_remote_code=False).eval()
    tokens = tokens.to(device)
    with torch.no_grad():
        with whole_model_on(prepared.ctx.original_model(), device) as original:
            ours = mla_reference_model(original, layers)(tokens).logits
        return float((exported.to(device)(tokens).logits - ours).abs().max())
