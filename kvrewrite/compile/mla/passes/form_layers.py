"""Pass `form`: the MLA form of every layer from the statistics, at the uniform widths, or (layer_widths=sensitivity)
at full latent width with each layer's measured sensitivity to narrowing, which `allocate` reads.

It starts the three fields that describe what the export holds: the layers, the latent-norm bound's inputs (None:
the original's, measured with the statistics) and the served rate table (none yet: a uniform form has none, an
allocated one gets it from `allocate`)."""

from __future__ import annotations

from kvrewrite.compile.mla.export import mla_layers_at_widths, probe_full_form
from kvrewrite.compile.mla.passes.context import MLAContext
from kvrewrite.progress import progress_bar


class FormLayers:
    name = "form"
    description = "the MLA form per layer at the uniform widths, or at full width with sensitivity probes"
    produces = ("layers", "norms", "served_rates", "probed")
    refines = ()

    def run(self, ctx: MLAContext) -> dict:
        plan, prepared = ctx.plan, ctx.prepared
        geometry, progress = prepared.ctx.geometry, prepared.ctx.plan.progress
        weighting = {} if plan.key_weight is None else {"key_weight": plan.key_weight}
        if plan.layer_widths == "sensitivity":
            with progress_bar(
                "MLA form at full width, then sensitivity probes", 2 * geometry.num_layers, progress
            ) as bar:
                probed = probe_full_form(prepared, progress=bar.advance, **weighting)
            return {"layers": probed.full_layers, "norms": None, "served_rates": None, "probed": probed}
        with progress_bar("MLA form per layer", geometry.num_layers, progress) as bar:
            layers = mla_layers_at_widths(prepared, ctx.widths, progress=bar.advance, **weighting)
        return {"layers": layers, "norms": None, "served_rates": None}
