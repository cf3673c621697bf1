"""Value-latent balancing: an exact per-dim rescaling of the cached value latents, folded into the weights.

Value latent dim j of KV head h is written by v_proj row (value offset of h) + j and read by o_proj input columns
(output offset of h) + member * r_v[h] + j, one per query head of h's group (PackedLayout). Multiplying the row
(and its bias entry) by s_j and dividing those columns by s_j leaves the model's function unchanged; only what
a KV codec sees changes. KIVI codes values per token over groups of channels sharing one (scale, min), so every
channel of a group gets about the same absolute error, while a channel's cost is its error times the weight
o_proj gives it. AWQ-style: s_j = ||o_proj columns of j||^alpha makes heavy channels larger in the cache, so a
shared step size costs them relatively less. Keys are coded per channel (scale-invariant), so only values.

Not applied by load(): opt in at compile time with `kvrewrite compress --balance-values ALPHA` (the compile pass
compile/passes/balance_values.py folds it into the checkpoint's weights), or call balance_value_latents on a loaded
model (any rate; slicing keeps the prefix order).
"""

from __future__ import annotations

import torch


def column_norms(o_weight: torch.Tensor, layout) -> list[torch.Tensor]:
    """Per KV head h, [r_v[h]]: the 2-norm (float64) of each value dim's o_proj input columns over all group
    members, from the o_proj weight and its PackedLayout."""
    weight = o_weight.detach().double()
    norms = []
    for h, rv in enumerate(layout.value_ranks):
        start = layout.output_offsets[h]
        block = weight[:, start : start + layout.group_size * rv].reshape(weight.shape[0], layout.group_size, rv)
        norms.append(block.pow(2).sum(dim=(0, 1)).sqrt())
    return norms


def scales_from_norms(norms: list[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """s_j = norm_j^alpha per KV head, divided by the layer's geometric mean (so the layer's overall magnitude
    stays put; dims whose columns are all zero get s = 1)."""
    flat = torch.cat(norms)
    positive = flat > 0
    if not bool(positive.any()):
        return [torch.ones_like(n) for n in norms]
    log_mean = flat[positive].log().mean()
    return [
        torch.where(n > 0, ((n.clamp_min(1e-300).log() - log_mean) * alpha).exp(), torch.ones_like(n)) for n in norms
    ]


def balanced_value_weights(
    v_weight: torch.Tensor, v_bias: torch.Tensor | None, o_weight: torch.Tensor, layout, scales: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(v_proj weight, v_proj bias, o_proj weight) with per-dim scales (per KV head, [r_v[h]]) folded in: value
    rows times s_j, o_proj columns of dim j (every group member) divided by s_j. Products in float64, results in
    each input's dtype; the inputs are not modified."""
    row_scale = torch.cat(scales)  # packed value column order
    col_scale = torch.cat([s.repeat(layout.group_size) for s in scales])  # packed output order: member-major per head
    v = (v_weight.detach().double() * row_scale[:, None]).to(v_weight.dtype)
    b = None if v_bias is None else (v_bias.detach().double() * row_scale).to(v_bias.dtype)
    o = (o_weight.detach().double() / col_scale[None, :]).to(o_weight.dtype)
    return v, b, o


def value_column_norms(attention) -> list[torch.Tensor]:
    """Per KV head h, [r_v[h]]: the 2-norm of each value dim's o_proj input columns over all group members."""
    return column_norms(attention.o_proj.weight, attention.layout)


def balance_scales(attention, alpha: float) -> list[torch.Tensor]:
    """scales_from_norms for one CompressedAttention's o_proj."""
    return scales_from_norms(value_column_norms(attention), alpha)


def balance_attention(attention, scales: list[torch.Tensor]) -> None:
    """Fold per-dim scales (per KV head, [r_v[h]]) into one CompressedAttention's v_proj rows and o_proj columns."""
    v, o = attention.v_proj, attention.o_proj
    new_v, new_b, new_o = balanced_value_weights(v.weight, v.bias, o.weight, attention.layout, scales)
    with torch.no_grad():
        v.weight.copy_(new_v)
        if v.bias is not None:
            v.bias.copy_(new_b)
        o.weight.copy_(new_o)


def balance_value_latents(model: torch.nn.Module, alpha: float) -> None:
    """Rescale every compressed attention layer's value latents in place (s_j = o_proj column norm^alpha,
    geometric-mean normalised per layer). Exact without a codec up to float rounding; alpha = 0 is a no-op."""
    layers = [m for m in model.modules() if hasattr(m, "layout") and hasattr(m, "v_proj") and hasattr(m, "o_proj")]
    if not layers:
        raise ValueError("no kvrewrite compressed attention layers in this model")
    for attention in layers:
        if alpha != 0:
            balance_attention(attention, balance_scales(attention, alpha))
