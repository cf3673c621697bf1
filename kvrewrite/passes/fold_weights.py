"""Pass 6: fold the transforms into q/k/v/o weights (full rank, ordered) and write the spec.

All products are formed in float64 and cast back to the model's dtype once.
"""

from __future__ import annotations

import torch

from kvrewrite.adapters.base import Projections
from kvrewrite.key_transforms import interleaved_pair_rows
from kvrewrite.passes.context import CompileContext
from kvrewrite.spec import KEY_MODE_CROSSHEAD, KEY_MODE_FOLDED, KEY_MODE_FREQ, KEY_MODE_LATENT, KEY_MODE_POST_ROPE, CompressionSpec, LayerSpec


def fold_layer(projections: Projections, transforms, geometry, kept: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """New attention tensors of one layer, keyed by their name inside CompressedAttention.

    A bias row is transformed exactly like its weight row (the bias is the weight's column for a constant 1).
    """
    d = geometry.head_dim
    dtype = projections.q_weight.dtype

    def f64(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().double()

    w_q, w_k, w_v, w_o = (f64(t) for t in (projections.q_weight, projections.k_weight, projections.v_weight, projections.o_weight))
    b_q, b_k, b_v = f64(projections.q_bias), f64(projections.k_bias), f64(projections.v_bias)
    key, value = transforms.key, transforms.value
    original = {"q": (w_q, b_q), "k": (w_k, b_k), "v": (w_v, b_v)}
    new = {side: (w.clone(), None if b is None else b.clone()) for side, (w, b) in original.items()}
    new_o = w_o.clone()

    def transform_rows(side: str, rows: slice, fn) -> None:
        """Rows `rows` of side's weight and bias become fn(original rows)."""
        (weight, bias), (new_weight, new_b) = original[side], new[side]
        new_weight[rows] = fn(weight[rows])
        if bias is not None:
            new_b[rows] = fn(bias[rows])

    for g in range(geometry.num_key_value_heads):
        kv_rows = slice(g * d, (g + 1) * d)
        q_rows = [slice(h * d, (h + 1) * d) for h in geometry.query_heads_of(g)]
        # Value side: v latents = v @ down  =>  rows of W_v (and b_v) become down^T W_v; o_proj columns of
        # every query head in the group absorb up (W_o[:, h] -> W_o[:, h] up^T). o_proj's bias is unchanged.
        transform_rows("v", kv_rows, lambda x, m=value.down[g]: m.T @ x)
        for rows in q_rows:
            new_o[:, rows] = w_o[:, rows] @ value.up[g].T
        if key.mode == KEY_MODE_FREQ:
            perm = interleaved_pair_rows(key.freq_order[g], d)
            transform_rows("k", kv_rows, lambda x, p=perm: x[p])
            for rows in q_rows:
                transform_rows("q", rows, lambda x, p=perm: x[p])
        elif key.mode == KEY_MODE_LATENT:
            transform_rows("k", kv_rows, lambda x, m=key.down[g]: m.T @ x)
        elif key.mode == KEY_MODE_FOLDED:
            # No RoPE: q.k = (q Q).(k K) with the pair's maps folded into both projections (ZACK Fig. 8).
            transform_rows("k", kv_rows, lambda x, m=key.k_map[g]: m.T @ x)
            for rows in q_rows:
                transform_rows("q", rows, lambda x, m=key.q_map[g]: m.T @ x)

    if key.mode == KEY_MODE_CROSSHEAD:
        # Every query head now scores against the whole shared key block: n_kv*d rows per head at full rank.
        new["k"] = (key.k_fold @ w_k, None if b_k is None else key.k_fold @ b_k)
        heads = range(geometry.num_attention_heads)
        new["q"] = (
            torch.cat([key.q_fold[h] @ w_q[h * d : (h + 1) * d] for h in heads]),
            None if b_q is None else torch.cat([key.q_fold[h] @ b_q[h * d : (h + 1) * d] for h in heads]),
        )

    out: dict[str, torch.Tensor] = {"o_proj.weight": new_o}
    for side, (weight, bias) in new.items():
        out[f"{side}_proj.weight"] = weight
        if bias is not None:
            out[f"{side}_proj.bias"] = bias
    if projections.o_bias is not None:
        out["o_proj.bias"] = projections.o_bias
    if key.mode == KEY_MODE_POST_ROPE:
        out["q_map"] = key.q_map
        out["k_map"] = key.k_map
    elif key.mode == KEY_MODE_LATENT:
        out["k_up"] = key.up
    out.update(kept or {})
    return {name: t.to(dtype).contiguous() for name, t in out.items()}


def folded_state_dict(model, adapter, transforms, geometry) -> dict[str, torch.Tensor]:
    """The whole model's state dict with every layer's attention rewritten (full rank)."""
    state = {name: t.detach() for name, t in model.state_dict().items()}
    for layer, layer_transforms in zip(adapter.decoder_layers(model), transforms):
        attn = adapter.attention(layer)
        prefix = next(n for n, m in model.named_modules() if m is attn)
        # The compressed attention's tensors all come from the fold (fused or renamed originals dropped).
        for name in [n for n in state if n.startswith(prefix + ".")]:
            state.pop(name)
        folded = fold_layer(adapter.projections(attn), layer_transforms, geometry, adapter.kept_attention_state(attn))
        for name, tensor in folded.items():
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
    description = "fold the transforms into q_proj/k_proj/v_proj/o_proj and biases (full rank, ordered) and build the spec"

    def run(self, ctx: CompileContext) -> None:
        geo = ctx.geometry
        key_ranks, value_ranks = ctx.allocation.as_lists(geo.num_layers, geo.num_key_value_heads)
        if ctx.folded_state_dict is None:  # measure_sensitivity may have folded already
            ctx.folded_state_dict = folded_state_dict(ctx.model, ctx.adapter, ctx.transforms, geo)
        ctx.spec = build_spec(ctx, key_ranks, value_ranks)
