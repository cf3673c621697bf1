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
        mode = plan.key_mode()
        ctx.transforms = []
        for idx, stats in enumerate(ctx.statistics.layers):
            # The value side needs W_O: read that one tensor of the layer from the shards.
            name = f"{ctx.source.attention_prefix(idx)}.o_proj.weight"
            o_proj = ctx.source.read([name])[name].double()
            ctx.transforms.append(
                LayerTransforms(
                    key=key_transform(mode, plan.objective, stats, geo),
                    value=value_transform(plan.objective, stats, o_proj, geo),
                )
            )
        ctx.report["transforms"] = {"objective": plan.objective, "key_mode": mode}
