"""Triton kernels for attention over the packed variable-rank cache (decode and prefill), ZACK §5.3 balanced.

Both kernels read the layout straight from the packed tensors: queries [B, T, Qsum], keys [B, 1, S, Ksum],
values [B, 1, S, Vsum], output [B, T, Osum] (the same layout as kernels.reference). Per-KV-head column
offsets and ranks live in small int32 tables, so one compiled kernel serves every rank mix of a model;
tiles are padded to a power of two >= the largest rank and masked to each head's rank.

GQA: a program owns one KV head and computes all its query heads, so K/V are read once per group.

- decode (one query token): a fixed grid of `workers` programs; worker w runs the (request, head) tasks
  the longest-processing-time-first schedule gave it (kernels.scheduling.lpt_decode_schedule);
- prefill: one program per equal-work row block (kernels.scheduling.prefill_tasks); with a causal mask
  the key loop stops at the block's last row.

The kernels run on CUDA; their tests run them on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.kernels.cache_layout import ROWS
from kvrewrite.runtime.kernels.flash_decode_packed import packed_flash_decode
from kvrewrite.runtime.kernels.flash_decode_splits import NEG_INF, interpreter_upcast, pow2
from kvrewrite.runtime.kernels.reference import PackedLayout, boolean_mask
from kvrewrite.runtime.kernels.scheduling import head_work, lpt_decode_schedule, prefill_tasks

INTERPRETER_WORKERS = 4


@triton.jit
def _attend_block(q, m_i, l_i, acc, k_ptrs, v_ptrs, key_ok, value_ok, allowed, scaling, UPCAST: tl.constexpr):
    """One key block of online softmax: scores, running max/sum, and the value accumulation."""
    k = tl.load(k_ptrs, mask=key_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * scaling
    s = tl.where(allowed, s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(allowed, tl.exp(s - m_new[:, None]), 0.0)
    v = tl.load(v_ptrs, mask=value_ok, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    mask_ptr,
    tasks_ptr,
    starts_ptr,
    q_off_ptr,
    k_off_ptr,
    v_off_ptr,
    o_off_ptr,
    k_rank_ptr,
    v_rank_ptr,
    kv_len,
    scaling,
    stride_qb,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    stride_ob,
    stride_mb,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    worker = tl.program_id(0)
    first = tl.load(starts_ptr + worker)
    last = tl.load(starts_ptr + worker + 1)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_N)
    for t in range(first, last):
        b = tl.load(tasks_ptr + 2 * t).to(tl.int64)
        h = tl.load(tasks_ptr + 2 * t + 1)
        rk = tl.load(k_rank_ptr + h)
        rv = tl.load(v_rank_ptr + h)
        q_cols = tl.load(q_off_ptr + h) + rows[:, None] * rk + dims[None, :]
        row_ok = rows[:, None] < GROUP
        q = tl.load(q_ptr + b * stride_qb + q_cols, mask=row_ok & (dims[None, :] < rk), other=0.0)
        m_i = tl.full([BLOCK_G], NEG_INF, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        k_base = k_ptr + b * stride_kb + tl.load(k_off_ptr + h)
        v_base = v_ptr + b * stride_vb + tl.load(v_off_ptr + h)
        for start in range(0, kv_len, BLOCK_N):
            n = start + cols
            in_range = n < kv_len
            allowed = (tl.load(mask_ptr + b * stride_mb + n, mask=in_range, other=0) != 0)[None, :] & row_ok
            m_i, l_i, acc = _attend_block(
                q,
                m_i,
                l_i,
                acc,
                k_base + n[:, None] * stride_ks + dims[None, :],
                v_base + n[:, None] * stride_vs + dims[None, :],
                in_range[:, None] & (dims[None, :] < rk),
                in_range[:, None] & (dims[None, :] < rv),
                allowed,
                scaling,
                UPCAST,
            )
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        o_cols = tl.load(o_off_ptr + h) + rows[:, None] * rv + dims[None, :]
        tl.store(o_ptr + b * stride_ob + o_cols, out.to(o_ptr.dtype.element_ty), mask=row_ok & (dims[None, :] < rv))


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    mask_ptr,
    tasks_ptr,
    q_off_ptr,
    k_off_ptr,
    v_off_ptr,
    o_off_ptr,
    k_rank_ptr,
    v_rank_ptr,
    kv_len,
    past_len,
    scaling,
    stride_qb,
    stride_qt,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    stride_ob,
    stride_ot,
    stride_mb,
    stride_mt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    task = tl.program_id(0)
    b = tl.load(tasks_ptr + 4 * task).to(tl.int64)
    h = tl.load(tasks_ptr + 4 * task + 1)
    row_start = tl.load(tasks_ptr + 4 * task + 2)
    row_end = tl.load(tasks_ptr + 4 * task + 3)
    rk = tl.load(k_rank_ptr + h)
    rv = tl.load(v_rank_ptr + h)
    # Tile rows are (position, group member) pairs: the group shares every K/V block it loads.
    flat = tl.arange(0, BLOCK_M * BLOCK_G)
    member = flat % BLOCK_G
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_N)
    k_base = k_ptr + b * stride_kb + tl.load(k_off_ptr + h)
    v_base = v_ptr + b * stride_vb + tl.load(v_off_ptr + h)
    q_off = tl.load(q_off_ptr + h)
    o_off = tl.load(o_off_ptr + h)
    for chunk in range(row_start, row_end, BLOCK_M):
        pos = chunk + flat // BLOCK_G
        row_ok = (member < GROUP) & (pos < row_end)
        q_ptrs = q_ptr + b * stride_qb + pos[:, None] * stride_qt + q_off + member[:, None] * rk + dims[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (dims[None, :] < rk), other=0.0)
        m_i = tl.full([BLOCK_M * BLOCK_G], NEG_INF, tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        kv_stop = kv_len
        if CAUSAL:
            kv_stop = tl.minimum(kv_len, past_len + tl.minimum(chunk + BLOCK_M, row_end))
        for start in range(0, kv_stop, BLOCK_N):
            n = start + cols
            in_range = n < kv_len
            m_ptrs = mask_ptr + b * stride_mb + pos[:, None] * stride_mt + n[None, :]
            allowed = tl.load(m_ptrs, mask=row_ok[:, None] & in_range[None, :], other=0) != 0
            m_i, l_i, acc = _attend_block(
                q,
                m_i,
                l_i,
                acc,
                k_base + n[:, None] * stride_ks + dims[None, :],
                v_base + n[:, None] * stride_vs + dims[None, :],
                in_range[:, None] & (dims[None, :] < rk),
                in_range[:, None] & (dims[None, :] < rv),
                allowed,
                scaling,
                UPCAST,
            )
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        o_ptrs = o_ptr + b * stride_ob + pos[:, None] * stride_ot + o_off + member[:, None] * rv + dims[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims[None, :] < rv))


class TritonPackedAttention:
    """Per-layer runner with the rank tables on the device and cached decode schedules."""

    cache_layout = ROWS  # the kernels read token-major packed rows (unit column stride)

    def __init__(
        self,
        layout: PackedLayout,
        causal: bool = True,
        workers: int | None = None,
        base_rows: int = 32,
        flash_decode: bool = True,
    ):
        self.layout = layout
        # Decode through the flash-decoding kernel (default) or the one-program-per-head _decode_kernel.
        self.flash_decode = flash_decode
        self.causal = causal
        self.workers = workers
        self.base_rows = base_rows
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._schedules: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _rank_tables(self, device: torch.device) -> torch.Tensor:
        if device not in self._tables:
            lay = self.layout
            rows = [
                lay.query_offsets[:-1],
                lay.key_offsets[:-1],
                lay.value_offsets[:-1],
                lay.output_offsets[:-1],
                list(lay.key_ranks),
                list(lay.value_ranks),
            ]
            self._tables[device] = torch.tensor(rows, dtype=torch.int32, device=device)
        return self._tables[device]

    def _worker_count(self, device: torch.device) -> int:
        if self.workers is not None:
            return self.workers
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).multi_processor_count
        return INTERPRETER_WORKERS

    def _decode_schedule(self, batch: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        workers = self._worker_count(device)
        key = (batch, workers, device)
        if key not in self._schedules:
            # Every request of a batch has the same (padded) context, so the order depends only on the
            # ranks and one schedule serves every step of this batch size.
            lay = self.layout
            costs = {
                (b, h): float(kv_len * head_work(rk, rv))
                for b in range(batch)
                for h, (rk, rv) in enumerate(zip(lay.key_ranks, lay.value_ranks))
            }
            plan = lpt_decode_schedule(costs, workers)
            tasks = torch.tensor(plan.tasks, dtype=torch.int32, device=device).reshape(-1)
            starts = torch.tensor(plan.starts, dtype=torch.int32, device=device)
            self._schedules[key] = (tasks, starts)
        tasks, starts = self._schedules[key]
        return tasks, starts, starts.numel() - 1

    def __call__(self, query, key, value, attention_mask, scaling: float) -> torch.Tensor:
        batch, q_len, _ = query.shape
        kv_len = key.shape[-2]
        lay = self.layout
        g = lay.group_size
        query = query if query.stride(-1) == 1 else query.contiguous()
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        allowed = boolean_mask(attention_mask, q_len, kv_len, query.device)
        if q_len == 1 and self.flash_decode:
            # Flash-decoding (kernels.flash_decode_packed): the sequence split across programs, partials merged.
            keep = allowed.expand(batch, 1, 1, kv_len)[:, 0, 0]  # [B, S]
            return packed_flash_decode(query[:, 0], key[:, 0], value[:, 0], keep, None, scaling, lay)[:, None]
        mask = allowed.expand(batch, 1, q_len, kv_len)[:, 0].to(torch.int8).contiguous()  # [B, T, S]
        output = torch.empty(batch, q_len, lay.output_offsets[-1], device=query.device, dtype=query.dtype)
        tables = self._rank_tables(query.device)
        block_d = pow2(max(max(lay.key_ranks, default=1), max(lay.value_ranks, default=1)))
        block_g = pow2(g, floor=1)
        common = (*tables.unbind(0),)
        # Triton's CPU interpreter computes tl.dot on bf16 tiles wrongly (it reads them as integers), so
        # under the interpreter tiles are widened to fp32 before each dot; loads and stores stay bf16.
        upcast = interpreter_upcast(query.dtype)
        if q_len == 1:
            tasks, starts, workers = self._decode_schedule(batch, kv_len, query.device)
            _decode_kernel[(workers,)](
                query,
                key,
                value,
                output,
                mask,
                tasks,
                starts,
                *common,
                kv_len,
                scaling,
                query.stride(0),
                key.stride(0),
                key.stride(2),
                value.stride(0),
                value.stride(2),
                output.stride(0),
                mask.stride(0),
                GROUP=g,
                BLOCK_G=max(16, block_g),
                BLOCK_N=64,
                BLOCK_D=block_d,
                UPCAST=upcast,
            )
            return output
        block_m = max(1, 64 // block_g)
        tasks = prefill_tasks(batch, q_len, lay.key_ranks, lay.value_ranks, self.base_rows, block_m)
        task_table = torch.tensor(tasks, dtype=torch.int32, device=query.device).reshape(-1)
        _prefill_kernel[(len(tasks),)](
            query,
            key,
            value,
            output,
            mask,
            task_table,
            *common,
            kv_len,
            kv_len - q_len,
            scaling,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(2),
            value.stride(0),
            value.stride(2),
            output.stride(0),
            output.stride(1),
            mask.stride(0),
            mask.stride(1),
            GROUP=g,
            BLOCK_G=block_g,
            BLOCK_M=block_m,
            BLOCK_N=32,
            BLOCK_D=block_d,
            CAUSAL=self.causal,
            UPCAST=upcast,
        )
        return output
