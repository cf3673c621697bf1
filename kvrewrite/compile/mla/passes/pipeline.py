"""The MLA export: an ordered list of passes over one MLAContext, run by the per-head compiler's `run_pass`.

Reads like the method: the form from the statistics (export_mla collects them first, with the per-head compiler's
statistics passes), its widths placed by measured sensitivity, the o_proj refit at the exported widths, the
distillation, the o_proj refits at each served rate, the checkpoint, the checks. A pass whose option is off returns
nothing."""

from __future__ import annotations

from kvrewrite.compile.mla.passes.allocate_widths import AllocateWidths
from kvrewrite.compile.mla.passes.context import MLAContext
from kvrewrite.compile.mla.passes.distill_form import DistillForm
from kvrewrite.compile.mla.passes.form_layers import FormLayers
from kvrewrite.compile.mla.passes.refit_output import RefitOutput
from kvrewrite.compile.mla.passes.refit_rates import RefitRates
from kvrewrite.compile.mla.passes.verify_export import VerifyExport
from kvrewrite.compile.mla.passes.write_checkpoint import WriteCheckpoint
from kvrewrite.compile.passes.base import run_pass


def mla_passes() -> list:
    return [
        FormLayers(),  # statistics -> the MLA form per layer (uniform widths, or full width and sensitivity probes)
        AllocateWidths(),  # (layer_widths=sensitivity) per-layer latent widths by measured KL, the served rate table
        RefitOutput(),  # (refit, one rate) o_proj refitted by least squares at the exported widths
        DistillForm(),  # (distill) the form trained against the original, at one rate or nested over the table
        RefitRates(),  # (refit_rates) o_proj refitted at each served rate, on the trained form where there is one
        WriteCheckpoint(),  # the DeepSeek-V3 checkpoint with its rate table and marker
        VerifyExport(),  # the full-width form, the checkpoint and each refitted rate against our maths
    ]


def run_mla_passes(ctx: MLAContext, passes: list | None = None) -> MLAContext:
    for step in mla_passes() if passes is None else passes:
        ctx = run_pass(ctx, step)
    return ctx
