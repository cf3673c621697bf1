"""A decode step over an evicting layer whose kept tier the Triton kernels read in code space (CUDA).

tiers/attention.py's torch path decodes the whole kept tier to floats, rebuilds and rotates every kept key and
multiplies, one torch op at a time, on every step. Here (one query per sequence, `latent` keys under HF's
rotate_half, both sides coded, no floor) the kept tier's codes are read where they lie, and the step is five
kernels and a few torch ops a layer:

1. kernels.kept_window_kernels.window_logits rotates the queries and scores the recent window (at most window + 1
   full-rank tokens, keys rebuilt and rotated in registers), with the window's softmax statistics;
2. kernels.kept_tier_kernels.kept_key_logits scores the rotated queries against the kept keys, each rebuilt from
   its codes in registers through the head's up-projection with the code space's map folded in
   (latent = y @ matrix + offset, so key = RoPE(y @ (matrix @ k_up) + offset @ k_up)), writes the logits and, per
   chunk of rows, their softmax statistics (max, sum of exp);
3. kernels.kept_window_kernels.window_finish joins both tiers' statistics into the log of the one softmax's
   denominator per head, and sums the window's probabilities times its values and its evidence;
4. kernels.kept_tier_kernels.kept_weighted_values turns the kept logits into probabilities in registers, sums
   them times the dequantised value codes per chunk of rows, and writes the evidence the policy re-scores its
   tokens by (summed, or max-ed, over each group's heads; torch adds the groups), as the torch path computes it;
5. kernels.kept_window_kernels.kept_finish adds the chunks, moves the map onto the value sum
   (sum p x = (sum p y) matrix + offset sum p) and adds the window's part.

Beyond the codes, a step moves a few numbers per kept token and query head (the logits, written once and read
once), not the several passes a softmax in torch would make over them, and nothing returns to the host.

The maps (k_up with the key map folded in, the value map) are made once per sequence, at the first step after the
statistics are set, and held on the layer as derived data, not cache content: [B, n_kv, r, d] in the model's dtype,
about 16 MB a layer for Llama-3-8B at batch 64 (the cache's bytes do not count them).

Everything else (prefill chunks, a floor, keys that are not rebuilt, bits off, a window of more than 31 tokens, CPU)
takes the torch path, which tests/test_kept_decode.py holds this path equal to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.runtime.kernels.dispatch import resolve_backend
from kvrewrite.runtime.kernels.reference import boolean_mask
from kvrewrite.runtime.kernels.rope_table import rope_table, rotates_half_pairs
from kvrewrite.runtime.tiers.evidence import scored_queries

# The most window rows (the window and the new token) the window's kernels take, in one tile: at 32 both Tritons
# compile them for sm_90 without spills, at 64 Triton 3.6 spills the window finish
# (benchmarks/flash_decode_resources.py); a longer window takes the torch path.
MAX_WINDOW_ROWS = 32


def kept_decode_applies(module, layer, query: torch.Tensor) -> bool:
    """Whether this step runs on the kept-tier kernels: one query per sequence on a layer they can read, with the
    triton backend chosen for the device (kernels.dispatch)."""
    # An evicting layer (tiers/eviction.py), recognised by its kept tier: importing the class here would close an
    # import circle through tiers/cache.py.
    if query.shape[1] != 1 or getattr(layer, "kept_key_ranks", None) is None or not hasattr(layer, "side_bits"):
        return False
    if not (module.mode.rebuilds_keys and rotates_half_pairs(module)):
        return False
    if layer.kept_positions is None or not layer.kept_positions.shape[-1] or layer.holding:
        return False
    if layer.floor_positions is not None and layer.floor_positions.shape[-1]:
        return False
    if any(bits is None for bits in layer.side_bits.values()):
        return False
    if layer.keys.shape[-2] > MAX_WINDOW_ROWS:  # the window with the new token: its kernels take it as one tile
        return False
    return resolve_backend(query.device) == "triton"


@dataclass(frozen=True)
class KernelMaps:
    """An evicting layer's code-space maps as the kernels and the output need them, per KV head stacked and padded
    with zeros to the widest rank: the up-projection with the key map folded in [B, n_kv, R, d] (kernel dtype) and
    the key map's offset through it [B, n_kv, d]; the value map [B, n_kv, Rv, Rv] and offset [B, n_kv, Rv]."""

    up: torch.Tensor
    shift: torch.Tensor
    value_matrix: torch.Tensor
    value_offset: torch.Tensor


def _stacked_maps(layer, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The side's per-head (matrix, offset) maps, zero-padded to the widest rank: [B, n_kv, R, R], [B, n_kv, R]."""
    ranks = layer.kept_key_ranks if side == "key" else layer.kept_value_ranks
    maps = layer.head_maps(side, False, torch.float32)
    batch, width = layer.kept_positions.shape[0], max(ranks)
    device = layer.kept_positions.device
    matrix = torch.zeros(batch, len(ranks), width, width, device=device)
    offset = torch.zeros(batch, len(ranks), width, device=device)
    for g, r in enumerate(ranks):
        head_map = None if maps is None else maps[g]
        if head_map is None:  # stored as is
            matrix[:, g, :r, :r] = torch.eye(r, device=device)
        elif r:
            matrix[:, g, :r, :r], offset[:, g, :r] = head_map
    return matrix, offset


def kernel_maps(module, layer, dtype: torch.dtype) -> KernelMaps:
    """The layer's KernelMaps, made once per sequence: the statistics behind them are set at its first settle, and
    the layer drops the maps on reset and on every batch reorder (EvictingLayer.kernel_maps)."""
    held = layer.kernel_maps
    if held is not None and held.up.dtype == dtype:
        return held
    ranks = layer.kept_key_ranks
    width = max(ranks)
    key_matrix, key_offset = _stacked_maps(layer, "key")
    up_rows = torch.zeros(len(ranks), width, module.head_dim, device=key_matrix.device)  # k_up's first r rows per head
    for g, r in enumerate(ranks):
        up_rows[g, :r] = module.k_up[g, :r].float()
    value_matrix, value_offset = _stacked_maps(layer, "value")
    held = KernelMaps(
        (key_matrix @ up_rows).to(dtype),  # latent = y @ matrix + offset, so y's key is y @ (matrix @ k_up) + ...
        (key_offset.unsqueeze(-2) @ up_rows).squeeze(-2),
        value_matrix,
        value_offset,
    )
    layer.kernel_maps = held
    return held


def kept_decode_attention(module, query: torch.Tensor, layer, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """query [B, 1, H * d] (full rank, as the module projects it) -> o_proj's input [B, 1, H * d]."""
    from kvrewrite.runtime.kernels.kept_tier_kernels import kept_key_logits, kept_weighted_values
    from kvrewrite.runtime.kernels.kept_window_kernels import kept_finish, window_finish, window_logits

    batch = query.shape[0]
    dtype = query.dtype
    d, n_kv = module.head_dim, module.num_kv_heads
    kv_len = layer.get_seq_length()
    allowed = boolean_mask(attention_mask, 1, kv_len, query.device)  # [B|1, 1, 1, kv_len]
    row_allowed = allowed[:, 0, 0].expand(batch, -1)  # [B, kv_len], by cache index
    window_keys, window_values = layer.keys[:, 0], layer.values[:, 0]  # [B, W, n_kv * d], full-rank latents
    first_window = kv_len - window_keys.shape[1]
    cos_table, sin_table = rope_table(module._rotary[0], query, kv_len, transposed=False)  # [>= kv_len, d]
    kernel_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32
    maps = kernel_maps(module, layer, kernel_dtype)

    # 1. The queries rotated, and the window's keys rebuilt, rotated and scored, with their softmax statistics.
    queries, recent_logits, recent_max, recent_sum = window_logits(
        query.view(batch, -1, d), window_keys, module.k_up, cos_table, sin_table, row_allowed, first_window,
        module.scaling, kernel_dtype,
    )  # fmt: skip
    # 2. The kept keys, in the kernel: logits and, per chunk of rows, their softmax statistics.
    kept_logits, maxima, sums = kept_key_logits(
        queries, layer.kept_keys, layer.kept_positions, row_allowed, layer.kept_key_ranks, layer.side_bits["key"],
        layer.group_size, maps.up, maps.shift, cos_table, sin_table, module.scaling,
    )  # fmt: skip
    # 3. The one softmax's denominator over both tiers; the window's probabilities times its values, and its
    # evidence. An evicting layer re-scores both tiers (its wanted_evidence).
    weights = scored_queries(layer, allowed, 1)[:, 0]  # [B|1]: 0 for a request that reads no key
    reduce_max = layer.evidence_reduce == "max"
    lse, kept_mass, recent_out, recent_evidence = window_finish(
        maxima, sums, recent_max, recent_sum, recent_logits, window_values, weights, n_kv, evidence_max=reduce_max
    )
    # 4. The kept rows' probabilities times their value codes, and their evidence, per chunk of rows.
    partial, kept_evidence = kept_weighted_values(
        kept_logits, lse, layer.kept_positions, row_allowed, weights, layer.kept_values, layer.kept_value_ranks,
        layer.side_bits["value"], layer.group_size, kernel_dtype, evidence_max=reduce_max,
    )  # fmt: skip
    layer.add_scores(
        recent_evidence.amax(dim=1) if reduce_max else recent_evidence.sum(dim=1),
        [kept_evidence.amax(dim=1) if reduce_max else kept_evidence.sum(dim=1)],
        None,
    )
    # 5. The kept tier's code-space sums mapped back (sum p x = (sum p y) M + offset sum p), plus the window's.
    return kept_finish(partial, kept_mass, maps.value_matrix, maps.value_offset, recent_out, dtype)
