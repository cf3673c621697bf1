"""Attention over a tiered cache: each query reads its recent window at full rank and older tokens at fewer dims.

A query at cache index t reads key j with all dims when t - j <= window. Older keys are read at their tier's
ranks: aged (and, with token-adaptive dims, important) tokens at the ranks they were stored with, and a
recent-tier token that is already too old for a later query of a long chunk at the ranks it will be stored
with (the aged ranks; the important ones while token-adaptive dims have not classified it yet). Scores
against every tier are computed separately, concatenated on the key axis and normalised by one softmax, so
the result is the exact attention over the mixed-rank keys; nothing is copied out of the cache. Without
token-adaptive dims or a codec, a chunked prefill therefore gives the same result as one forward.

A key's prefix of r dims is the rank-r truncation in every key mode: freq / post-rope / folded queries and
keys are packed latents whose first r dims are the kept ones (the query's other dims meet zeros), latent
keys are rebuilt from their first r latent dims through the first r rows of k_up. Values likewise: o_proj
reads zeros beyond a head's value rank, which is what padding the output of a truncated tier does.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class _Tier:
    """One stored tier as attention reads it: packed latents, per-KV-head ranks, cache indices, allowed mask."""

    keys: torch.Tensor  # [B, 1, S_t, sum key ranks]
    values: torch.Tensor  # [B, 1, S_t, sum value ranks]
    key_ranks: tuple[int, ...]
    value_ranks: tuple[int, ...]
    positions: torch.Tensor  # [B, S_t] cache indices
    allowed: torch.Tensor  # [B, 1, T, S_t]

    def key_block(self, g: int) -> torch.Tensor:
        start = sum(self.key_ranks[:g])
        return self.keys[..., start : start + self.key_ranks[g]]

    def value_block(self, g: int) -> torch.Tensor:
        start = sum(self.value_ranks[:g])
        return self.values[..., start : start + self.value_ranks[g]]


def _gather_columns(allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    batch, n = positions.shape
    expanded = allowed.expand(batch, -1, -1, -1)
    return expanded.gather(-1, positions[:, None, None, :].expand(batch, 1, allowed.shape[-2], n))


def _stored_tiers(layer, dtype, allowed: torch.Tensor, batch: int) -> list[_Tier]:
    device = allowed.device
    aged_k, aged_v = layer.aged_latents(dtype)
    tiers = []
    if layer.adaptive:
        if not layer.evict_rest:  # evicted tokens are gone: not a zero-score key, no key at all
            aged_pos = layer.aged_positions.long()
            tiers.append(_Tier(aged_k, aged_v, layer.aged_key_ranks, layer.aged_value_ranks, aged_pos,
                               _gather_columns(allowed, aged_pos)))
        imp_pos = layer.important_positions.long()
        tiers.append(_Tier(layer.important_keys.to(dtype), layer.important_values.to(dtype), layer.important_key_ranks,
                           layer.important_value_ranks, imp_pos, _gather_columns(allowed, imp_pos)))
    else:  # the aged tier holds cache indices 0..S_aged-1 in order
        n = aged_k.shape[-2]
        positions = torch.arange(n, device=device)[None].expand(batch, n)
        tiers.append(_Tier(aged_k, aged_v, layer.aged_key_ranks, layer.aged_value_ranks, positions,
                           allowed[..., :n].expand(batch, -1, -1, -1)))
    return tiers


def tiered_attention(module, query: torch.Tensor, layer, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """query [B, T, H * d] (full rank, as the module projects it) -> o_proj's input [B, T, H * d]."""
    check_full_rank(module)
    batch, q_len, _ = query.shape
    dtype, device = query.dtype, query.device
    d, group = module.head_dim, module.group_size
    kv_len = layer.get_seq_length()
    allowed = boolean_mask(attention_mask, q_len, kv_len, device)
    recent_k, recent_v = layer.keys.to(dtype), layer.values.to(dtype)
    n_recent = recent_k.shape[-2]
    recent_pos = torch.arange(kv_len - n_recent, kv_len, device=device)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    full = (q_pos[:, None] - recent_pos[None, :]) <= layer.window  # [T, S_recent]: pairs read at full rank
    any_beyond = not bool(full.all())
    beyond_k_ranks, beyond_v_ranks = layer.beyond_window_ranks
    tiers = _stored_tiers(layer, dtype, allowed, batch)
    allowed_recent = allowed[..., kv_len - n_recent :].expand(batch, -1, -1, -1)

    heads = query.view(batch, q_len, module.num_heads, d).transpose(1, 2)  # [B, H, T, d]
    latent = module.key_mode == KEY_MODE_LATENT
    if latent:
        # Positions are cache indices, as in CompressedAttention._latent_attention (padding-consistent offsets).
        cos, sin = module._rotary[0](query, torch.arange(kv_len, device=device)[None].expand(batch, kv_len))
        heads = module._apply_rope(heads, cos[:, kv_len - q_len :], sin[:, kv_len - q_len :])

        def rope_at(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            index = positions[..., None].expand(-1, -1, cos.shape[-1])
            return cos.gather(1, index), sin.gather(1, index)

        tier_rope = [rope_at(t.positions) for t in tiers]
        recent_rope = rope_at(recent_pos[None].expand(batch, n_recent))

    def scores(q: torch.Tensor, latents: torch.Tensor, g: int, rank: int, rope) -> torch.Tensor:
        if latent:
            keys = module._apply_rope(latents[..., :rank] @ module.k_up[g, :rank], *rope)
            return q @ keys.transpose(-1, -2)
        return q[..., :rank] @ latents[..., :rank].transpose(-1, -2)

    received = torch.zeros(batch, n_recent, dtype=torch.float32, device=device)
    log_denominator = torch.full((batch, q_len), float("-inf"), dtype=torch.float32, device=device)
    outputs = []
    for g in range(module.num_kv_heads):
        q = heads[:, g * group : (g + 1) * group]  # [B, G, T, d]
        k_recent, v_recent = recent_k[..., g * d : (g + 1) * d], recent_v[..., g * d : (g + 1) * d]
        parts = [scores(q, t.key_block(g), g, t.key_ranks[g], tier_rope[i] if latent else None) for i, t in enumerate(tiers)]
        s_recent = scores(q, k_recent, g, d, recent_rope if latent else None)
        if any_beyond:
            s_old = scores(q, k_recent, g, beyond_k_ranks[g], recent_rope if latent else None)
            s_recent = torch.where(full, s_recent, s_old)
        parts.append(s_recent)
        logits = torch.cat(parts, dim=-1) * module.scaling
        logits = logits.to(softmax_dtype(logits.dtype))
        mask = torch.cat([t.allowed for t in tiers] + [allowed_recent], dim=-1)
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        if layer.adaptive:
            log_denominator = torch.logaddexp(log_denominator, torch.logsumexp(logits.float(), dim=-1).logsumexp(dim=1))
        probs = torch.softmax(logits, dim=-1).to(dtype)
        pieces = probs.split([t.keys.shape[-2] for t in tiers] + [n_recent], dim=-1)
        out = torch.zeros(batch, group, q_len, d, dtype=dtype, device=device)
        for t, p in zip(tiers, pieces[:-1]):
            out = out + F.pad(p @ t.value_block(g), (0, d - t.value_ranks[g]))
        p_recent = pieces[-1]
        if layer.adaptive:
            received += p_recent.float().sum(dim=(1, 2))
        if any_beyond:
            rv = beyond_v_ranks[g]
            out = out + (p_recent * full) @ v_recent + F.pad((p_recent * ~full) @ v_recent[..., :rv], (0, d - rv))
        else:
            out = out + p_recent @ v_recent
        outputs.append(out.transpose(1, 2).reshape(batch, q_len, group * d))
    if layer.adaptive:
        layer.add_scores(received, log_denominator)
    return torch.cat(outputs, dim=-1)
