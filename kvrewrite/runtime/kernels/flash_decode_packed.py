"""Flash-decoding kernel for the packed variable-rank cache (freq, post-rope, folded keys): one query token.

Reads what the cache holds, in place: keys [B, S_cap, Ksum] and values [B, S_cap, Vsum] (any batch and slot
strides, unit column stride: views of the [B, 1, S_cap, C] preallocated buffers), KV head g's columns at its packed
offset (kernels.reference.PackedLayout). A program owns one (request, KV head, split): it loads the G query heads of
the group once, walks its split's key blocks with an online softmax (exp2, fp32 statistics) and writes either the
normalised output (a plan with one split everywhere) or its partial to the workspace that
kernels.flash_decode_splits.merge_splits reduces.

Slots at or past the live length kv_len (loaded from device memory, so a CUDA graph replays correctly as the cache
fills) are never read; slots `allowed` excludes (left padding, unfilled slots) are read but may hold anything, NaN
included: their scores are replaced and their values zeroed before use.
Heads of different ranks get split counts proportional to rk + rv + 1 (ZACK §5.3 balance) and the (head, split)
programs launch heaviest first. Nothing here syncs with the host or allocates by kv_len: CUDA-graph safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.kernels.flash_decode_heads import (
    HeadTables,
    head_columns,
    head_tables,
    layout_plan,
)
from kvrewrite.runtime.kernels.flash_decode_splits import (
    LOG2E,
    NEG_INF,
    SplitPlan,
    column_alignment,
    decode_tile,
    interpreter_upcast,
    kv_len_argument,
    mask_argument,
    merge_splits,
    online_softmax_tile,
    plan_workspace,
    pow2,
    program_task,
    split_slots,
    store_head_split,
    workspace_arguments,
)
from kvrewrite.runtime.kernels.reference import PackedLayout

NUM_WARPS = 4
NUM_STAGES = 3  # key/value tiles in flight per program (software pipelining of the block loop)
# Programs resident per multiprocessor: at Llama-3-8B shapes the compiled kernel takes 107 registers x 128 threads
# and 44 KB of shared memory (benchmarks/results/flash_decode_resources_sm90.json), so four fit on an sm_90 SM.
PROGRAMS_PER_SM = 4


@triton.jit
def tile_window(offset, rank, ALIGN: tl.constexpr, WINDOW: tl.constexpr):
    """Which columns of a row a head's tile loads: (first column, the head's shift into the tile, tile span, rank),
    written so the compiler can prove them ALIGN-aligned (16-byte loads).

    Aligned layouts: every rank and offset is a multiple of ALIGN (the host checked): the tile is the head's
    columns. Window mode (unaligned offsets, rows padded to a multiple of ALIGN): the tile starts at the aligned
    column at or before the head's first and spans whole aligned groups; the head sits `shift` columns into it and
    the caller neutralises the neighbours' columns it also loads."""
    if WINDOW:
        first = offset // ALIGN * ALIGN
        shift = offset - first
        span = (shift + rank + ALIGN - 1) // ALIGN * ALIGN
    else:
        rank = rank // ALIGN * ALIGN
        first = offset // ALIGN * ALIGN
        shift = offset * 0
        span = rank
    return first, shift, span, rank


@triton.jit(do_not_specialize=["s_cap"])  # s_cap == 1 would turn into a constexpr
def _packed_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    kv_len_ptr,
    tasks_ptr,
    q_off_ptr,
    k_off_ptr,
    v_off_ptr,
    o_off_ptr,
    k_rank_ptr,
    v_rank_ptr,
    chunk_ptr,
    o_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    s_cap,
    qk_scale,
    s_qb,
    s_kb,
    s_ks,
    s_vb,
    s_vs,
    s_mb,
    s_ob,
    s_ab,
    s_ah,
    s_as,
    s_lb,
    s_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
    K_ALIGN: tl.constexpr,
    V_ALIGN: tl.constexpr,
    K_WINDOW: tl.constexpr,
    V_WINDOW: tl.constexpr,
):
    b, h, split = program_task(tasks_ptr)
    start, stop = split_slots(split, tl.load(chunk_ptr + h), kv_len_ptr, s_cap, HAS_KV_LEN)
    k_first, k_shift, k_span, rk = tile_window(tl.load(k_off_ptr + h), tl.load(k_rank_ptr + h), K_ALIGN, K_WINDOW)
    v_first, v_shift, v_span, rv = tile_window(tl.load(v_off_ptr + h), tl.load(v_rank_ptr + h), V_ALIGN, V_WINDOW)

    member = tl.arange(0, BLOCK_G)
    row_ok = member < GROUP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    cols = tl.arange(0, BLOCK_N)
    k_head = (dk >= k_shift) & (dk < k_shift + rk)  # the tile columns that are this head's key columns
    v_head = (dv >= v_shift) & (dv < v_shift + rv)
    k_load = dk < k_span
    v_load = dv < v_span
    q_cols = tl.load(q_off_ptr + h) + member[:, None] * rk + (dk - k_shift)[None, :]
    q = tl.load(q_ptr + b * s_qb + q_cols, mask=row_ok[:, None] & k_head[None, :], other=0.0)
    if UPCAST:  # the CPU interpreter computes bf16 dots wrongly: widen tiles there, compiled kernels keep bf16
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)
    k_base = k_ptr + b * s_kb + k_first
    v_base = v_ptr + b * s_vb + v_first
    m_i = tl.full([BLOCK_G], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + cols
        live = n < stop
        slot_ok = live & (tl.load(mask_ptr + b * s_mb + n, mask=live, other=0) != 0)
        # K/V loads depend on the live length only, not on the mask just loaded (nothing stalls the pipelined
        # loads on it); a disallowed slot may hold anything (NaN): its score is replaced and its value zeroed.
        k = tl.load(k_base + n[:, None] * s_ks + dk[None, :], mask=live[:, None] & k_load[None, :], other=0.0)
        v = tl.load(v_base + n[:, None] * s_vs + dv[None, :], mask=live[:, None] & v_load[None, :], other=0.0)
        if K_WINDOW:  # a neighbour's or the row padding's column may hold anything: q's 0 * NaN would leak
            k = tl.where(k_head[None, :], k, 0.0)
        v = tl.where(slot_ok[:, None], v, 0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [G, N], log2 units
        m_i, l_i, acc = online_softmax_tile(s, slot_ok, v, m_i, l_i, acc)
    o_cols = tl.load(o_off_ptr + h) + member[:, None] * rv + (dv - v_shift)[None, :]
    store_head_split(
        acc, m_i, l_i, h * GROUP + member, row_ok, dv - v_shift, v_head, b, split,
        acc_ptr, m_ptr, l_ptr, s_ab, s_ah, s_as, s_lb, s_lh, o_ptr, o_cols, s_ob, PARTIAL,
    )  # fmt: skip


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tile_columns(offsets: list[int], rows: torch.Tensor) -> tuple[int, bool, int]:
    """How the kernel loads one head's columns of `rows` [B, S_cap, C]: (alignment, window mode, tile width).

    Layouts whose offsets are all multiples of 16 bytes' worth of columns load each head's own columns. Others
    (most allocated rank mixes) use window mode when the rows are padded to such a multiple (a row stride that
    is one, and the last row's padding inside the tensor's storage): each tile then spans whole aligned groups
    around the head, so its loads are 16 bytes wide. Otherwise the loads narrow to the offsets' alignment."""
    element = rows.element_size()
    vec = max(1, 16 // element)
    ranks = [b - a for a, b in zip(offsets, offsets[1:])]
    align = column_alignment(offsets, element)
    if align < vec and rows.stride(1) % vec == 0 and rows.stride(1) >= _round_up(offsets[-1], vec):
        batch, s_cap = rows.shape[0], rows.shape[1]
        last = rows.storage_offset() + (batch - 1) * rows.stride(0) + (s_cap - 1) * rows.stride(1)
        if (last + _round_up(offsets[-1], vec)) * element <= rows.untyped_storage().nbytes():
            spans = [_round_up(o % vec + r, vec) for o, r in zip(offsets, ranks)]
            return vec, True, pow2(max(spans))
    return align, False, pow2(max(ranks))


@dataclass(frozen=True)
class ColumnTiles:
    """tile_columns for the key and the value columns: the tile widths and the K_/V_ALIGN, K_/V_WINDOW constexprs
    of the kernels that load through tile_window (packed, latent)."""

    block_k: int
    block_v: int
    constexprs: dict[str, int | bool]


def column_tiles(layout: PackedLayout, keys: torch.Tensor, values: torch.Tensor) -> ColumnTiles:
    k_align, k_window, block_k = tile_columns(layout.key_offsets, keys)
    v_align, v_window, block_v = tile_columns(layout.value_offsets, values)
    return ColumnTiles(block_k, block_v, dict(K_ALIGN=k_align, V_ALIGN=v_align, K_WINDOW=k_window, V_WINDOW=v_window))


def packed_plan(
    layout: PackedLayout,
    batch: int,
    s_cap: int,
    element_bytes: int,
    device: torch.device | str,
    splits: int | None = None,
) -> SplitPlan:
    block_n = decode_tile(max(max(layout.key_ranks), max(layout.value_ranks)), element_bytes)
    return layout_plan(layout, batch, s_cap, block_n, element_bytes, device, splits, PROGRAMS_PER_SM)


@functools.lru_cache(maxsize=64)
def _tables(layout: PackedLayout, plan: SplitPlan, device: str) -> HeadTables:
    """The per-head rows in _packed_split_kernel's argument order: query offsets, head_columns, chunks."""
    return head_tables(layout, plan, device, (layout.query_offsets[:-1], *head_columns(layout), plan.chunks))


def packed_flash_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    kv_len: torch.Tensor | None,
    scaling: float,
    layout: PackedLayout,
    splits: int | None = None,
) -> torch.Tensor:
    """One decode step over the packed cache: query [B, Qsum] -> output [B, Osum] in the query's dtype.

    keys [B, S_cap, Ksum], values [B, S_cap, Vsum] (unit last stride), allowed [B, S_cap] bool/int8 (unit last
    stride), kv_len: 1-element int device tensor (slots >= it are never read) or None (= S_cap). `splits`: how many
    splits the heaviest head gets (default: from the device's multiprocessor count, the batch and S_cap).
    """
    batch, s_cap = keys.shape[0], keys.shape[1]
    device = query.device
    g = layout.group_size
    query = query if query.stride(-1) == 1 else query.contiguous()
    plan = packed_plan(layout, batch, s_cap, keys.element_size(), device, splits)
    tables = _tables(layout, plan, str(device))
    output = torch.empty(batch, layout.output_offsets[-1], device=device, dtype=query.dtype)
    tiles = column_tiles(layout, keys, values)
    ws = plan_workspace(plan, batch, len(layout.key_ranks) * g, tiles.block_v, device)
    partials, partial_strides = workspace_arguments(ws, output)
    mask = mask_argument(allowed)
    kv_len_t, has_kv_len = kv_len_argument(kv_len, mask)
    _packed_split_kernel[(tables.n_tasks, batch)](
        query,
        keys,
        values,
        mask,
        kv_len_t,
        tables.tasks,
        *tables.heads,
        output,
        *partials,
        s_cap,
        scaling * LOG2E,
        query.stride(0),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        mask.stride(0),
        output.stride(0),
        *partial_strides,
        GROUP=g,
        BLOCK_G=pow2(g),
        BLOCK_N=plan.block_n,
        BLOCK_DK=tiles.block_k,
        BLOCK_DV=tiles.block_v,
        HAS_KV_LEN=has_kv_len,
        PARTIAL=plan.partial,
        UPCAST=interpreter_upcast(query.dtype),
        **tiles.constexprs,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if ws:
        merge_splits(ws, output, *tables.merge, max(layout.value_ranks))
    return output
