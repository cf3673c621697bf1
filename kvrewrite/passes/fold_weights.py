"""Pass 6: fold the transforms into q/k/v/o weights (full rank, ordered) and write the spec.

All products are formed in float64 and cast back to the model's dtype once.
"""

from __future__ import annotations

import torch

from kvrewrite.key_transforms import interleaved_pair_rows
from kvrewrite.passes.context import CompileContext
from kvrewrite.spec import KEY_MODE_CROSSHEAD, KEY_MODE_FREQ, KEY_MODE_LATENT, KEY_MODE_POST_ROPE, CompressionSpec, LayerSpec


def fold_layer(attn, transforms, geometry) -> dict[str, torch.Tensor]:
    """New attention tensors of one layer, keyed by their name inside the attention module."""
    d, group = geometry.head_dim, geometry.group_size
    dtype = attn.q_proj.weight.dtype
    w_q = attn.q_proj.weight.detach().double()
    w_k = attn.k_proj.weight.detach().double()
    w_v = attn.v_proj.weight.detach().double()
    w_o = attn.o_proj.weight.detach().double()
    key, value = transforms.key, transforms.value
    out: dict[str, torch.Tensor] = {}

    new_q, new_k, new_v, new_o = w_q.clone(), w_k.clone(), w_v.clone(), w_o.clone()
    for g in range(geometry.num_key_value_heads):
        kv_rows = slice(g * d, (g + 1) * d)
        # Value side: v latents = v @ down  =>  rows of W_v become down^T W_v; o_proj columns of every
        # query head in the group absorb up (W_o[:, h] -> W_o[:, h] up^T).
        new_v[kv_rows] = value.down[g].T @ w_v[kv_rows]
        for h in geometry.query_heads_of(g):
            new_o[:, h * d : (h + 1) * d] = w_o[:, h * d : (h + 1) * d] @ value.up[g].T
        if key.mode == KEY_MODE_FREQ:
            rows = interleaved_pair_rows(key.freq_order[g], d)
            new_k[kv_rows] = w_k[kv_rows][rows]
            for h in geometry.query_heads_of(g):
                new_q[h * d : (h + 1) * d] = w_q[h * d : (h + 1) * d][rows]
        elif key.mode == KEY_MODE_LATENT:
            new_k[kv_rows] = key.down[g].T @ w_k[kv_rows]
    if key.mode == KEY_MODE_CROSSHEAD:
        # Every query head now scores against the whole shared key block: n_kv*d rows per head at full rank.
        new_k = key.k_fold @ w_k
        new_q = torch.cat([key.q_fold[h] @ w_q[h * d : (h + 1) * d] for h in range(geometry.num_attention_heads)])
    out["q_proj.weight"] = new_q
    out["k_proj.weight"] = new_k
    out["v_proj.weight"] = new_v
    out["o_proj.weight"] = new_o
    if key.mode == KEY_MODE_POST_ROPE:
        out["q_map"] = key.q_map
        out["k_map"] = key.k_map
    elif key.mode == KEY_MODE_LATENT:
        out["k_up"] = key.up
    return {name: t.to(dtype).contiguous() for name, t in out.items()}


def folded_state_dict(model, adapter, transforms, geometry) -> dict[str, torch.Tensor]:
    """The whole model's state dict with every layer's attention rewritten (full rank)."""
    state = {name: t.detach() for name, t in model.state_dict().items()}
    for layer, layer_transforms in zip(adapter.decoder_layers(model), transforms):
        attn = adapter.attention(layer)
        prefix = next(n for n, m in model.named_modules() if m is attn)
        for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
            state.pop(f"{prefix}.{name}")
        for name, tensor in fold_layer(attn, layer_transforms, geometry).items():
            state[f"{prefix}.{name}"] = tensor
    return state


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
        base_model_type=ctx.model.config.model_type,
        num_layers=geo.num_layers,
        num_attention_heads=geo.num_attention_heads,
        num_key_value_heads=geo.num_key_value_heads,
        head_dim=geo.head_dim,
        objective=plan.objective,
        allocation=plan.allocation,
        target_rate=plan.target_rate,
        layers=layer_specs,
        rate_table=ctx.report.get("rate_table", {}),
        rank_multiple=plan.rank_multiple,
    )
    spec.validate()
    return spec


class FoldWeights:
    name = "fold_weights"
    description = "fold the transforms into q_proj/k_proj/v_proj/o_proj (full rank, ordered) and build the spec"

    def run(self, ctx: CompileContext) -> None:
        geo = ctx.geometry
        key_ranks, value_ranks = ctx.allocation.as_lists(geo.num_layers, geo.num_key_value_heads)
        if ctx.folded_state_dict is None:  # measure_sensitivity may have folded already
            ctx.folded_state_dict = folded_state_dict(ctx.model, ctx.adapter, ctx.transforms, geo)
        ctx.spec = build_spec(ctx, key_ranks, value_ranks)
