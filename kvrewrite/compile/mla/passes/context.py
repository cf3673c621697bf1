"""The state that flows through the MLA export's passes: a frozen record of what they have produced so far.

As the per-head compiler's CompileContext (compile/passes/context.py), a pass never assigns to it: it returns its
results and `run_pass` (compile/passes/base.py) makes the next context, refusing a result the pass did not declare.
The first four fields are set by `export_mla` before any pass runs (`pipeline_fields`: no pass may return them);
each of the others names the pass that produces it, and the passes that refine it.

`report` holds the sections of the checkpoint's kvrewrite_mla marker (allocation, refit, distill) as
`report.<section>` results, as compress's passes write compress_report.json's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Mapping

from kvrewrite.compile.mla.deepseek_v3_export import ExportSummary
from kvrewrite.compile.mla.distill import MLADistillResult
from kvrewrite.compile.mla.export import PreparedSource, ProbedForm
from kvrewrite.compile.mla.form import MLAWidths
from kvrewrite.compile.mla.plan import MLAPlan
from kvrewrite.compile.mla.rate_refit import RateRefitResult
from kvrewrite.compile.mla.refit import MLARefitResult
from kvrewrite.method.mla import MLALayer


@dataclass(frozen=True)
class MLAContext:
    plan: MLAPlan
    # the statistics passes' context (its plan: MLAPlan.statistics_plan), the attention inputs, the rotations
    prepared: PreparedSource
    widths: MLAWidths  # the uniform widths kv_share (or kv_lora_rank) gives, from the config
    # per-rate refits of a uniform export: rate key -> per-layer latent widths, from the config (else None)
    uniform_rates: dict[str, list[int]] | None = None
    # form (allocate, refit_output, distill and refit_rates refine the three that describe what the export holds)
    layers: list[MLALayer] | None = None  # the form the checkpoint holds
    # per layer, the largest attention input ||x||^2 for the latent-norm bound; None: the original's on calibration
    norms: list[float] | None = None
    served_rates: dict[str, list[int]] | None = None  # the rate table kvrewrite.load(dir, rate=p) serves
    probed: ProbedForm | None = None  # (layer_widths=sensitivity) the full-width form and its measured sensitivity
    # refit_output
    refit: MLARefitResult | None = None
    # distill
    distilled: MLADistillResult | None = None
    # refit_rates
    rate_refit: RateRefitResult | None = None
    # export
    summary: ExportSummary | None = None
    # verify
    full_width_diff: float | None = None
    export_diff: float | None = None
    rate_diffs: dict[str, float] | None = None
    latent_norm_errors: list[float] | None = None
    # Sections of the checkpoint's kvrewrite_mla marker (allocation, refit, distill); never mutated in place.
    report: dict = field(default_factory=dict)
    # field (or "report.<section>") -> the pass that set it; kept by run_pass, read by no pass.
    provenance: Mapping[str, str] = field(default_factory=dict, repr=False)

    pipeline_fields: ClassVar[tuple[str, ...]] = ("plan", "prepared", "widths", "uniform_rates", "report", "provenance")
