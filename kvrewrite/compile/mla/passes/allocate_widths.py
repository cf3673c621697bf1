"""Pass `allocate` (layer_widths=sensitivity): each layer's latent width placed by its measured sensitivity, keeping the
uniform form's cached values at kv_share, and the rate table over plan.table_rates.

Every narrower rate is a prefix of one removal order, so one file serves the table (kvrewrite.load(dir, rate=p)).
A refit or distillation at the exported widths that follows replaces the table with what it fitted."""

from __future__ import annotations

from kvrewrite.compile.mla.allocation import allocation_report
from kvrewrite.compile.mla.export import allocated_at_share
from kvrewrite.compile.mla.passes.context import MLAContext


class AllocateWidths:
    name = "allocate"
    description = "(layer_widths=sensitivity) per-layer latent widths by measured KL, and the served rate table"
    produces = ("report.allocation",)
    # The full-width layers `form` computed, narrowed to their allocated widths; the table their prefixes serve.
    refines = ("layers", "served_rates")

    def run(self, ctx: MLAContext) -> dict:
        plan = ctx.plan
        if plan.layer_widths != "sensitivity":
            return {}
        allocated = allocated_at_share(ctx.prepared, ctx.probed, plan.kv_share, rates=plan.table_rates)
        record = allocation_report(allocated.sensitivity, allocated.allocation)
        return {
            "layers": allocated.layers,
            "served_rates": allocated.rate_table,
            # kept in the marker: how the widths were placed (the probes stay out)
            "report.allocation": {k: v for k, v in record.items() if k != "probes"},
        }
