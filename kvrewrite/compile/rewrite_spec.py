"""The CompressionSpec of the compile's transforms at given ranks (what fold_weights emits, and the full-rank spec the
probing passes stream the rewrite with)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrewrite.key_modes import key_mode
from kvrewrite.spec import CompressionSpec, LayerSpec, full_key_ranks

if TYPE_CHECKING:
    from kvrewrite.compile.passes.context import CompileContext


def build_spec(
    ctx: CompileContext, key_ranks: list[list[int]], value_ranks: list[list[int]], transforms: list | None = None
) -> CompressionSpec:
    """The spec of ctx.transforms (or of `transforms`, e.g. a candidate key mode) at the given ranks."""
    plan, geo = ctx.plan, ctx.geometry
    layer_specs = []
    for idx, layer_transforms in enumerate(transforms if transforms is not None else ctx.transforms):
        freq_order = key_mode(layer_transforms.key.mode).stored_order(layer_transforms.key)
        layer_specs.append(LayerSpec(layer_transforms.key.mode, key_ranks[idx], value_ranks[idx], freq_order))
    spec = CompressionSpec(
        source_model=ctx.source_id,
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
        rate_table=ctx.rate_table or {},  # none yet while the probing passes run, before allocate_ranks
        rank_multiple=plan.rank_multiple,
    )
    spec.validate()
    return spec


def full_rank_ranks(ctx: CompileContext, transforms: list | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(key ranks, value ranks) per layer at full rank for ctx.transforms (or `transforms`)."""
    geo, d = ctx.geometry, ctx.geometry.head_dim
    full_keys = [
        full_key_ranks(t.key.mode, geo.num_key_value_heads, d)
        for t in (transforms if transforms is not None else ctx.transforms)
    ]
    return full_keys, [[d] * geo.num_key_value_heads for _ in range(geo.num_layers)]
