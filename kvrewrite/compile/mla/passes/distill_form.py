"""Pass `distill` (distill): the form's own weights trained against the original's next-token distribution at the
exported widths (compile/mla/distill.py), or nested (distill_rates) over the rate table's rates between the named
ones, each a prefix of the exported widths.

The file then serves exactly the rates trained: the nested ones, or none beside the export's own."""

from __future__ import annotations

from kvrewrite.compile.mla.distill import distill_mla_layers, distill_provenance
from kvrewrite.compile.mla.passes.context import MLAContext
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.spec import rate_key


class DistillForm:
    name = "distill"
    description = "(distill) the form's weights trained against the original, at one rate or nested over the table"
    produces = ("distilled", "report.distill")
    # The trained form; the latent-norm bound's inputs measured on it; the rate table it was trained for.
    refines = ("layers", "norms", "served_rates")

    def run(self, ctx: MLAContext) -> dict:
        statistics = ctx.prepared.ctx.plan
        if not statistics.distill:
            return {}
        served, nested = ctx.served_rates, {}
        if statistics.distill_rates:  # the rates the table holds between A and B, each a prefix of the exported widths
            keys = [rate_key(r) for r in statistics.nested_distill_rates() if rate_key(r) in served]
            missing = [rate_key(r) for r in statistics.distill_rates if rate_key(r) not in served]
            if missing:
                raise InvalidArgumentError(
                    f"`distill_rates` {', '.join(missing)} are not in the export's rate table ({', '.join(served)})"
                )
            nested = {
                "rate_table": {k: served[k] for k in keys},
                "named_rates": tuple(rate_key(r) for r in statistics.distill_rates),
            }
        distilled = distill_mla_layers(ctx.prepared, ctx.layers, progress=statistics.progress, **nested)
        return {
            "distilled": distilled,
            "report.distill": distill_provenance(distilled, statistics)["distill"],
            "layers": distilled.layers,
            "norms": distilled.max_square_norms,
            "served_rates": nested.get("rate_table"),
        }
