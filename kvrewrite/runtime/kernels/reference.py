"""Torch reference attention over variable-rank heads: the oracle every faster path is tested against.

Layout (one decoder layer):
- the cache holds keys as [B, 1, S, sum_g rk_g] and values as [B, 1, S, sum_g rv_g]: all KV heads of the
  layer packed into one pseudo-head, KV head g at a fixed column offset;
- queries are packed as [B, T, sum_h rk_{g(h)}], query heads in order, each with its group's key rank;
- the output is packed as [B, T, sum_h rv_{g(h)}], which is exactly o_proj's (folded) input layout.

Crosshead-key layers (shared_key_attention) cache ONE key block [B, 1, S, R] scored by every query
head (queries [B, T, n_q * R]); key_ranks is then (R, 0, ..., 0) and values keep the per-KV-head layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True)
class PackedLayout:
    """Column offsets of every KV head's block in the packed query, key, value and output tensors."""

    key_ranks: tuple[int, ...]
    value_ranks: tuple[int, ...]
    group_size: int

    @property
    def key_offsets(self) -> list[int]:
        return [0, *accumulate(self.key_ranks)]

    @property
    def value_offsets(self) -> list[int]:
        return [0, *accumulate(self.value_ranks)]

    @property
    def query_offsets(self) -> list[int]:
        return [0, *accumulate(r * self.group_size for r in self.key_ranks)]

    @property
    def output_offsets(self) -> list[int]:
        return [0, *accumulate(r * self.group_size for r in self.value_ranks)]


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax run in float32 for low-precision inputs, in float64 for float64 ones (the compile's
    exact full-rank check runs the rewrite in float64 and must not lose precision here)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def causal_mask(q_len: int, kv_len: int, offset: int, device) -> torch.Tensor:
    """[1, 1, T, S]: query i (at cache index offset + i) may attend keys 0 .. offset + i."""
    rows = torch.arange(q_len, device=device)[:, None] + offset
    return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]


def boolean_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor:
    """True where a query may attend; accepts HF's bool or additive float masks, or None as transformers means it.

    transformers leaves the mask out (sdpa) only where SDPA's own causal flag gives the same: one query (it reads
    every key), as many queries as keys, or a prefill into an empty StaticCache, whose unfilled slots past the
    queries the top-left alignment of SDPA's `is_causal` hides. So a missing mask is causal aligned top-left for
    several queries: query i reads keys 0 .. i (aligning bottom-right would let a StaticCache prefill read its
    unfilled slots).
    """
    if attention_mask is None:
        if q_len == 1:  # a decode step reads every key: one fill instead of the four launches of a causal mask
            return torch.ones((1, 1, 1, kv_len), dtype=torch.bool, device=device)
        return causal_mask(q_len, kv_len, 0, device)
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :kv_len]
    return attention_mask[..., :kv_len] > torch.finfo(attention_mask.dtype).min / 2


def grouped_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One KV group: queries [B, n_rep, T, r], keys [B, 1|n_rep, S, r], values [B, 1, S, rv] -> [B, n_rep, T, rv].

    GQA is a broadcast over the n_rep axis, never a copy of K/V per query head.
    """
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scaling
    scores = scores.to(softmax_dtype(scores.dtype))
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    layout: PackedLayout,
) -> torch.Tensor:
    """query [B, T, Qsum], key [B, 1, S, Ksum], value [B, 1, S, Vsum] -> output [B, T, Osum]."""
    batch, q_len, _ = query.shape
    kv_len = key.shape[-2]
    allowed = boolean_mask(attention_mask, q_len, kv_len, query.device)
    qo, ko, vo = layout.query_offsets, layout.key_offsets, layout.value_offsets
    outputs = []
    for g, (rk, rv) in enumerate(zip(layout.key_ranks, layout.value_ranks)):
        q = query[..., qo[g] : qo[g + 1]].view(batch, q_len, layout.group_size, rk).transpose(1, 2)
        out = grouped_attention(q, key[..., ko[g] : ko[g + 1]], value[..., vo[g] : vo[g + 1]], allowed, scaling)
        outputs.append(out.transpose(1, 2).reshape(batch, q_len, layout.group_size * rv))
    return torch.cat(outputs, dim=-1)


def shared_key_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    layout: PackedLayout,
) -> torch.Tensor:
    """query [B, T, n_q * R], key [B, 1, S, R] shared by all query heads, value [B, 1, S, Vsum] -> [B, T, Osum]."""
    batch, q_len, _ = query.shape
    kv_len, rank = key.shape[-2], key.shape[-1]
    allowed = boolean_mask(attention_mask, q_len, kv_len, query.device)
    n_q = layout.group_size * len(layout.value_ranks)
    queries = query.view(batch, q_len, n_q, rank).transpose(1, 2)
    vo = layout.value_offsets
    outputs = []
    for g, rv in enumerate(layout.value_ranks):
        q = queries[:, g * layout.group_size : (g + 1) * layout.group_size]
        out = grouped_attention(q, key, value[..., vo[g] : vo[g + 1]], allowed, scaling)
        outputs.append(out.transpose(1, 2).reshape(batch, q_len, layout.group_size * rv))
    return torch.cat(outputs, dim=-1)
