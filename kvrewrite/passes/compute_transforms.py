"""Pass 4: per layer and KV head, the key-side and value-side transforms (full rank, ordered)."""

from __future__ import annotations

from dataclasses import dataclass

from kvrewrite.key_transforms import KeyTransform, key_transform
from kvrewrite.passes.context import CompileContext
from kvrewrite.value_transforms import ValueTransform, value_transform


@dataclass
class LayerTransforms:
    key: KeyTransform
    value: ValueTransform


class ComputeTransforms:
    name = "compute_transforms"
    description = "solve the key-side (per RoPE mode) and value-side transforms from the Grams"

    def run(self, ctx: CompileContext) -> None:
        plan, geo = ctx.plan, ctx.geometry
        mode = ctx.key_mode
        layers = ctx.adapter.decoder_layers(ctx.model)
        ctx.transforms = []
        for layer, stats in zip(layers, ctx.statistics.layers):
            o_proj = ctx.adapter.projections(ctx.adapter.attention(layer)).o_weight
            ctx.transforms.append(
                LayerTransforms(
                    key=key_transform(mode, plan.objective, stats, geo),
                    value=value_transform(plan.objective, stats, o_proj, geo),
                )
            )
        ctx.report["transforms"] = {"objective": plan.objective, "key_mode": mode}
