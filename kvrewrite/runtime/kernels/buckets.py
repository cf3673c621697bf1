"""Rank buckets: the torch fast path over the packed variable-rank cache.

KV heads with the same (key rank, value rank) form a bucket. A bucket's heads are read straight out of
the packed cache `[B, 1, S, sum r]` through one strided 4-D view `[B, n, S, w]` (no copy of the cache),
and the whole bucket is one `scaled_dot_product_attention` call per layer:

- GQA by reshape: the group's query heads become extra query rows of their KV head
  (`[B, n, G*T, w]`), so K/V are never repeated per query head;
- the fused SDPA kernels need one head width for q/k and v, so every head uses a window of width
  w = max(rk, rv) into the packed rows: queries are zero-padded to w (the extra key columns, which belong
  to the neighbouring head, are multiplied by zero) and the extra value columns are dropped from the
  output. Windows are shifted left by the same amount for the whole bucket when they would run past the
  end of the packed row;
- a bucket whose heads are not evenly spaced in the packed row, or whose window does not fit, runs as
  matmul-softmax-matmul on per-head strided slices (still no cache copy).

Decode (few query rows) takes one of two routes, picked by the cache's memory order
(kernels.cache_layout); on CPU every kernel that walks one head's columns of token-major packed rows
(SDPA over a strided view, small-M bmm) runs far below memory speed (measured in docs/runtime.md):

- COLUMNS (the order this runner asks the cache for): each KV head's keys are a contiguous [rk, S] block
  K_g^T and its values a contiguous [rv, S] block, so a head is one GEMM `q_g [T*G, rk] @ K_g^T`, one
  softmax and one GEMM with V_g: exact flops, every cache byte read once, contiguously. GQA by reshape
  (the group's query heads are rows of its KV head's GEMM); K/V are never copied;
- ROWS (a cache that keeps token-major rows, e.g. the codec cache): the layer's query heads are
  scattered into a block-diagonal query [B, T*H, sum rk] (head h's columns at its KV head's key offset,
  zeros elsewhere), so scores = one GEMM over the contiguous packed key rows, one softmax, and one GEMM
  with the packed value rows whose diagonal blocks are the per-head outputs. It computes n_kv times the
  useful flops but reads each cache row once, contiguously.

Prefill over a COLUMNS cache first copies the layer's cache to token-major rows (one transpose per
prefill, small next to the prefill's own work) and then runs the buckets.

Everything here is planned once per layout (at load time, after `set_ranks`) and reused every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrewrite.runtime.kernels.cache_layout import COLUMNS, is_column_major
from kvrewrite.runtime.kernels.reference import PackedLayout, boolean_mask, softmax_dtype


@dataclass(frozen=True)
class RankBucket:
    """KV heads (indices into the layout) sharing one key rank and one value rank."""

    heads: tuple[int, ...]
    key_rank: int
    value_rank: int
    width: int  # window width w = max(rk, rv); 0 when the bucket cannot use windows
    key_start: int  # column of the first head's key window in the packed key row
    value_start: int
    key_stride: int  # column distance between consecutive heads of the bucket (0 for one head)
    value_stride: int
    key_shift: int  # where the head's rk key columns start inside its window
    value_shift: int

    @property
    def windowed(self) -> bool:
        return self.width > 0


def _even_runs(heads: list[int], key_offsets: list[int], value_offsets: list[int]) -> list[list[int]]:
    """Split heads (ascending) into runs whose key and value offsets are both arithmetic progressions."""
    runs: list[list[int]] = []
    for h in heads:
        run = runs[-1] if runs else None
        if run is not None and len(run) == 1:
            run.append(h)
            continue
        if run is not None:
            dk = key_offsets[run[1]] - key_offsets[run[0]]
            dv = value_offsets[run[1]] - value_offsets[run[0]]
            if key_offsets[h] - key_offsets[run[-1]] == dk and value_offsets[h] - value_offsets[run[-1]] == dv:
                run.append(h)
                continue
        runs.append([h])
    return runs


def plan_buckets(layout: PackedLayout) -> tuple[RankBucket, ...]:
    """Group the layout's KV heads into buckets of equal ranks that one strided view can address."""
    ko, vo = layout.key_offsets, layout.value_offsets
    key_total, value_total = ko[-1], vo[-1]
    by_ranks: dict[tuple[int, int], list[int]] = {}
    for g, ranks in enumerate(zip(layout.key_ranks, layout.value_ranks)):
        by_ranks.setdefault(ranks, []).append(g)
    buckets = []
    for (rk, rv), heads in by_ranks.items():
        for run in _even_runs(heads, ko, vo):
            key_stride = ko[run[1]] - ko[run[0]] if len(run) > 1 else 0
            value_stride = vo[run[1]] - vo[run[0]] if len(run) > 1 else 0
            width = max(rk, rv, 1)
            # Shift the windows left (uniformly) so the last head's window ends inside the packed row.
            key_shift = max(0, ko[run[-1]] + width - key_total)
            value_shift = max(0, vo[run[-1]] + width - value_total)
            fits = ko[run[0]] - key_shift >= 0 and vo[run[0]] - value_shift >= 0
            buckets.append(
                RankBucket(
                    heads=tuple(run),
                    key_rank=rk,
                    value_rank=rv,
                    width=width if fits else 0,
                    key_start=ko[run[0]] - key_shift,
                    value_start=vo[run[0]] - value_shift,
                    key_stride=key_stride,
                    value_stride=value_stride,
                    key_shift=key_shift,
                    value_shift=value_shift,
                )
            )
    return tuple(sorted(buckets, key=lambda b: b.heads[0]))


class BucketedAttention:
    """Per-layer runner: holds the bucket plan and the index tensors of the packed query/output columns.

    decode_rows: queries with at most this many rows (T x query heads) take a decode route (per-head GEMMs
    on a COLUMNS cache, the block-diagonal whole-row GEMM on a ROWS cache); 0 disables both.
    """

    cache_layout = COLUMNS  # the memory order CompressedAttention stores this layer's cache in

    def __init__(self, layout: PackedLayout, decode_rows: int = 64):
        self.layout = layout
        self.buckets = plan_buckets(layout)
        self.decode_rows = decode_rows
        g = layout.group_size
        qo, oo = layout.query_offsets, layout.output_offsets
        ko, vo = layout.key_offsets, layout.value_offsets
        heads = len(layout.key_ranks) * g
        # Block-diagonal route: packed query column -> flat [head, key column] position, and flat
        # [head, value column] position -> packed output column.
        self._diag_query = torch.tensor(
            [
                (h * g + j) * ko[-1] + ko[h] + i
                for h, rk in enumerate(layout.key_ranks)
                for j in range(g)
                for i in range(rk)
            ],
            dtype=torch.long,
        )
        self._diag_output = torch.tensor(
            [
                (h * g + j) * vo[-1] + vo[h] + i
                for h, rv in enumerate(layout.value_ranks)
                for j in range(g)
                for i in range(rv)
            ],
            dtype=torch.long,
        )
        self._heads = heads
        # Column-major decode: (first head, head count) per GEMM pair; all heads at once when they share
        # one rank pair, else one head each (rank-0 value heads have no output columns and are skipped).
        rank_pairs = set(zip(layout.key_ranks, layout.value_ranks))
        if len(rank_pairs) == 1 and layout.value_ranks[0] > 0:
            self._column_runs = [(0, len(layout.key_ranks))]
        else:
            self._column_runs = [(h, 1) for h, rv in enumerate(layout.value_ranks) if rv > 0]
        # Packed query columns of each bucket, ordered [head, group member, rank] (a small gather per step).
        self._query_index = [
            torch.tensor(
                [qo[h] + j * b.key_rank + i for h in b.heads for j in range(g) for i in range(b.key_rank)],
                dtype=torch.long,
            )
            for b in self.buckets
        ]
        # Where each bucket's output block lands in the packed output (o_proj's input order).
        self._output_index = [
            torch.tensor(
                [oo[h] + j * b.value_rank + i for h in b.heads for j in range(g) for i in range(b.value_rank)],
                dtype=torch.long,
            )
            for b in self.buckets
        ]
        self._device = torch.device("cpu")

    def _on(self, device: torch.device) -> None:
        if device != self._device:
            self._query_index = [t.to(device) for t in self._query_index]
            self._output_index = [t.to(device) for t in self._output_index]
            self._diag_query = self._diag_query.to(device)
            self._diag_output = self._diag_output.to(device)
            self._device = device

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """query [B, T, Qsum], key [B, 1, S, Ksum], value [B, 1, S, Vsum] -> [B, T, Osum]."""
        self._on(query.device)
        batch, q_len, _ = query.shape
        kv_len = key.shape[-2]
        g = self.layout.group_size
        allowed = boolean_mask(attention_mask, q_len, kv_len, query.device)  # [B|1, 1, T, S]
        decode = q_len * self._heads <= self.decode_rows
        if is_column_major(key) or is_column_major(value):
            if decode:
                return self._columns(query, key, value, allowed, scaling)
            key, value = key.contiguous(), value.contiguous()  # prefill: token-major rows for the buckets
        if decode and key[:, 0].is_contiguous() and value[:, 0].is_contiguous():
            return self._block_diagonal(query, key, value, allowed, scaling)
        # Query rows are ordered (group member, position): repeat the mask over the group.
        rows_mask = allowed.expand(allowed.shape[0], 1, q_len, kv_len)
        if g > 1:
            rows_mask = rows_mask.unsqueeze(2).expand(-1, 1, g, q_len, kv_len).reshape(-1, 1, g * q_len, kv_len)
        output = query.new_empty(batch, q_len, self.layout.output_offsets[-1])
        for bucket, q_index, o_index in zip(self.buckets, self._query_index, self._output_index):
            n, rk, rv = len(bucket.heads), bucket.key_rank, bucket.value_rank
            # [B, T, n*G*rk] -> [B, n, G*T, rk]
            q = query[..., q_index].view(batch, q_len, n, g, rk).permute(0, 2, 3, 1, 4).reshape(batch, n, g * q_len, rk)
            if bucket.windowed:
                out = self._windowed(bucket, q, key, value, rows_mask, scaling)
            else:
                out = self._sliced(bucket, q, key, value, rows_mask, scaling)
            # [B, n, G*T, rv] -> [B, T, n*G*rv]
            out = out.view(batch, n, g, q_len, rv).permute(0, 3, 1, 2, 4).reshape(batch, q_len, n * g * rv)
            output[..., o_index] = out
        return output

    def _columns(self, query, key, value, allowed, scaling) -> torch.Tensor:
        """Decode over a COLUMNS cache: per KV head, GEMM with its contiguous K_g^T, softmax, GEMM with V_g.

        A layer whose heads all share one rank pair (every layer at p = 0) runs all heads as one batched GEMM
        pair: [B, n*rk, S] views as [B*n, rk, S] without a copy.
        """
        batch, q_len, _ = query.shape
        kv_len, g = key.shape[-2], self.layout.group_size
        qo, ko, vo = self.layout.query_offsets, self.layout.key_offsets, self.layout.value_offsets
        keys_t = key[:, 0].transpose(1, 2)  # [B, Ksum, S], unit stride along S: the cache storage itself
        values_t = value[:, 0].transpose(1, 2)  # [B, Vsum, S]
        query = query * scaling  # tiny; saves a pass over the scores
        # Additive mask [B|1, 1, T, 1, S] (query rows are ordered (position, group member)); none when all allowed.
        bias = None
        if not bool(allowed.all()):
            score_dtype = softmax_dtype(query.dtype)
            bias = torch.zeros(allowed.shape[0], 1, q_len, 1, kv_len, dtype=score_dtype, device=query.device)
            bias = bias.masked_fill(~allowed[:, :, :, None, :], torch.finfo(score_dtype).min)
        outputs = []
        for h, n in self._column_runs:
            rk, rv = self.layout.key_ranks[h], self.layout.value_ranks[h]
            q = (
                query[..., qo[h] : qo[h + n]]
                .view(batch, q_len, n, g * rk)
                .transpose(1, 2)
                .reshape(batch * n, q_len * g, rk)
            )
            k_t = keys_t[:, ko[h] : ko[h + n]].reshape(batch * n, rk, kv_len)  # a view: the run is the whole row
            scores = torch.bmm(q, k_t)
            scores = scores.to(softmax_dtype(scores.dtype))  # softmax in fp32 (float64 stays float64)
            if bias is not None:
                scores.view(batch, n, q_len, g, kv_len).add_(bias)
            probs = torch.softmax(scores, dim=-1).to(value.dtype)
            v = values_t[:, vo[h] : vo[h + n]].reshape(batch * n, rv, kv_len).transpose(1, 2)  # [B*n, S, rv]
            out = torch.bmm(probs, v)  # [B*n, T*G, rv]
            outputs.append(out.view(batch, n, q_len, g * rv).transpose(1, 2).reshape(batch, q_len, n * g * rv))
        if not outputs:
            return query.new_zeros(batch, q_len, 0)
        return torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]

    def _block_diagonal(self, query, key, value, allowed, scaling) -> torch.Tensor:
        batch, q_len, _ = query.shape
        kv_len, key_total, value_total = key.shape[-2], key.shape[-1], value.shape[-1]
        heads = self._heads
        q = query.new_zeros(batch, q_len, heads * key_total)
        q[..., self._diag_query] = query
        # Rows ordered (position, head); the mask row of position t serves all heads.
        score_dtype = softmax_dtype(query.dtype)
        bias = torch.zeros(allowed.shape[0], q_len, 1, kv_len, dtype=score_dtype, device=query.device)
        bias = bias.masked_fill(~allowed[:, 0, :, None, :], torch.finfo(score_dtype).min)
        bias = bias.expand(batch, q_len, heads, kv_len).reshape(batch, q_len * heads, kv_len)
        keys = key.view(batch, kv_len, key_total)  # contiguous packed rows, no copy
        rows = q.view(batch, q_len * heads, key_total)
        if query.dtype == score_dtype:
            scores = torch.baddbmm(bias, rows, keys.transpose(1, 2), alpha=scaling)
        else:  # low-precision GEMM (fp32 accumulation inside), softmax in fp32
            scores = torch.bmm(rows, keys.transpose(1, 2)).to(score_dtype) * scaling + bias
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        full = torch.bmm(probs, value.view(batch, kv_len, value_total))  # [B, T*H, Vsum]
        return full.view(batch, q_len, heads * value_total)[..., self._diag_output]

    @staticmethod
    def _windowed(bucket: RankBucket, q, key, value, rows_mask, scaling) -> torch.Tensor:
        batch, n = q.shape[0], q.shape[1]
        kv_len, w = key.shape[-2], bucket.width
        ks, vs = key.stride(), value.stride()
        # [B, n, S, w] views straight into the packed cache rows.
        k = key.as_strided(
            (batch, n, kv_len, w),
            (ks[0], bucket.key_stride, ks[2], ks[3]),
            key.storage_offset() + bucket.key_start * ks[3],
        )
        v = value.as_strided(
            (batch, n, kv_len, w),
            (vs[0], bucket.value_stride, vs[2], vs[3]),
            value.storage_offset() + bucket.value_start * vs[3],
        )
        if bucket.key_rank != w or bucket.key_shift:
            q = F.pad(q, (bucket.key_shift, w - bucket.key_rank - bucket.key_shift))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=rows_mask, scale=scaling)
        return out[..., bucket.value_shift : bucket.value_shift + bucket.value_rank]

    def _sliced(self, bucket: RankBucket, q, key, value, rows_mask, scaling) -> torch.Tensor:
        ko, vo = self.layout.key_offsets, self.layout.value_offsets
        outs = []
        for j, h in enumerate(bucket.heads):
            k = key[:, 0, :, ko[h] : ko[h + 1]]
            v = value[:, 0, :, vo[h] : vo[h + 1]]
            scores = torch.matmul(q[:, j], k.transpose(-1, -2)).to(softmax_dtype(q.dtype)) * scaling
            scores = scores.masked_fill(~rows_mask[:, 0], torch.finfo(scores.dtype).min)
            outs.append(torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v))
        return torch.stack(outs, dim=1)
