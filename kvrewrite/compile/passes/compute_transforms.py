"""Pass 4: per layer and KV head, the key-side and value-side transforms (full rank, ordered)."""

from __future__ import annotations

from dataclasses import dataclass

from kvrewrite.errors import UnsupportedModelError
from kvrewrite.compile.key_mode_choice import choose_key_modes
from kvrewrite.key_modes import KeyTransform, allowed_key_modes, key_transform, preferred_key_modes, resolve_key_mode
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.method.value_transforms import ValueTransform, value_transform


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
            # The value side needs W_O: that layer's attention is read from the shards (split if stored fused).
            o_weight = ctx.source.attention_weights(idx)[0].o_weight
            values.append(value_transform(plan.objective, stats, o_weight, geo, output_metric=metrics[idx]))
        # Resolved again from this plan: load_checkpoint's early check ran on the shared plan, and variants of
        # compile_variants (sweep, demo) may override rope_mode. `auto` = every mode the family allows (and the
        # preference admits) competes per layer.
        ctx.key_mode = resolve_key_mode(ctx.adapter, ctx.config, plan.rope_mode, plan.objective)
        allowed = allowed_key_modes(ctx.adapter, ctx.config)
        modes = [ctx.key_mode] if ctx.key_mode != "auto" else [m for m in preferred_key_modes(plan.prefer) if m in allowed]
        if not modes:
            raise UnsupportedModelError(f"`prefer={plan.prefer}` leaves no key mode for this model (allowed: {', '.join(allowed)})")
        candidates = {
            m: [LayerTransforms(key_transform(m, plan.objective, stats, geo), v) for stats, v in zip(ctx.statistics.layers, values)]
            for m in modes
        }
        ctx.transforms = candidates[modes[0]]
        ctx.report["transforms"] = {"objective": plan.objective, "key_mode": modes[0] if len(modes) == 1 else "auto", "value_metric": plan.value_metric}
        if len(modes) > 1:
            chosen, report = choose_key_modes(ctx, candidates, plan.key_mode_cost)
            ctx.transforms = [candidates[m][i] for i, m in enumerate(chosen)]
            ctx.report["transforms"]["prefer"] = plan.prefer
            ctx.report["transforms"]["key_modes"] = chosen
            ctx.report["key_mode_choice"] = report
