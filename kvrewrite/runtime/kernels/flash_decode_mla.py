"""Flash-decoding kernel for absorbed multi-head latent attention (MLA): queries in latent space, one kernel.

The cache holds one row [c | k_pe] per token (runtime.mla.latent_cache), rows [B, S_cap, r + d_r]; the caller
absorbs W_uk into the queries, q_rows [B, H, r + d_r] = [W_uk^T q_nope | q_pe]. Every head's score is q_row . row,
and its output is the softmax-weighted sum of the rows' first r columns, kept in latent space (the caller applies
W_uv). As in FlashMLA, a program owns all H heads (up to 32; more heads take more head blocks) of one request and one
split of its slots, so each row tile is read from memory once and serves both the scores of every head and, from
the same registers, the value sum: the cache's bytes are read once per step. Online softmax in exp2 with fp32
statistics; splits written to the workspace and merged as in kernels.flash_decode_splits.

Slots at or past kv_len (loaded from device memory) are never read; rows `allowed` excludes may hold anything, NaN
included. CUDA-graph safe: the grid and workspace depend on S_cap only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.kernels.flash_decode_splits import (
    LOG2E,
    NEG_INF,
    SplitPlan,
    int_table,
    interpreter_upcast,
    interpreting,
    kv_len_argument,
    mask_argument,
    merge_splits,
    online_softmax_tile,
    plan_splits,
    plan_workspace,
    pow2,
    split_slots,
    store_head_split,
    workspace_arguments,
)

# Sized by compiling for sm_90 here (benchmarks/flash_decode_resources.py; no GPU timing yet). At r = 512 a [32, 512]
# fp32 accumulator plus the [32, 512] queries fit 8 warps without spills (178 registers); a 64-head tile spills (at 8
# and at 16 warps), and so does software pipelining (num_stages=2 pushes the 32-head kernel past 255 registers).
# More heads take more head blocks.
MAX_BLOCK_H = 32
NUM_WARPS = 8
NUM_STAGES = 1
PROGRAMS_PER_SM = 1  # 178 registers x 256 threads: one program per sm_90 SM


@triton.jit(do_not_specialize=["s_cap"])
def _mla_split_kernel(
    q_ptr,
    rows_ptr,
    mask_ptr,
    kv_len_ptr,
    o_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    s_cap,
    heads,
    rank,
    rope_dim,
    chunk,
    qk_scale,
    s_qb,
    s_qh,
    s_rb,
    s_rs,
    s_mb,
    s_ob,
    s_oh,
    s_ab,
    s_ah,
    s_as,
    s_lb,
    s_lh,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    start, stop = split_slots(split, chunk, kv_len_ptr, s_cap, HAS_KV_LEN)

    hq = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hq < heads
    dr = tl.arange(0, BLOCK_R)
    dp = tl.arange(0, BLOCK_PE)
    r_in = dr < rank
    p_in = dp < rope_dim
    cols = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + b * s_qb + hq[:, None] * s_qh
    q_lat = tl.load(q_rows + dr[None, :], mask=h_ok[:, None] & r_in[None, :], other=0.0)
    q_pe = tl.load(q_rows + rank + dp[None, :], mask=h_ok[:, None] & p_in[None, :], other=0.0)
    if UPCAST:  # the CPU interpreter computes bf16 dots wrongly: widen tiles there, compiled kernels keep bf16
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    else:
        q_lat = q_lat.to(rows_ptr.dtype.element_ty)
        q_pe = q_pe.to(rows_ptr.dtype.element_ty)
    row_base = rows_ptr + b * s_rb
    m_i = tl.full([BLOCK_H], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + cols
        live = n < stop
        slot_ok = live & (tl.load(mask_ptr + b * s_mb + n, mask=live, other=0) != 0)
        # Loads masked by the live length only (no stall on the mask just loaded); a disallowed row may hold
        # anything (NaN): zeroed before it serves as keys and values, its score replaced.
        c = tl.load(row_base + n[:, None] * s_rs + dr[None, :], mask=live[:, None] & r_in[None, :], other=0.0)
        c = tl.where(slot_ok[:, None], c, 0.0)
        pe = tl.load(row_base + n[:, None] * s_rs + rank + dp[None, :], mask=live[:, None] & p_in[None, :], other=0.0)
        if UPCAST:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
        s = (tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(pe))) * qk_scale  # [H, N], log2 units
        m_i, l_i, acc = online_softmax_tile(s, slot_ok, c, m_i, l_i, acc)  # values: the same latent tile
    o_cols = hq[:, None] * s_oh + dr[None, :]
    store_head_split(
        acc, m_i, l_i, hq, h_ok, dr, r_in, b, split,
        acc_ptr, m_ptr, l_ptr, s_ab, s_ah, s_as, s_lb, s_lh, o_ptr, o_cols, s_ob, PARTIAL,
    )  # fmt: skip


def mla_tile(rank: int) -> int:
    """Row block height: a [BLOCK_N, r] latent tile of 32 KB in bf16 (r = 512: 32 rows), 16 to 64 rows;
    16 under the interpreter so tiny caches span several blocks."""
    if interpreting():
        return 16
    return max(16, min(64, 16384 // pow2(rank)))


def mla_plan(
    batch: int,
    heads: int,
    rank: int,
    rope_dim: int,
    s_cap: int,
    element_bytes: int,
    device: torch.device | str,
    splits: int | None = None,
) -> SplitPlan:
    block_h = min(MAX_BLOCK_H, pow2(heads))
    head_blocks = -(-heads // block_h)
    # A split's partial: block_h rows of r + 2 fp32, written and read back, against S_cap rows of r + d_r bf16
    # (MLA's partials are large: [32, 512] fp32 per split is what 28 rows of the cache weigh).
    share = 2 * min(heads, block_h) * (rank + 2) * 4 / max(1, s_cap * (rank + rope_dim) * element_bytes)
    return plan_splits((1,), batch * head_blocks, s_cap, mla_tile(rank), device, splits, PROGRAMS_PER_SM, share)


@functools.lru_cache(maxsize=64)
def _merge_tables(heads: int, rank: int, splits: int, device: str) -> tuple[torch.Tensor, ...]:
    return (
        int_table(tuple(h * rank for h in range(heads)), device),
        int_table((rank,) * heads, device),
        int_table((splits,) * heads, device),
    )


def mla_flash_decode(
    q_rows: torch.Tensor,
    rows: torch.Tensor,
    allowed: torch.Tensor,
    kv_len: torch.Tensor | None,
    scaling: float,
    rank: int,
    splits: int | None = None,
) -> torch.Tensor:
    """One absorbed-MLA decode step: q_rows [B, H, r + d_r], rows [B, S_cap, r + d_r] -> latent_out [B, H, r].

    Any batch / head / slot strides, unit last stride. allowed [B, S_cap] bool/int8 (unit last stride), kv_len:
    1-element int device tensor or None (= S_cap). The output is in q_rows' dtype. `splits`: splits of the slots
    (default: from the device's multiprocessor count, the batch and S_cap).
    """
    batch, heads, width = q_rows.shape
    s_cap = rows.shape[1]
    rope_dim = width - rank
    device = q_rows.device
    q_rows = q_rows if q_rows.stride(-1) == 1 else q_rows.contiguous()
    block_h = min(MAX_BLOCK_H, pow2(heads))
    head_blocks = -(-heads // block_h)
    plan = mla_plan(batch, heads, rank, rope_dim, s_cap, rows.element_size(), device, splits)
    output = torch.empty(batch, heads, rank, device=device, dtype=q_rows.dtype)
    block_r = pow2(rank)
    ws = plan_workspace(plan, batch, heads, block_r, device)
    partials, partial_strides = workspace_arguments(ws, output)
    mask = mask_argument(allowed)
    kv_len_t, has_kv_len = kv_len_argument(kv_len, mask)
    _mla_split_kernel[(head_blocks, plan.max_splits, batch)](
        q_rows,
        rows,
        mask,
        kv_len_t,
        output,
        *partials,
        s_cap,
        heads,
        rank,
        rope_dim,
        plan.chunks[0],
        scaling * LOG2E,
        q_rows.stride(0),
        q_rows.stride(1),
        rows.stride(0),
        rows.stride(1),
        mask.stride(0),
        output.stride(0),
        output.stride(1),
        *partial_strides,
        BLOCK_H=block_h,
        BLOCK_N=plan.block_n,
        BLOCK_R=block_r,
        BLOCK_PE=pow2(rope_dim),
        HAS_KV_LEN=has_kv_len,
        PARTIAL=plan.partial,
        UPCAST=interpreter_upcast(q_rows.dtype),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if ws:
        merge_splits(
            ws, output.view(batch, heads * rank), *_merge_tables(heads, rank, plan.max_splits, str(device)), rank
        )
    return output
