"""Pass (only with --sequential-statistics): each layer's Grams re-collected on the hidden states it will see at run
time, i.e. after the already-compressed layers before it, and its transforms re-solved from them (GPTQ-style).

collect_statistics measures every layer on the ORIGINAL model's hidden states, but at the compiled rate layer i
receives hidden states that went through layers 0..i-1 truncated to their ranks. This pass streams the calibration
windows once more, one layer at a time:

1. the original layer i runs on the current (compressed-prefix) hidden states, and its Grams are collected;
2. layer i's transforms are solved again from those Grams (same objective, the layer's already chosen key mode);
3. the rewritten layer i, folded with its new transforms and truncated to the ranks allocate_ranks gave it at the
   compiled rate, runs on the same hidden states and gives layer i + 1's input.

The transforms stay exact at full rank (each is still an invertible change of basis), so verify's full-rank check
holds unchanged. `keep-ranks` keeps the first allocation (ranks and rate table); `reallocate` measures the
sensitivity curves again on the new transforms and re-allocates (one more sensitivity pass).
"""

from __future__ import annotations

import dataclasses

import torch

from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.passes.allocate_ranks import AllocateRanks
from kvrewrite.compile.passes.collect_statistics import gram_hooks
from kvrewrite.compile.passes.compute_transforms import LayerTransforms
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.measure_sensitivity import MeasureSensitivity
from kvrewrite.compile.probes import truncated
from kvrewrite.compile.rewrite_spec import build_spec, full_rank_ranks
from kvrewrite.key_modes import key_mode, key_transform
from kvrewrite.method.statistics import CalibrationStatistics, GramAccumulator, LayerStatistics
from kvrewrite.method.value_transforms import value_transform
from kvrewrite.progress import progress_bar
from kvrewrite.spec import rate_key

# What re-allocation replaces: everything measure_sensitivity and allocate_ranks set.
REALLOCATED = (
    "sensitivity_curves",
    "sensitivity",
    "report.sensitivity",
    "rank_solver",
    "target_rate",
    "allocation",
    "rate_table",
    "report.quality_budget",
    "report.allocation",
    "report.rate_table",
)


class SequentialStatistics:
    name = "sequential_statistics"
    description = (
        "(--sequential-statistics) re-collect each layer's Grams on hidden states that went through the "
        "already-compressed layers before it, at the compiled ranks, and re-solve its transforms from them"
    )
    produces = ("report.sequential_statistics",)
    # statistics and transforms: the ones measured on the compressed prefix replace the original-model ones; with
    # `reallocate`, the sensitivity curves and the allocation measured on the new transforms replace the first ones.
    refines = ("statistics", "transforms", *REALLOCATED)

    def run(self, ctx: CompileContext) -> dict:
        plan = ctx.plan
        if plan.sequential_statistics == "off":
            return {}
        ranks = ctx.rate_table[rate_key(ctx.target_rate)]
        statistics, transforms = sequential_statistics(ctx, ranks["key"], ranks["value"])
        changes = [layer_relative_change(a, b) for a, b in zip(ctx.statistics.layers, statistics.layers)]
        results = {
            "statistics": statistics,
            "transforms": transforms,
            "report.sequential_statistics": {
                "mode": plan.sequential_statistics,
                "rate": ctx.target_rate,
                "tokens": statistics.tokens,
                # How far each layer's key_pre Gram moved from the original-model one (relative Frobenius norm).
                "key_gram_relative_change": [round(c, 6) for c in changes],
            },
        }
        if plan.sequential_statistics == "reallocate":
            updated = dataclasses.replace(ctx, statistics=statistics, transforms=transforms)
            measured = MeasureSensitivity().run(updated)
            updated = dataclasses.replace(updated, **{k: v for k, v in measured.items() if not k.startswith("report.")})
            results.update(measured)
            results.update(AllocateRanks().run(updated))
        return results


def layer_relative_change(original: LayerStatistics, sequential: LayerStatistics) -> float:
    a, b = original.grams["key_pre"] / max(original.tokens, 1), sequential.grams["key_pre"] / max(sequential.tokens, 1)
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(a).clamp_min(1e-300))


def sequential_statistics(
    ctx: CompileContext, key_ranks: list[list[int]], value_ranks: list[list[int]]
) -> tuple[CalibrationStatistics, list[LayerTransforms]]:
    """(statistics, transforms) with layer i's measured on the output of layers 0..i-1 rewritten with their new
    transforms and truncated to key_ranks / value_ranks. One layer of each model holds weights at a time."""
    plan, geo = ctx.plan, ctx.geometry
    dtype = plan.compute_dtype(ctx.config)
    original = ctx.source.streamed(dtype, plan.device)
    sink = GramAccumulator(geo.num_layers, geo.num_key_value_heads, geo.num_attention_heads, geo.head_dim)
    metrics = ctx.output_metric or [None] * geo.num_layers
    transforms = list(ctx.transforms)
    full_keys, full_values = full_rank_ranks(ctx)
    rewritten, orders = None, []
    with torch.inference_mode(), progress_bar("sequential statistics", geo.num_layers, plan.progress) as bar:
        hidden = original.embed_batches(list(torch.split(ctx.calibration_tokens, plan.batch_size)))
        for idx in range(geo.num_layers):
            # 1. The original layer on the compressed prefix's hidden states: its Grams (its output is not kept).
            with gram_hooks(original, sink), original.layer(idx) as layer:
                for h in hidden:
                    original.run_layer(layer, h, original.layer_inputs(h))
            stats = LayerStatistics(grams=sink.grams[idx], tokens=sink.tokens[idx])
            # 2. Layer idx's transforms from them (its key mode as compute_transforms chose it).
            o_weight = ctx.source.attention_weights(idx)[0].o_weight
            transforms[idx] = LayerTransforms(
                key_transform(transforms[idx].key.mode, plan.objective, stats, geo),
                value_transform(plan.objective, stats, o_weight, geo, output_metric=metrics[idx]),
            )
            # 3. The rewritten layer idx (new transforms, truncated to its compiled ranks) gives the next input.
            # FoldedWeights reads `transforms` (this list) when it folds a layer, so layer idx folds with its new
            # transforms; the skeleton is rebuilt only when the spec's stored order (freq / crosshead) changed.
            order = key_mode(transforms[idx].key.mode).stored_order(transforms[idx].key)
            if rewritten is None or order != orders[idx]:
                rewritten = FoldedWeights(ctx.source, transforms, geo).streamed(
                    build_spec(ctx, full_keys, full_values, transforms), dtype, plan.device
                )
                orders = [key_mode(t.key.mode).stored_order(t.key) for t in transforms]
            with (
                rewritten.layer(idx) as layer,
                truncated(rewritten.adapter.attention(layer), list(key_ranks[idx]), list(value_ranks[idx])),
            ):
                hidden = [rewritten.run_layer(layer, h, rewritten.layer_inputs(h)) for h in hidden]
            bar.advance()
    layers = [LayerStatistics(grams=g, tokens=t) for g, t in zip(sink.grams, sink.tokens)]
    return CalibrationStatistics(
        layers=layers, tokens=max(sink.tokens, default=0), reduce="none", notes={"sequential": True}
    ), transforms
