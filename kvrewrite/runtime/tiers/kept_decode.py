"""A decode step over an evicting layer whose kept tier the Triton kernels read in code space (CUDA).

tiers/attention.py's torch path decodes the whole kept tier to floats, rebuilds and rotates every kept key and
multiplies, one torch op at a time, on every step. Here (one query per sequence, `latent` keys under HF's
rotate_half, both sides coded, no floor) the kept tier's codes are read where they lie:

1. kernels.kept_tier_kernels.kept_key_logits scores the rotated queries against the kept keys, each rebuilt from
   its codes in registers through the head's up-projection with the code space's map folded in
   (latent = y @ matrix + offset, so key = RoPE(y @ (matrix @ k_up) + offset @ k_up));
2. the recent window (at most window + 1 full-rank tokens) is scored in torch, and one softmax runs over both; the
   evidence the policy re-scores its tokens by is summed (or max-ed) over heads from these probabilities, as the
   torch path does;
3. kernels.kept_tier_kernels.kept_value_sums sums probabilities times the dequantised value codes; the map moves
   onto that sum (sum p x = (sum p y) matrix + offset sum p), and the window's values are added.

Everything else (prefill chunks, a floor, keys that are not rebuilt, bits off, CPU) takes the torch path, which
tests/test_kept_decode.py holds this path equal to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrewrite.runtime.kernels.dispatch import resolve_backend
from kvrewrite.runtime.kernels.reference import boolean_mask
from kvrewrite.runtime.kernels.rope_table import rope_table, rotates_half_pairs
from kvrewrite.runtime.tiers.eviction import EvictingLayer


def kept_decode_applies(module, layer, query: torch.Tensor) -> bool:
    """Whether this step runs on the kept-tier kernels: one query per sequence on a layer they can read, with the
    triton backend chosen for the device (kernels.dispatch)."""
    if query.shape[1] != 1 or not isinstance(layer, EvictingLayer):
        return False
    if not (module.mode.rebuilds_keys and rotates_half_pairs(module)):
        return False
    if layer.kept_positions is None or not layer.kept_positions.shape[-1] or layer.holding:
        return False
    if layer.floor_positions is not None and layer.floor_positions.shape[-1]:
        return False
    if any(bits is None for bits in layer.side_bits.values()) or "denominator" in layer.wanted_evidence:
        return False
    return resolve_backend(query.device) == "triton"


def _folded_up(module, layer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, k_up with the key code space's map folded in, [B, n_kv, R, d], and the map's offset through it,
    [B, n_kv, d] (float32)."""
    ranks = layer.kept_key_ranks
    maps = layer._head_maps("key", False, torch.float32)
    batch = layer.kept_positions.shape[0]
    d = module.head_dim
    up = torch.zeros(batch, len(ranks), max(ranks), d, dtype=torch.float32, device=module.k_up.device)
    shift = torch.zeros(batch, len(ranks), d, dtype=torch.float32, device=module.k_up.device)
    for g, r in enumerate(ranks):
        if not r:
            continue
        head_up = module.k_up[g, :r].float()
        head_map = None if maps is None else maps[g]
        if head_map is None:
            up[:, g, :r] = head_up
            continue
        matrix, offset = head_map
        up[:, g, :r] = matrix @ head_up
        shift[:, g] = offset @ head_up
    return up.to(dtype), shift


def kept_decode_attention(module, query: torch.Tensor, layer, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """query [B, 1, H * d] (full rank, as the module projects it) -> o_proj's input [B, 1, H * d]."""
    from kvrewrite.runtime.kernels.kept_tier_kernels import kept_key_logits, kept_value_sums
    from kvrewrite.runtime.tiers.attention import _scored_queries

    batch = query.shape[0]
    dtype, device = query.dtype, query.device
    d, group, n_kv = module.head_dim, module.group_size, module.num_kv_heads
    heads_n = module.num_heads
    kv_len = layer.get_seq_length()
    allowed = boolean_mask(attention_mask, 1, kv_len, device)  # [B|1, 1, 1, kv_len]
    recent_k, recent_v = layer.keys.to(dtype), layer.values.to(dtype)
    n_recent = recent_k.shape[-2]
    recent_pos = torch.arange(kv_len - n_recent, kv_len, device=device)
    positions = layer.kept_positions  # [B, S]
    cos_table, sin_table = rope_table(module._rotary[0], query, kv_len, transposed=False)  # [>= kv_len, d]
    q_pos = torch.full((batch, 1), kv_len - 1, device=device)
    heads = module._apply_rope(query.view(batch, 1, heads_n, d).transpose(1, 2), cos_table[q_pos], sin_table[q_pos])

    # 1. The kept keys, in the kernel.
    kernel_dtype = dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    up, shift = _folded_up(module, layer, kernel_dtype)
    kept_logits = kept_key_logits(
        heads[:, :, 0].to(kernel_dtype),
        layer.kept_keys,
        positions,
        layer.kept_key_ranks,
        layer.side_bits["key"],
        layer.group_size,
        up,
        shift,
        cos_table,
        sin_table,
        module.scaling,
    )
    # 2. The window in torch, one softmax over both, the evidence.
    rope_recent = (cos_table[recent_pos][None].expand(batch, -1, -1), sin_table[recent_pos][None].expand(batch, -1, -1))
    recent_logits = []
    for g in range(n_kv):
        keys = module.mode.rebuild_keys(module, recent_k[..., g * d : (g + 1) * d], g, *rope_recent)  # [B, 1, W, d]
        recent_logits.append(heads[:, g * group : (g + 1) * group, 0] @ keys[:, 0].transpose(-1, -2))
    logits = torch.cat([kept_logits, torch.cat(recent_logits, dim=1).float() * module.scaling], dim=-1)
    row_allowed = allowed[:, 0, 0].expand(batch, -1)  # [B, kv_len]
    mask = torch.cat([row_allowed.gather(1, positions.long()), row_allowed[:, kv_len - n_recent :]], dim=-1)
    probs = torch.softmax(logits.masked_fill(~mask[:, None], torch.finfo(torch.float32).min), dim=-1)  # [B, H, S+W]
    n_kept = positions.shape[-1]
    kept_probs, recent_probs = probs[..., :n_kept], probs[..., n_kept:]
    wanted = layer.wanted_evidence
    if wanted:
        weights = _scored_queries(layer, allowed, 1)[:, 0, None, None]  # [B|1, 1, 1]
        reduce_max = layer.evidence_reduce == "max"

        def evidence(p: torch.Tensor) -> torch.Tensor:
            weighted = p * weights
            return weighted.amax(dim=1) if reduce_max else weighted.sum(dim=1)

        layer.add_scores(
            evidence(recent_probs) if "recent" in wanted else None,
            [evidence(kept_probs)] if "stored" in wanted else None,
            None,
        )
    # 3. Values: the kept tier's code-space sums, mapped back, and the window's.
    sums = kept_value_sums(
        kept_probs.contiguous(), layer.kept_values, layer.kept_value_ranks, layer.side_bits["value"],
        layer.group_size, kernel_dtype,
    )  # fmt: skip
    value_maps = layer._head_maps("value", False, torch.float32)
    outputs = []
    for g, r in enumerate(layer.kept_value_ranks):
        rows = slice(g * group, (g + 1) * group)
        read = sums[:, rows, :r]  # [B, G, r]
        head_map = None if value_maps is None else value_maps[g]
        if head_map is not None and r:
            matrix, offset = head_map
            read = read @ matrix + kept_probs[:, rows].sum(dim=-1, keepdim=True) * offset[:, None]
        out = (
            F.pad(read, (0, d - r)).to(dtype) + recent_probs[:, rows].to(dtype) @ recent_v[:, 0, :, g * d : (g + 1) * d]
        )
        outputs.append(out)  # [B, G, d]
    return torch.cat(outputs, dim=1).reshape(batch, 1, heads_n * d)
