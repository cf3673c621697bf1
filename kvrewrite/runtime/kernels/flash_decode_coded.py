"""Flash-decoding kernel for the KIVI codec caches (`int4`, `int2`): coded blocks dequantised in registers.

The decode-step counterpart of kernels.triton_coded_attention for a preallocated codec cache: the coded store holds
room for n_cap blocks of G tokens (codecs.readout.QuantizedBlocks: packed codes [B, n_cap, ceil(G * C * bits / 8)],
key scale / low [B, n_cap, C], value scale / low [B, n_cap, G, groups]) of which the first n_coded are live, and
the float16 window buffer [B, W_cap, C] holds window_len live tokens after them. Token positions (what `allowed`
[B, S_cap] is indexed by): coded block i holds positions i * G .. i * G + G - 1, window token w is at position
n_coded * G + w. n_coded and window_len are one-element device tensors the kernel loads, so a CUDA graph replays
correctly as the cache fills and codes blocks; nothing past them is read.

A program owns one (request, KV head, split of the coded blocks) with the G query heads of its group; the last
split of each head also walks the window. Per coded block it unpacks the head's codes, dequantises them (code *
scale + low in fp32), scores, and accumulates with an online softmax; partials merge as in
kernels.flash_decode_splits. Split counts per head follow rk + rv + 1 (ZACK §5.3).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.codecs.readout import QuantizedBlocks
from kvrewrite.runtime.kernels.flash_decode_heads import (
    HeadTables,
    head_columns,
    head_costs,
    head_tables,
    heaviest_head,
)
from kvrewrite.runtime.kernels.flash_decode_splits import (
    LOG2E,
    NEG_INF,
    SplitPlan,
    column_alignment,
    interpreter_upcast,
    interpreting,
    mask_argument,
    merge_splits,
    online_softmax_tile,
    plan_splits,
    plan_workspace,
    pow2,
    program_task,
    store_head_split,
    workspace_arguments,
)
from kvrewrite.runtime.kernels.reference import PackedLayout

NUM_WARPS = 4
NUM_STAGES = 2
PROGRAMS_PER_SM = 2  # 233 registers x 128 threads at Llama-3-8B int4 shapes (flash_decode_resources_sm90.json)
WINDOW_TILE = 16


@triton.jit
def unpack_codes(ptr, idx, ok, BITS: tl.constexpr):
    """Codes number idx of a packed row (8 // BITS per byte, lowest bits first) as float32."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(ptr + idx // PER, mask=ok, other=0).to(tl.int32)
    return ((byte >> ((idx % PER) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _code_tile(
    ptr, first, rank, dims, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, PAIRS: tl.constexpr
):
    """Codes [BLOCK_T, BLOCK_D] of one head in a coded block: row t holds codes first[t] + 0 .. first[t] + rank - 1.
    PAIRS (4 bits, every row starting on a byte): one byte load per column pair, split into its two nibbles;
    otherwise one (narrow) load per code. Columns >= rank are garbage: the caller masks them."""
    if PAIRS:
        pair = tl.arange(0, BLOCK_D // 2)
        byte = tl.load(ptr + first // 2 + pair[None, :], mask=(2 * pair < rank)[None, :], other=0).to(tl.int32)
        return tl.reshape(tl.join(byte & 15, byte >> 4), [BLOCK_T, BLOCK_D]).to(tl.float32)
    return unpack_codes(ptr, first + dims[None, :], (dims < rank)[None, :], BITS)


@triton.jit
def _online_step(m_i, l_i, acc, q, k, v, slot_ok, qk_scale, DOT: tl.constexpr):
    """Scores of the dequantised key tile k (log2 units), then the online softmax over the values v (zeroed where
    no slot is allowed, as the other kernels do)."""
    s = tl.dot(q, tl.trans(k.to(DOT))) * qk_scale
    v = tl.where(slot_ok[:, None], v, 0.0).to(DOT)
    return online_softmax_tile(s, slot_ok, v, m_i, l_i, acc)


@triton.jit(do_not_specialize=["n_cap", "w_cap"])
def _coded_split_kernel(
    q_ptr,
    mask_ptr,
    n_coded_ptr,
    window_len_ptr,
    tasks_ptr,
    kc_ptr,
    ks_ptr,
    kl_ptr,
    vc_ptr,
    vs_ptr,
    vl_ptr,
    kw_ptr,
    vw_ptr,
    q_off_ptr,
    k_off_ptr,
    v_off_ptr,
    o_off_ptr,
    k_rank_ptr,
    v_rank_ptr,
    chunk_ptr,
    n_split_ptr,
    o_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    n_cap,
    w_cap,
    key_channels,
    value_channels,
    qk_scale,
    s_qb,
    s_mb,
    s_kcb,
    s_kcn,
    s_ksb,
    s_ksn,
    s_vcb,
    s_vcn,
    s_vsb,
    s_vsn,
    s_vst,
    s_kwb,
    s_kwt,
    s_vwb,
    s_vwt,
    s_ob,
    s_ab,
    s_ah,
    s_as,
    s_lb,
    s_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BITS: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
    K_PAIRS: tl.constexpr,
    V_PAIRS: tl.constexpr,
    K_ALIGN: tl.constexpr,
    V_ALIGN: tl.constexpr,
):
    b, h, split = program_task(tasks_ptr)
    # Ranks and column offsets are multiples of K_ALIGN / V_ALIGN codes (the host checked): written so the compiler
    # knows it and issues wide loads of the packed codes.
    rk = tl.load(k_rank_ptr + h) // K_ALIGN * K_ALIGN
    rv = tl.load(v_rank_ptr + h) // V_ALIGN * V_ALIGN
    chunk = tl.load(chunk_ptr + h)  # coded blocks per split
    n_coded = n_cap
    window = w_cap
    if HAS_COUNTS:
        n_coded = tl.minimum(tl.load(n_coded_ptr).to(tl.int32), n_cap)
        window = tl.minimum(tl.load(window_len_ptr).to(tl.int32), w_cap)
    DOT: tl.constexpr = tl.float32 if UPCAST else q_ptr.dtype.element_ty

    member = tl.arange(0, BLOCK_G)
    row_ok = member < GROUP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    k_in = dk < rk
    v_in = dv < rv
    q_cols = tl.load(q_off_ptr + h) + member[:, None] * rk + dk[None, :]
    q = tl.load(q_ptr + b * s_qb + q_cols, mask=row_ok[:, None] & k_in[None, :], other=0.0).to(DOT)
    k_off = tl.load(k_off_ptr + h) // K_ALIGN * K_ALIGN
    v_off = tl.load(v_off_ptr + h) // V_ALIGN * V_ALIGN
    k_cols = k_off + dk
    v_cols = v_off + dv
    m_i = tl.full([BLOCK_G], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    tok = tl.arange(0, BLOCK_T)
    first = split * chunk
    for blk in range(first, tl.minimum(first + chunk, n_coded)):
        pos = blk * BLOCK_T + tok
        slot_ok = tl.load(mask_ptr + b * s_mb + pos) != 0
        # Keys: one (scale, min) per channel per block; codes token-major over the block's [G, C] grid.
        codes = _code_tile(
            kc_ptr + b * s_kcb + blk * s_kcn,
            tok[:, None] * key_channels + k_off,
            rk,
            dk,
            BLOCK_T,
            BLOCK_DK,
            BITS,
            K_PAIRS,
        )
        kmeta = b * s_ksb + blk * s_ksn + k_cols
        scale = tl.load(ks_ptr + kmeta, mask=k_in, other=0.0).to(tl.float32)
        low = tl.load(kl_ptr + kmeta, mask=k_in, other=0.0).to(tl.float32)
        k = tl.where(k_in[None, :], codes * scale[None, :] + low[None, :], 0.0)
        # Values: one (scale, min) per token per group of VALUE_GROUP packed channels.
        vcodes = _code_tile(
            vc_ptr + b * s_vcb + blk * s_vcn,
            tok[:, None] * value_channels + v_off,
            rv,
            dv,
            BLOCK_T,
            BLOCK_DV,
            BITS,
            V_PAIRS,
        )
        vmeta = b * s_vsb + blk * s_vsn + tok[:, None] * s_vst + (v_cols // VALUE_GROUP)[None, :]
        vscale = tl.load(vs_ptr + vmeta, mask=v_in[None, :], other=0.0).to(tl.float32)
        vlow = tl.load(vl_ptr + vmeta, mask=v_in[None, :], other=0.0).to(tl.float32)
        v = tl.where(v_in[None, :], vcodes * vscale + vlow, 0.0)
        m_i, l_i, acc = _online_step(m_i, l_i, acc, q, k, v, slot_ok, qk_scale, DOT)
    # The last split of the head also walks the float16 window (positions n_coded * G onwards).
    walks_window = split == tl.load(n_split_ptr + h) - 1
    wtok = tl.arange(0, BLOCK_W)
    for start in range(0, tl.where(walks_window, window, 0), BLOCK_W):
        w = start + wtok
        live = w < window
        slot_ok = live & (tl.load(mask_ptr + b * s_mb + n_coded * BLOCK_T + w, mask=live, other=0) != 0)
        k = tl.load(
            kw_ptr + b * s_kwb + w[:, None] * s_kwt + k_cols[None, :], mask=live[:, None] & k_in[None, :], other=0.0
        ).to(tl.float32)
        v = tl.load(
            vw_ptr + b * s_vwb + w[:, None] * s_vwt + v_cols[None, :], mask=live[:, None] & v_in[None, :], other=0.0
        ).to(tl.float32)
        m_i, l_i, acc = _online_step(m_i, l_i, acc, q, k, v, slot_ok, qk_scale, DOT)
    o_cols = tl.load(o_off_ptr + h) + member[:, None] * rv + dv[None, :]
    store_head_split(
        acc, m_i, l_i, h * GROUP + member, row_ok, dv, v_in, b, split,
        acc_ptr, m_ptr, l_ptr, s_ab, s_ah, s_as, s_lb, s_lh, o_ptr, o_cols, s_ob, PARTIAL,
    )  # fmt: skip


def _byte_pairs(bits: int, offsets: list[int]) -> bool:
    """4-bit codes whose every head offset and row width are even: each head's row of codes starts on a byte."""
    return bits == 4 and all(o % 2 == 0 for o in offsets)


def coded_plan(
    layout: PackedLayout,
    blocks: QuantizedBlocks,
    batch: int,
    n_cap: int,
    device: torch.device | str,
    splits: int | None = None,
) -> SplitPlan:
    """Splits of the coded blocks (a chunk is a whole number of blocks: plan_splits' key block is one coded block)."""
    g = blocks.block_tokens
    h = heaviest_head(layout)
    coded_bytes = max(1, n_cap * g * (layout.key_ranks[h] + layout.value_ranks[h]) * blocks.bits // 8)
    share = 2 * layout.group_size * (layout.value_ranks[h] + 2) * 4 / coded_bytes
    return plan_splits(head_costs(layout), batch, max(1, n_cap) * g, g, device, splits, PROGRAMS_PER_SM, share)


@functools.lru_cache(maxsize=64)
def _tables(layout: PackedLayout, plan: SplitPlan, device: str) -> HeadTables:
    """The per-head rows in _coded_split_kernel's argument order: query offsets, head_columns, coded blocks per
    split, split counts (the last split of a head walks the window)."""
    blocks_per_split = tuple(c // plan.block_n for c in plan.chunks)
    rows = (layout.query_offsets[:-1], *head_columns(layout), blocks_per_split, plan.splits)
    return head_tables(layout, plan, device, rows)


def supports_block_tokens(block_tokens: int) -> bool:
    """Whether this kernel reads blocks of this many tokens: whole key tiles, a power of two, at least 16 on a GPU."""
    return block_tokens & (block_tokens - 1) == 0 and (block_tokens >= 16 or interpreting())


def coded_flash_decode(
    query: torch.Tensor,
    blocks: QuantizedBlocks,
    keys: dict[str, torch.Tensor],
    values: dict[str, torch.Tensor],
    key_window: torch.Tensor,
    value_window: torch.Tensor,
    allowed: torch.Tensor,
    n_coded: torch.Tensor | None,
    window_len: torch.Tensor | None,
    scaling: float,
    layout: PackedLayout,
    splits: int | None = None,
) -> torch.Tensor:
    """One decode step over a preallocated KIVI cache: query [B, Qsum] -> output [B, Osum] in the query's dtype.

    keys / values: QuantizedBlocks stores with capacity n_cap on dim 1 ("codes", "scale", "low"; contiguous);
    key_window [B, W_cap, Ck] and value_window [B, W_cap, Cv] float16 (unit last stride); allowed [B, S_cap]
    bool/int8 by token position (S_cap >= n_coded * G + window_len); n_coded / window_len: 1-element int device
    tensors, or None for all n_cap blocks / all W_cap window tokens. `splits`: splits of the coded blocks that the
    heaviest head gets (default: from the device, the batch and n_cap).
    """
    g = blocks.block_tokens
    if not supports_block_tokens(g):
        raise ValueError(f"coded blocks of {g} tokens: the kernel needs a power of two >= 16 (one key tile)")
    batch, n_cap = keys["codes"].shape[:2]
    device = query.device
    group = layout.group_size
    query = query if query.stride(-1) == 1 else query.contiguous()
    plan = coded_plan(layout, blocks, batch, n_cap, device, splits)
    tables = _tables(layout, plan, str(device))
    output = torch.empty(batch, layout.output_offsets[-1], device=device, dtype=query.dtype)
    block_dv = pow2(max(layout.value_ranks))
    ws = plan_workspace(plan, batch, len(layout.key_ranks) * group, block_dv, device)
    partials, partial_strides = workspace_arguments(ws, output)
    mask = mask_argument(allowed)
    has_counts = n_coded is not None
    if has_counts != (window_len is not None):
        raise ValueError("give both n_coded and window_len as device tensors, or neither")
    counts = (n_coded.reshape(1), window_len.reshape(1)) if has_counts else (mask, mask)
    kc, ks, kl = (keys[n] for n in ("codes", "scale", "low"))
    vc, vs, vl = (values[n] for n in ("codes", "scale", "low"))
    _coded_split_kernel[(tables.n_tasks, batch)](
        query,
        mask,
        *counts,
        tables.tasks,
        kc,
        ks,
        kl,
        vc,
        vs,
        vl,
        key_window,
        value_window,
        *tables.heads,
        output,
        *partials,
        n_cap,
        key_window.shape[1],
        key_window.shape[-1],
        value_window.shape[-1],
        scaling * LOG2E,
        query.stride(0),
        mask.stride(0),
        kc.stride(0),
        kc.stride(1),
        ks.stride(0),
        ks.stride(1),
        vc.stride(0),
        vc.stride(1),
        vs.stride(0),
        vs.stride(1),
        vs.stride(2),
        key_window.stride(0),
        key_window.stride(1),
        value_window.stride(0),
        value_window.stride(1),
        output.stride(0),
        *partial_strides,
        GROUP=group,
        BLOCK_G=pow2(group),
        BLOCK_T=g,
        BLOCK_W=WINDOW_TILE,
        BLOCK_DK=pow2(max(layout.key_ranks)),
        BLOCK_DV=block_dv,
        BITS=blocks.bits,
        VALUE_GROUP=blocks.value_group,
        HAS_COUNTS=has_counts,
        PARTIAL=plan.partial,
        UPCAST=interpreter_upcast(query.dtype),
        K_PAIRS=_byte_pairs(blocks.bits, layout.key_offsets),
        V_PAIRS=_byte_pairs(blocks.bits, layout.value_offsets),
        K_ALIGN=column_alignment(layout.key_offsets, blocks.bits / 8),
        V_ALIGN=column_alignment(layout.value_offsets, blocks.bits / 8),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if ws:
        merge_splits(ws, output, *tables.merge, max(layout.value_ranks))
    return output
