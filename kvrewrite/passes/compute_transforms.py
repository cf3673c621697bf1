"""Pass 4: per layer and KV head, the key-side and value-side transforms (full rank, ordered)."""

from __future__ import annotations

from dataclasses import dataclass

from kvrewrite.key_mode_choice import PREFERENCES, choose_key_modes
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
        metrics = ctx.output_metric or [None] * len(ctx.statistics.layers)
        values = []
        for idx, stats in enumerate(ctx.statistics.layers):
            # The value side needs W_O: read that one tensor of the layer from the shards.
            name = f"{ctx.source.attention_prefix(idx)}.o_proj.weight"
            o_proj = ctx.source.read([name])[name].double()
            values.append(value_transform(plan.objective, stats, o_proj, geo, output_metric=metrics[idx]))
        modes = [plan.rope_mode] if plan.rope_mode != "auto" else list(PREFERENCES[plan.prefer])
        candidates = {
            m: [LayerTransforms(key_transform(m, plan.objective, stats, geo), v) for stats, v in zip(ctx.statistics.layers, values)]
            for m in modes
        }
        ctx.transforms = candidates[modes[0]]
        ctx.report["transforms"] = {"objective": plan.objective, "key_mode": plan.rope_mode, "value_metric": plan.value_metric}
        if len(modes) > 1:
            chosen, report = choose_key_modes(ctx, candidates, plan.key_mode_cost)
            ctx.transforms = [candidates[m][i] for i, m in enumerate(chosen)]
            ctx.report["transforms"]["prefer"] = plan.prefer
            ctx.report["transforms"]["key_modes"] = chosen
            ctx.report["key_mode_choice"] = report
