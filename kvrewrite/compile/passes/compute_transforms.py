"""Pass 4: per layer and KV head, the key-side and value-side transforms (full rank, ordered)."""

from __future__ import annotations

from dataclasses import dataclass

from kvrewrite.compile.key_mode_choice import choose_key_modes
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.errors import UnsupportedModelError
from kvrewrite.key_modes import KeyTransform, allowed_key_modes, key_transform, preferred_key_modes, resolve_key_mode
from kvrewrite.method.value_transforms import ValueTransform, value_transform


@dataclass
class LayerTransforms:
    key: KeyTransform
    value: ValueTransform


class ComputeTransforms:
    name = "compute_transforms"
    description = "solve the key-side (per RoPE mode) and value-side transforms from the Grams"

    produces = ("transforms", "report.transforms", "report.key_mode_choice")
    # key_mode: load_checkpoint resolved it early (to fail before any work) from the plan it saw; a variant of
    # compile_variants (sweep, demo) may override rope_mode, so it is resolved again from this pass's plan.
    refines = ("key_mode",)

    def run(self, ctx: CompileContext) -> dict:
        plan, geo = ctx.plan, ctx.geometry
        metrics = ctx.output_metric or [None] * len(ctx.statistics.layers)
        values = []
        for idx, stats in enumerate(ctx.statistics.layers):
            # The value side needs W_O: that layer's attention is read from the shards (split if stored fused).
            o_weight = ctx.source.attention_weights(idx)[0].o_weight
            values.append(value_transform(plan.objective, stats, o_weight, geo, output_metric=metrics[idx]))
        # `auto` = every mode the family allows (and the preference admits) competes per layer.
        resolved = resolve_key_mode(ctx.adapter, ctx.config, plan.rope_mode, plan.objective)
        allowed = allowed_key_modes(ctx.adapter, ctx.config)
        modes = [resolved] if resolved != "auto" else [m for m in preferred_key_modes(plan.prefer) if m in allowed]
        if not modes:
            raise UnsupportedModelError(
                f"`prefer={plan.prefer}` leaves no key mode for this model (allowed: {', '.join(allowed)})"
            )
        candidates = {
            m: [
                LayerTransforms(key_transform(m, plan.objective, stats, geo), v)
                for stats, v in zip(ctx.statistics.layers, values)
            ]
            for m in modes
        }
        report = {
            "objective": plan.objective,
            "key_mode": modes[0] if len(modes) == 1 else "auto",
            "value_metric": plan.value_metric,
        }
        if len(modes) == 1:
            return {"key_mode": resolved, "transforms": candidates[modes[0]], "report.transforms": report}
        chosen, choice = choose_key_modes(ctx, candidates, plan.key_mode_cost)
        return {
            "key_mode": resolved,
            "transforms": [candidates[m][i] for i, m in enumerate(chosen)],
            "report.transforms": {**report, "prefer": plan.prefer, "key_modes": chosen},
            "report.key_mode_choice": choice,
        }
