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
from kvrewrite.key_modes.latent import pair_order
from kvrewrite.runtime.kernels.reference import boolean_mask, softmax_dtype
from kvrewrite.runtime.kernels.rope_table import rope_phases, rope_table, rotates_half_pairs
from kvrewrite.runtime.tiers.evidence import scored_queries
from kvrewrite.runtime.tiers.kept_decode import kept_decode_applies, kept_decode_attention


def check_full_rank(module) -> None:
    """The tiered cache needs every head's full-rank transform: the window keeps all dims."""
    d = module.head_dim
    if module.mode.shared_key_block:
        raise InvalidArgumentError(
            f"a tiered cache (recent window) does not support {module.key_mode} keys (one key block "
            "shared by all heads); compile with another `rope_mode`"
        )
    if any(r != d for r in module.key_ranks) or any(r != d for r in module.value_ranks):
        raise InvalidArgumentError(
            f"layer {module.layer_idx}: a tiered cache needs the model at full rank; load it with "
            "kvrewrite.load(dir, rate=..., recent_window=W) rather than slicing its ranks first"
        )


@dataclass
class StoredTier:
    """One stored tier as attention reads it: packed latents, per-KV-head ranks and each token's cache index.

    A tiered cache layer returns its stored tiers (everything but the recent window) from `stored_tiers(dtype)`.
    With maps, a head's stored block y is not its latent but a linear code of it (the eviction tier's centred,
    scaled and turned space): latent = y @ matrix + offset, per batch row ([B, r, r], [B, r]). Attention then
    moves the map onto the query and the weighted value sum (q.x = (q matrix^T).y + q.offset; sum p x =
    (sum p y) matrix + offset sum p), so the stored tokens are never turned back one by one.
    """

    # [B, 1, S_t, sum key ranks], or one [B, 1, S_t, r_g] block per KV head
    stored_keys: torch.Tensor | list[torch.Tensor]
    stored_values: torch.Tensor | list[torch.Tensor]
    key_ranks: tuple[int, ...]
    value_ranks: tuple[int, ...]
    positions: torch.Tensor | None  # [B, S_t] cache indices; None: indices 0..S_t-1 in order
    key_maps: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None  # per KV head; None: stored as is
    value_maps: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None

    @property
    def length(self) -> int:
        first = self.stored_keys[0] if isinstance(self.stored_keys, list) else self.stored_keys
        return first.shape[-2]

    @property
    def keys(self) -> torch.Tensor:
        """The key latents [B, 1, S_t, sum key ranks] (maps applied)."""
        return _mapped(self.stored_keys, self.key_ranks, self.key_maps)

    @property
    def values(self) -> torch.Tensor:
        return _mapped(self.stored_values, self.value_ranks, self.value_maps)

    def key_block(self, g: int) -> torch.Tensor:
        """KV head g's stored key block (a code of its latent where key_map(g) is not None)."""
        return _block(self.stored_keys, self.key_ranks, g)

    def value_block(self, g: int) -> torch.Tensor:
        return _block(self.stored_values, self.value_ranks, g)

    def key_map(self, g: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.key_maps is None else self.key_maps[g]

    def value_map(self, g: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.value_maps is None else self.value_maps[g]

    def cache_indices(self, batch: int, device: torch.device) -> torch.Tensor:
        if self.positions is not None:
            return self.positions.long()
        n = self.length
        return torch.arange(n, device=device)[None].expand(batch, n)


def _block(stored: torch.Tensor | list[torch.Tensor], ranks: tuple[int, ...], g: int) -> torch.Tensor:
    if isinstance(stored, list):
        return stored[g]
    start = sum(ranks[:g])
    return stored[..., start : start + ranks[g]]


def _mapped(stored: torch.Tensor | list[torch.Tensor], ranks: tuple[int, ...], maps) -> torch.Tensor:
    if maps is None and not isinstance(stored, list):
        return stored
    blocks = []
    for g in range(len(ranks)):
        block = _block(stored, ranks, g)
        head_map = None if maps is None else maps[g]
        if head_map is not None:
            matrix, offset = head_map
            block = block @ matrix[:, None] + offset[:, None, None]
        blocks.append(block)
    return torch.cat(blocks, dim=-1)


def _phases_at(phases: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """phases [L, h] (complex) at positions [B, S] -> [B, 1, S, h]: an index_select of the real pairs (indexing a
    complex table directly is several times slower on a CPU)."""
    pairs = torch.view_as_real(phases).flatten(1).index_select(0, positions.flatten())
    return torch.view_as_complex(pairs.view(*positions.shape, phases.shape[-1], 2)).unsqueeze(1)


def _grouped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, G, T, X] @ b [B, 1, X, Y] -> [B, G, T, Y], the G query heads of a KV group stacked as rows of one product:
    broadcasting b over G would copy it G times (a KV group's whole key or value block, per step)."""
    batch, heads, rows, width = a.shape
    if heads == 1 or b.shape[1] != 1:
        return a @ b
    return (a.reshape(batch, 1, heads * rows, width) @ b).view(batch, heads, rows, -1)


def _gather_columns(allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    batch, n = positions.shape
    expanded = allowed.expand(batch, -1, -1, -1)
    return expanded.gather(-1, positions[:, None, None, :].expand(batch, 1, allowed.shape[-2], n))


def tiered_attention(module, query: torch.Tensor, layer, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """query [B, T, H * d] (full rank, as the module projects it) -> o_proj's input [B, T, H * d]."""
    check_full_rank(module)
    if kept_decode_applies(module, layer, query):  # a decode step the kept-tier kernels can read (CUDA)
        return kept_decode_attention(module, query, layer, attention_mask)
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
    tiers = layer.stored_tiers(dtype)
    tier_positions = [t.cache_indices(batch, device) for t in tiers]
    tier_allowed = [_gather_columns(allowed, p) for p in tier_positions]
    allowed_recent = allowed[..., kv_len - n_recent :].expand(batch, -1, -1, -1)

    heads = query.view(batch, q_len, module.num_heads, d).transpose(1, 2)  # [B, H, T, d]
    latent = module.mode.rebuilds_keys
    if latent:
        # Positions are cache indices, as in CompressedAttention._latent_attention (padding-consistent offsets); the
        # rotary table is shared by the layers, and read only at the positions a tier holds.
        cos_table, sin_table = rope_table(module._rotary[0], query, kv_len, transposed=False)  # [>= kv_len, d]

        def rope_at(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return cos_table[positions], sin_table[positions]

        heads = module._apply_rope(heads, *rope_at(q_pos[None].expand(batch, q_len)))
        recent_rope = rope_at(recent_pos[None].expand(batch, n_recent))
        paired = rotates_half_pairs(module)
        if paired:  # stored keys rotated as complex pairs: one pass over them instead of rotate_half's several
            phases = rope_phases(module._rotary[0], query, kv_len)
            tier_rope = [_phases_at(phases, p) for p in tier_positions]  # [B, 1, S_t, d / 2]
            order = pair_order(d, device)
        else:
            tier_rope = [rope_at(p) for p in tier_positions]

    def scores(
        q: torch.Tensor, latents: torch.Tensor, g: int, rank: int, rope, key_map=None, stored: bool = False
    ) -> torch.Tensor:
        if latent and stored and paired:
            keys = module.mode.rotated_key_pairs(module, latents[..., :rank], g, rope, latent_map=key_map)
            return _grouped(q[..., order], keys.transpose(-1, -2))  # the query's dims in the keys' pair order
        if latent:
            keys = module.mode.rebuild_keys(module, latents[..., :rank], g, *rope, latent_map=key_map)
            return _grouped(q, keys.transpose(-1, -2))
        q = q[..., :rank]
        if key_map is None:
            return _grouped(q, latents[..., :rank].transpose(-1, -2))
        matrix, offset = key_map  # the latent is y @ matrix + offset: the map moves onto the query
        mapped = _grouped(q, matrix.transpose(-1, -2)[:, None])
        return _grouped(mapped, latents.transpose(-1, -2)) + _grouped(q, offset[:, None, :, None])

    wanted = layer.wanted_evidence  # only what the layer's policy reads is computed (this is the decode path)
    want_recent, want_stored, want_denominator = ("recent" in wanted), ("stored" in wanted), ("denominator" in wanted)
    if want_recent or want_stored:
        query_weights = scored_queries(layer, allowed, q_len)[:, None, :, None]  # [B, 1, T, 1]
    received = (
        [torch.zeros(batch, t.length, dtype=torch.float32, device=device) for t in tiers] if want_stored else None
    )
    received_recent = torch.zeros(batch, n_recent, dtype=torch.float32, device=device) if want_recent else None
    log_denominator = None
    if want_denominator:
        log_denominator = torch.full((batch, q_len), float("-inf"), dtype=torch.float32, device=device)
    reduce_max = layer.evidence_reduce == "max"

    def gathered(acc: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Evidence of one KV group's probabilities p [B, G, T, S] added to (or max-ed into) acc [B, S]."""
        weighted = p.float() * query_weights
        return torch.maximum(acc, weighted.amax(dim=(1, 2))) if reduce_max else acc + weighted.sum(dim=(1, 2))

    outputs = []
    for g in range(module.num_kv_heads):
        q = heads[:, g * group : (g + 1) * group]  # [B, G, T, d]
        k_recent, v_recent = recent_k[..., g * d : (g + 1) * d], recent_v[..., g * d : (g + 1) * d]
        parts = [
            scores(q, t.key_block(g), g, t.key_ranks[g], tier_rope[i] if latent else None, t.key_map(g), stored=True)
            for i, t in enumerate(tiers)
        ]
        s_recent = scores(q, k_recent, g, d, recent_rope if latent else None)
        if any_beyond and beyond_k_ranks[g] < d:  # at full rank beyond the window too, nothing to cut
            s_old = scores(q, k_recent, g, beyond_k_ranks[g], recent_rope if latent else None)
            s_recent = torch.where(full, s_recent, s_old)
        parts.append(s_recent)
        logits = torch.cat(parts, dim=-1) * module.scaling
        logits = logits.to(softmax_dtype(logits.dtype))
        mask = torch.cat(tier_allowed + [allowed_recent], dim=-1)
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        if want_denominator:
            log_denominator = torch.logaddexp(log_denominator, torch.logsumexp(logits.float(), dim=-1).logsumexp(dim=1))
        probs = torch.softmax(logits, dim=-1).to(dtype)
        pieces = probs.split([t.length for t in tiers] + [n_recent], dim=-1)
        out = torch.zeros(batch, group, q_len, d, dtype=dtype, device=device)
        for i, (t, p) in enumerate(zip(tiers, pieces[:-1])):
            read = _grouped(p, t.value_block(g))
            value_map = t.value_map(g)
            if value_map is not None:  # sum p x = (sum p y) matrix + offset sum p
                matrix, offset = value_map
                read = _grouped(read, matrix[:, None]) + p.sum(dim=-1, keepdim=True) * offset[:, None, None]
            out = out + F.pad(read, (0, d - t.value_ranks[g]))
            if want_stored:
                received[i] = gathered(received[i], p)
        p_recent = pieces[-1]
        if want_recent:
            received_recent = gathered(received_recent, p_recent)
        if any_beyond and beyond_v_ranks[g] < d:
            rv = beyond_v_ranks[g]
            out = (
                out
                + _grouped(p_recent * full, v_recent)
                + F.pad(_grouped(p_recent * ~full, v_recent[..., :rv]), (0, d - rv))
            )
        else:
            out = out + _grouped(p_recent, v_recent)
        outputs.append(out.transpose(1, 2).reshape(batch, q_len, group * d))
    if wanted:
        layer.add_scores(received_recent, received, log_denominator)
    return torch.cat(outputs, dim=-1)
