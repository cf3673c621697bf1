"""Pass `refit_rates` (refit_rates, or serve_rates by refit): o_proj refitted at every served rate on its own
(compile/mla/rate_refit.py), on the training-free form or after a nested distillation on the trained one.

The rates: the uniform widths each leaves (from the config), or the named rows of the allocated or trained rate
table. The file then serves exactly those, the narrower ones' o_proj in a side file."""

from __future__ import annotations

from kvrewrite.compile.mla.passes.context import MLAContext
from kvrewrite.compile.mla.rate_refit import refit_mla_at_rates, served_refit_table


class RefitRates:
    name = "refit_rates"
    description = "(refit_rates) o_proj refitted at each served rate, after the distillation where there is one"
    produces = ("rate_refit", "report.refit")  # no refit_output runs with per-rate refits
    # The form with the widest rate's o_proj; the bound's inputs over every rate's form; the refitted rates' table.
    refines = ("layers", "norms", "served_rates")

    def run(self, ctx: MLAContext) -> dict:
        plan, statistics = ctx.plan, ctx.prepared.ctx.plan
        if not plan.per_rate_refits:
            return {}
        table = (
            ctx.uniform_rates
            if plan.layer_widths == "uniform"
            else served_refit_table(plan.per_rate_refits, ctx.served_rates)
        )
        rated = refit_mla_at_rates(
            ctx.prepared,
            ctx.layers,
            table,
            plan.refit_method,
            statistics.refit_tokens,
            statistics.refit_ridge,
            statistics.progress,
        )
        norms = (
            rated.max_square_norms
            if ctx.norms is None
            else [max(a, b) for a, b in zip(ctx.norms, rated.max_square_norms, strict=True)]
        )
        record = rated.provenance() if ctx.distilled is None else {**rated.provenance(), "after": "distill"}
        return {
            "rate_refit": rated,
            "report.refit": record,
            "layers": rated.layers,
            "norms": norms,
            "served_rates": rated.rate_table,
        }
