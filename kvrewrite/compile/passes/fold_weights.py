"""Pass 6: the spec, and the folded q/k/v/o weights (full rank, ordered) as a layer-by-layer source.

Nothing is folded here for the whole model at once: `FoldedWeights` folds a layer when verify or emit
runs it (kvrewrite/compile/folded_weights.py).
"""

from __future__ import annotations

from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.rewrite_spec import build_spec


class FoldWeights:
    name = "fold_weights"
    description = (
        "fold the transforms into q_proj/k_proj/v_proj/o_proj and biases (full rank, ordered) and build the spec"
    )

    produces = ("folded", "spec")

    def run(self, ctx: CompileContext) -> dict:
        geo = ctx.geometry
        key_ranks, value_ranks = ctx.allocation.as_lists(geo.num_layers, geo.num_key_value_heads)
        return {
            "folded": FoldedWeights(ctx.source, ctx.transforms, geo),
            "spec": build_spec(ctx, key_ranks, value_ranks),
        }
