"""Pass `refit_output` (refit=output|output-local, without per-rate refits): every o_proj refitted by least squares
at the exported widths (compile/mla/refit.py).

The refit is for those widths, so the file serves them alone: the rate table an allocation gave is dropped. A
distillation that follows measures its own trained form's attention inputs, so the refit skips that measurement."""

from __future__ import annotations

from kvrewrite.compile.mla.passes.context import MLAContext
from kvrewrite.compile.mla.refit import refit_mla_output


class RefitOutput:
    name = "refit_output"
    description = "(refit=output|output-local) every o_proj refitted by least squares at the exported widths"
    produces = ("refit", "report.refit")
    # The form with refitted o_proj; the latent-norm bound's inputs over the refitted form too; no rate table.
    refines = ("layers", "norms", "served_rates")

    def run(self, ctx: MLAContext) -> dict:
        statistics = ctx.prepared.ctx.plan
        if statistics.refit == "none":  # also with per-rate refits, which refit_rates runs
            return {}
        refitted = refit_mla_output(
            ctx.prepared,
            ctx.layers,
            statistics.refit,
            statistics.refit_tokens,
            statistics.refit_ridge,
            statistics.progress,
            measure_inputs=not statistics.distill,
        )
        return {
            "refit": refitted,
            "report.refit": refitted.provenance(),
            "layers": refitted.layers,
            "norms": refitted.max_square_norms,
            "served_rates": None,
        }
