"""Pass 6: the spec, and the folded q/k/v/o weights (full rank, ordered) as a layer-by-layer source.

Nothing is folded here for the whole model at once: `FoldedWeights` folds a layer when verify or emit
runs it (kvrewrite/compile/folded_weights.py).
"""

from __future__ import annotations

from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.spec import CompressionSpec, LayerSpec


def build_spec(ctx: CompileContext, key_ranks: list[list[int]], value_ranks: list[list[int]], transforms: list | None = None) -> CompressionSpec:
    """The spec of ctx.transforms (or of `transforms`, e.g. a candidate key mode) at the given ranks."""
    plan, geo = ctx.plan, ctx.geometry
    layer_specs = []
    for idx, transforms in enumerate(transforms if transforms is not None else ctx.transforms):
        freq_order = transforms.key.freq_order.tolist() if transforms.key.freq_order is not None else None
        layer_specs.append(LayerSpec(transforms.key.mode, key_ranks[idx], value_ranks[idx], freq_order))
    spec = CompressionSpec(
        source_model=ctx.report["source"]["model"],
        source_revision=ctx.source_revision,
        base_model_type=ctx.config.model_type,
        num_layers=geo.num_layers,
        num_attention_heads=geo.num_attention_heads,
        num_key_value_heads=geo.num_key_value_heads,
        head_dim=geo.head_dim,
        objective=plan.objective,
        allocation=plan.allocation,
        target_rate=plan.target_rate if ctx.target_rate is None else ctx.target_rate,
        layers=layer_specs,
        rate_table=ctx.report.get("rate_table", {}),
        rank_multiple=plan.rank_multiple,
    )
    spec.validate()
    return spec


class FoldWeights:
    name = "fold_weights"
    description = "fold the transforms into q_proj/k_proj/v_proj/o_proj and biases (full rank, ordered) and build the spec"

    def run(self, ctx: CompileContext) -> None:
        geo = ctx.geometry
        key_ranks, value_ranks = ctx.allocation.as_lists(geo.num_layers, geo.num_key_value_heads)
        if ctx.folded is None:  # measure_sensitivity may have made it already
            ctx.folded = FoldedWeights(ctx.source, ctx.transforms, geo)
        ctx.spec = build_spec(ctx, key_ranks, value_ranks)
