"""Attention over a tiered cache: each query reads its recent window at full rank and older tokens at aged ranks.

A query at cache index t reads key j with all dims when t - j <= window, and with the aged ranks otherwise.
Scores against the aged tier and the recent tier are computed separately, concatenated on the key axis and
normalised by one softmax, so the result is the exact attention over the mixed-rank keys; nothing is copied
out of the cache. Inside one forward, a recent-tier token can already be too old for the later queries of a
long chunk: for those pairs the scores and values use the token's aged prefix, so a chunked prefill gives
the same result as token-by-token decoding.

A key's prefix of r dims is the rank-r truncation in every key mode: freq / post-rope / folded queries and
keys are packed latents whose first r dims are the kept ones (the query's other dims meet zeros), latent
keys are rebuilt from their first r latent dims through the first r rows of k_up. Values likewise: o_proj
reads zeros beyond a head's value rank, which is what padding the output of the aged part does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.kernels.reference import boolean_mask, softmax_dtype
from kvrewrite.spec import KEY_MODE_CROSSHEAD, KEY_MODE_LATENT


def check_full_rank(module) -> None:
    """The tiered cache needs every head's full-rank transform: the window keeps all dims."""
    d = module.head_dim
    if module.key_mode == KEY_MODE_CROSSHEAD:
        raise InvalidArgumentError("a tiered cache (recent window) does not support crosshead keys; compile with another --rope-mode")
    if any(r != d for r in module.key_ranks) or any(r != d for r in module.value_ranks):
        raise InvalidArgumentError(
            f"layer {module.layer_idx}: a tiered cache needs the model at full rank; load it with "
            "kvrewrite.load(dir, rate=..., recent_window=W) rather than slicing its ranks first"
        )


def _rotated_latent_keys(module, latents: torch.Tensor, g: int, rank: int, cos, sin) -> torch.Tensor:
    """latent mode: KV head g's keys [B, 1, S, d] rebuilt from the first `rank` latent dims, rotated by position."""
    keys = latents[..., :rank] @ module.k_up[g, :rank]
    return module._apply_rope(keys, cos, sin)


def tiered_attention(module, query: torch.Tensor, layer, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """query [B, T, H * d] (full rank, as the module projects it) -> o_proj's input [B, T, H * d]."""
    check_full_rank(module)
    batch, q_len, _ = query.shape
    dtype, device = query.dtype, query.device
    d, group = module.head_dim, module.group_size
    aged_k, aged_v = layer.aged_latents(dtype)
    recent_k, recent_v = layer.keys.to(dtype), layer.values.to(dtype)
    n_aged, n_recent = aged_k.shape[-2], recent_k.shape[-2]
    kv_len = n_aged + n_recent
    allowed = boolean_mask(attention_mask, q_len, kv_len, device)
    allowed_aged, allowed_recent = allowed[..., :n_aged], allowed[..., n_aged:]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    recent_pos = torch.arange(n_aged, kv_len, device=device)
    full = (q_pos[:, None] - recent_pos[None, :]) <= layer.window  # [T, S_recent]: pairs read at full rank
    any_aged_recent = not bool(full.all())

    heads = query.view(batch, q_len, module.num_heads, d).transpose(1, 2)  # [B, H, T, d]
    latent = module.key_mode == KEY_MODE_LATENT
    if latent:
        # Positions are cache indices, as in CompressedAttention._latent_attention (padding-consistent offsets).
        positions = torch.arange(kv_len, device=device)[None].expand(batch, kv_len)
        cos, sin = module._rotary[0](query, positions)
        heads = module._apply_rope(heads, cos[:, kv_len - q_len :], sin[:, kv_len - q_len :])
        cos_a, sin_a, cos_r, sin_r = cos[:, :n_aged], sin[:, :n_aged], cos[:, n_aged:], sin[:, n_aged:]

    key_offsets = [0]
    for r in layer.aged_key_ranks:
        key_offsets.append(key_offsets[-1] + r)
    value_offsets = [0]
    for r in layer.aged_value_ranks:
        value_offsets.append(value_offsets[-1] + r)

    outputs = []
    for g, (rk, rv) in enumerate(zip(layer.aged_key_ranks, layer.aged_value_ranks)):
        q = heads[:, g * group : (g + 1) * group]  # [B, G, T, d]
        k_aged = aged_k[..., key_offsets[g] : key_offsets[g + 1]]
        v_aged = aged_v[..., value_offsets[g] : value_offsets[g + 1]]
        k_recent = recent_k[..., g * d : (g + 1) * d]
        v_recent = recent_v[..., g * d : (g + 1) * d]
        if latent:
            s_aged = q @ _rotated_latent_keys(module, k_aged, g, rk, cos_a, sin_a).transpose(-1, -2)
            s_recent = q @ _rotated_latent_keys(module, k_recent, g, d, cos_r, sin_r).transpose(-1, -2)
            if any_aged_recent:
                s_old = q @ _rotated_latent_keys(module, k_recent, g, rk, cos_r, sin_r).transpose(-1, -2)
        else:
            s_aged = q[..., :rk] @ k_aged.transpose(-1, -2)
            s_recent = q @ k_recent.transpose(-1, -2)
            if any_aged_recent:
                s_old = q[..., :rk] @ k_recent[..., :rk].transpose(-1, -2)
        if any_aged_recent:
            s_recent = torch.where(full, s_recent, s_old)
        scores = torch.cat([s_aged, s_recent], dim=-1) * module.scaling
        scores = scores.to(softmax_dtype(scores.dtype))
        scores = scores.masked_fill(~torch.cat([allowed_aged, allowed_recent], dim=-1), torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(dtype)
        p_aged, p_recent = probs[..., :n_aged], probs[..., n_aged:]
        out = F.pad(p_aged @ v_aged, (0, d - rv))
        if any_aged_recent:
            out = out + (p_recent * full) @ v_recent + F.pad((p_recent * ~full) @ v_recent[..., :rv], (0, d - rv))
        else:
            out = out + p_recent @ v_recent
        outputs.append(out.transpose(1, 2).reshape(batch, q_len, group * d))
    return torch.cat(outputs, dim=-1)
