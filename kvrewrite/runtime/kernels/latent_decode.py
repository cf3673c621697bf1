"""Latent-key decode in torch: every cached key rebuilt and rotated tile by tile, never the whole cache at once.

A `latent` layer caches each KV head's pre-RoPE key as an rk-dim latent; attention needs R_s (U_g^T c_s), the key
rebuilt by the head's up-projection U_g [rk, d] and rotated at its cache position s. Rebuilding the whole cache first
(the prefill path, `CompressedAttention._latent_attention`) writes and re-reads S x d values per head and step, a
copy the size of the original cache. Here, for a few query rows (decode):

- the keys of a tile of TILE positions are rebuilt, K = C_tile U_g ([B, n, d], one GEMM against the latent block
  C_g^T [rk, S] as it sits in the cache, into one buffer reused by every tile), with U_g's columns in rotary-pair
  order (dims j and j + d / 2 side by side), so that RoPE is one complex multiply of each pair by its position's
  phase, in place; then scored right away against the group's G query heads (in the same order, [G*T, d] @ K^T):
  the tile stays in the CPU's cache between the three steps;
- only the scores [B, G*T, S] are kept (small: G*T rows, not d columns); one softmax over them, then one GEMM with
  the head's value block, as for the other forms.

Without phases (an adapter with its own apply_rope, none of the supported families; or bfloat16, which has no
complex type) the same tiles have their keys rebuilt transposed and rotated by rotate_half in three passes. Both
memory orders of kernels.cache_layout work: COLUMNS gives the latent block C_g^T as contiguous rows of S values (the
order InPlaceLayer keeps on CPU), ROWS as a strided view (a StaticCache); neither is copied.
"""

from __future__ import annotations

import torch

from kvrewrite.key_modes.latent import pair_order
from kvrewrite.runtime.kernels.cache_layout import is_column_major
from kvrewrite.runtime.kernels.reference import softmax_dtype

# Positions per tile: the fastest of 256-4096 on a 2-core Xeon (benchmarks/results/cpu_decode_limits.json).
TILE = 1024


def latent_block_columns(keys: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """KV head columns [start, start + width) of logical packed keys [B, 1, S, K] as [B, width, S] (a view)."""
    return keys[:, 0, :, start : start + width].transpose(1, 2)


def rotate_columns_(keys_t: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor) -> torch.Tensor:
    """RoPE (HF rotate_half convention) on transposed keys [..., d, n] with cos/sin [d, n]; returns a new tensor."""
    half = keys_t.shape[-2] // 2
    rotated = keys_t * cos_t
    rotated[..., :half, :].addcmul_(keys_t[..., half:, :], sin_t[:half], value=-1.0)
    rotated[..., half:, :].addcmul_(keys_t[..., :half, :], sin_t[half:])
    return rotated


def latent_decode_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    key_ranks: list[int],
    value_ranks: list[int],
    up: torch.Tensor,
    cos_t: torch.Tensor,
    sin_t: torch.Tensor,
    phases: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of rotated queries over latent keys, keys rebuilt tile by tile.

    queries [B, H, T, d] (already rotated at their positions), keys [B, 1, S, sum rk] and values [B, 1, S, sum rv]
    (logical packed views, any memory order), allowed [B|1, 1, T, S], up [n_kv, d, d] (rows: latent dims),
    cos_t/sin_t [d, >= S] of cache positions 0.. -> o_proj's input [B, T, sum_g G * rv_g]. phases: the same angles
    as rope_table.rope_phases gives them (complex [>= S, d / 2]) where the module rotates rotary pairs
    (rope_table.rotates_half_pairs): RoPE is then one complex multiply per pair; None: rotate_half on cos_t/sin_t.
    """
    batch, heads, q_len, d = queries.shape
    kv_len = keys.shape[-2]
    n_kv = len(key_ranks)
    group = heads // n_kv
    half = d // 2
    outputs, key_start, value_start = [], 0, 0
    mask = ~allowed  # [B|1, 1, T, S]
    columns = is_column_major(values)
    paired = phases is not None and queries.dtype in (torch.float32, torch.float64)  # no bfloat16 complex numbers
    if paired:
        order = pair_order(d, queries.device)
        queries = queries[..., order]  # the scores read queries and keys in the same order
        tile_keys = queries.new_empty(batch * min(TILE, kv_len) * d)
    for g, (rk, rv) in enumerate(zip(key_ranks, value_ranks)):
        rows = queries[:, g * group : (g + 1) * group].reshape(batch, group * q_len, d)
        scores = queries.new_empty(batch, group * q_len, kv_len, dtype=softmax_dtype(queries.dtype))
        if rk == 0:
            scores.zero_()  # no key dims kept: every key scores 0
        elif paired:
            latent_t = latent_block_columns(keys, key_start, rk)  # [B, rk, S]
            up_pairs = up[g, :rk][:, order]  # [rk, d], columns in pair order
            for start in range(0, kv_len, TILE):
                stop = min(start + TILE, kv_len)
                n = stop - start
                tile = tile_keys[: batch * n * d].view(batch, n, d)
                torch.matmul(latent_t[..., start:stop].transpose(1, 2), up_pairs, out=tile)
                torch.view_as_complex(tile.view(batch, n, half, 2)).mul_(phases[start:stop])
                scores[..., start:stop] = torch.bmm(rows, tile.transpose(1, 2))
        else:
            latent_t = latent_block_columns(keys, key_start, rk)  # [B, rk, S]
            # bmm with the up-projection expanded over the batch: the rebuilt tile comes out contiguous [B, d, n]
            # (torch.matmul would fold the batch into a GEMM whose result is a transposed view).
            up_t = up[g, :rk].transpose(0, 1).expand(batch, d, rk)
            for start in range(0, kv_len, TILE):
                stop = min(start + TILE, kv_len)
                keys_t = torch.bmm(up_t, latent_t[..., start:stop])  # [B, d, n]
                keys_t = rotate_columns_(keys_t, cos_t[:, start:stop], sin_t[:, start:stop])
                scores[..., start:stop] = torch.matmul(rows, keys_t)
        scores.mul_(scaling)
        scores = scores.view(batch, group, q_len, kv_len).masked_fill_(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(batch, group * q_len, kv_len)
        # probs @ V_g: the value block as a transposed operand in either memory order. With the block's contiguous
        # [rv, S] rows (COLUMNS) as the left operand instead, MKL ran 5.5x slower on a 2-core Xeon (torch 2.13;
        # benchmarks/results/cpu_decode_limits.json).
        if columns:
            block = latent_block_columns(values, value_start, rv).transpose(1, 2)  # [B, S, rv]
        else:  # token-major rows (a StaticCache): the block is row-major [S, rv]
            block = values[:, 0, :, value_start : value_start + rv]
        out = torch.bmm(probs, block).view(batch, group, q_len, rv).transpose(1, 2)
        outputs.append(out.reshape(batch, q_len, group * rv))
        key_start, value_start = key_start + rk, value_start + rv
    return torch.cat(outputs, dim=-1)
