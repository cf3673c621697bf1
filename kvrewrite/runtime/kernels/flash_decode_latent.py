"""Flash-decoding kernel for `latent` keys: every cached key rebuilt and rotated in registers, never in memory.

The cache holds pre-RoPE key latents [B, S_cap, Ksum] (KV head g's rk_g columns at its packed offset) and packed
values [B, S_cap, Vsum]; the key of slot n for head g is RoPE_n(latent_n @ k_up[g, :rk_g]) with HF's rotate_half
convention (k * cos_n + rotate_half(k) * sin_n). A program owns one (request, KV head, split): it holds the head's
two half-width up-projection tiles [rk, d / 2] and its G rotated queries for the whole walk, and per key block
loads the latent tile, rebuilds both halves of the keys with two tl.dot, rotates them with the slots' cos/sin and
scores them against the queries, then accumulates the value tile (online softmax, exp2, fp32 statistics). The
rebuilt keys exist only as a [BLOCK_N, d] register tile.

Splits, the merge, the live length read from device memory, the allowed-slot handling and the rank balance are the
packed kernel's (kernels.flash_decode_packed, kernels.flash_decode_splits): CUDA-graph safe, nothing by kv_len.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.kernels.flash_decode_heads import HeadTables, head_columns, head_tables, layout_plan
from kvrewrite.runtime.kernels.flash_decode_packed import column_tiles, tile_window
from kvrewrite.runtime.kernels.flash_decode_splits import (
    LOG2E,
    NEG_INF,
    SplitPlan,
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

NUM_STAGES = 3
# Compiled at Llama-3-8B shapes (rank 64, head_dim 128, 8 warps): 118 registers x 256 threads and 60 KB of shared
# memory (benchmarks/results/flash_decode_resources_sm90.json): two programs fit on an sm_90 SM.
PROGRAMS_PER_SM = 2


@triton.jit(do_not_specialize=["s_cap"])
def _latent_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    kv_len_ptr,
    tasks_ptr,
    up_ptr,
    cos_ptr,
    sin_ptr,
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
    half_d,
    qk_scale,
    s_qb,
    s_kb,
    s_ks,
    s_vb,
    s_vs,
    s_mb,
    s_ug,
    s_ur,
    s_cs,
    s_ss,
    s_ob,
    s_ab,
    s_ah,
    s_as,
    s_lb,
    s_lh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HALF: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
    K_ALIGN: tl.constexpr,
    V_ALIGN: tl.constexpr,
    K_WINDOW: tl.constexpr,
    V_WINDOW: tl.constexpr,
    SAME_HALVES: tl.constexpr,
):
    b, h, split = program_task(tasks_ptr)
    # Which latent / value columns a tile loads (aligned, or a window around the head: flash_decode_packed).
    k_first, k_shift, k_span, rk = tile_window(tl.load(k_off_ptr + h), tl.load(k_rank_ptr + h), K_ALIGN, K_WINDOW)
    v_first, v_shift, v_span, rv = tile_window(tl.load(v_off_ptr + h), tl.load(v_rank_ptr + h), V_ALIGN, V_WINDOW)
    start, stop = split_slots(split, tl.load(chunk_ptr + h), kv_len_ptr, s_cap, HAS_KV_LEN)

    member = tl.arange(0, BLOCK_G)
    row_ok = member < GROUP
    half = tl.arange(0, HALF)
    half_ok = half < half_d
    dr = tl.arange(0, BLOCK_R)
    dv = tl.arange(0, BLOCK_DV)
    cols = tl.arange(0, BLOCK_N)
    k_head = (dr >= k_shift) & (dr < k_shift + rk)  # the tile columns that are this head's latent columns
    v_head = (dv >= v_shift) & (dv < v_shift + rv)
    k_load = dr < k_span
    v_load = dv < v_span
    # The group's rotated queries, full head width, as two halves (rotate_half pairs dim j with j + d / 2).
    q_rows = q_ptr + b * s_qb + (h * GROUP + member)[:, None] * (2 * half_d) + half[None, :]
    q_ok = row_ok[:, None] & half_ok[None, :]
    q1 = tl.load(q_rows, mask=q_ok, other=0.0)
    q2 = tl.load(q_rows + half_d, mask=q_ok, other=0.0)
    # k_up[h, :rk] split the same way: the rebuild of both halves needs only these two tiles, held for the walk.
    # Row j of the tiles multiplies latent tile column j: the head's latent dim j - shift, zero elsewhere.
    up_rows = up_ptr + h * s_ug + (dr - k_shift)[:, None] * s_ur + half[None, :]
    up_ok = k_head[:, None] & half_ok[None, :]
    up1 = tl.load(up_rows, mask=up_ok, other=0.0)
    up2 = tl.load(up_rows + half_d, mask=up_ok, other=0.0)
    if UPCAST:  # the CPU interpreter computes bf16 dots wrongly: widen tiles there, compiled kernels keep bf16
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        up1 = up1.to(tl.float32)
        up2 = up2.to(tl.float32)
    else:
        up1 = up1.to(k_ptr.dtype.element_ty)
        up2 = up2.to(k_ptr.dtype.element_ty)
    k_base = k_ptr + b * s_kb + k_first
    v_base = v_ptr + b * s_vb + v_first
    m_i = tl.full([BLOCK_G], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + cols
        live = n < stop
        slot_ok = live & (tl.load(mask_ptr + b * s_mb + n, mask=live, other=0) != 0)
        # Loads masked by the live length only (as in the packed kernel); disallowed slots: scores replaced,
        # values zeroed.
        lat = tl.load(k_base + n[:, None] * s_ks + dr[None, :], mask=live[:, None] & k_load[None, :], other=0.0)
        v = tl.load(v_base + n[:, None] * s_vs + dv[None, :], mask=live[:, None] & v_load[None, :], other=0.0)
        if K_WINDOW:  # a neighbour's or the row padding's column may hold anything: the zero up rows' 0 * NaN
            lat = tl.where(k_head[None, :], lat, 0.0)
        v = tl.where(slot_ok[:, None], v, 0.0)
        if UPCAST:
            lat = lat.to(tl.float32)
            v = v.to(tl.float32)
        k1 = tl.dot(lat, up1)  # [N, HALF] fp32: the first half of the rebuilt pre-RoPE keys
        k2 = tl.dot(lat, up2)
        rope_ok = live[:, None] & half_ok[None, :]
        cos1 = tl.load(cos_ptr + n[:, None] * s_cs + half[None, :], mask=rope_ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + n[:, None] * s_ss + half[None, :], mask=rope_ok, other=0.0).to(tl.float32)
        if SAME_HALVES:  # HF's tables repeat the frequencies over both halves: half the cos/sin traffic
            cos2 = cos1
            sin2 = sin1
        else:
            cos2 = tl.load(cos_ptr + n[:, None] * s_cs + half_d + half[None, :], mask=rope_ok, other=0.0)
            sin2 = tl.load(sin_ptr + n[:, None] * s_ss + half_d + half[None, :], mask=rope_ok, other=0.0)
            cos2 = cos2.to(tl.float32)
            sin2 = sin2.to(tl.float32)
        r1 = k1 * cos1 - k2 * sin1  # rotate_half(k) = (-k2, k1)
        r2 = k2 * cos2 + k1 * sin2
        s = (tl.dot(q1, tl.trans(r1.to(q1.dtype))) + tl.dot(q2, tl.trans(r2.to(q2.dtype)))) * qk_scale
        m_i, l_i, acc = online_softmax_tile(s, slot_ok, v, m_i, l_i, acc)
    o_cols = tl.load(o_off_ptr + h) + member[:, None] * rv + (dv - v_shift)[None, :]
    store_head_split(
        acc, m_i, l_i, h * GROUP + member, row_ok, dv - v_shift, v_head, b, split,
        acc_ptr, m_ptr, l_ptr, s_ab, s_ah, s_as, s_lb, s_lh, o_ptr, o_cols, s_ob, PARTIAL,
    )  # fmt: skip


def latent_plan(
    layout: PackedLayout,
    head_dim: int,
    batch: int,
    s_cap: int,
    element_bytes: int,
    device: torch.device | str,
    splits: int | None = None,
) -> SplitPlan:
    # The block height follows the widest register tile, the rebuilt keys [BLOCK_N, head_dim].
    block_n = decode_tile(max(head_dim, max(layout.value_ranks)), element_bytes)
    return layout_plan(layout, batch, s_cap, block_n, element_bytes, device, splits, PROGRAMS_PER_SM)


@functools.lru_cache(maxsize=64)
def _tables(layout: PackedLayout, plan: SplitPlan, device: str) -> HeadTables:
    """The per-head rows in _latent_split_kernel's argument order: head_columns, chunks (no query offsets: the
    rotated queries are full head width)."""
    return head_tables(layout, plan, device, (*head_columns(layout), plan.chunks))


def latent_warps(block_r: int, half: int) -> int:
    """Two [rk, d / 2] up-projection tiles stay in registers for the walk: wide heads get more warps."""
    return 8 if block_r * half >= 64 * 64 else 4


def latent_flash_decode(
    query_rotated: torch.Tensor,
    key_latents: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    kv_len: torch.Tensor | None,
    scaling: float,
    layout: PackedLayout,
    k_up: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    splits: int | None = None,
    *,
    rope_halves_equal: bool = True,
) -> torch.Tensor:
    """One decode step over a latent-key cache: query_rotated [B, H * d] -> output [B, Osum] (packed value layout).

    key_latents [B, S_cap, Ksum] and values [B, S_cap, Vsum] (unit last stride), allowed [B, S_cap] bool/int8,
    kv_len: 1-element int device tensor or None (= S_cap), k_up [n_kv, d, d] (rows: latent dims), cos / sin
    [S_cap, d] of cache positions 0..S_cap-1 (unit last stride). `splits` as in packed_flash_decode.
    rope_halves_equal: the tables' two halves are equal, as HF's always are (emb = cat(freqs, freqs)): the kernel
    then reads only the first half of each row. False reads both.
    """
    batch, s_cap = key_latents.shape[0], key_latents.shape[1]
    head_dim = k_up.shape[-1]
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if max(layout.key_ranks, default=0) > k_up.shape[-2]:  # the kernel would read rows past each head's k_up
        raise ValueError(f"key ranks {layout.key_ranks} exceed k_up's {k_up.shape[-2]} latent rows")
    device = query_rotated.device
    g = layout.group_size
    query = query_rotated if query_rotated.stride(-1) == 1 else query_rotated.contiguous()
    k_up, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_up, cos, sin))
    plan = latent_plan(layout, head_dim, batch, s_cap, key_latents.element_size(), device, splits)
    tables = _tables(layout, plan, str(device))
    output = torch.empty(batch, layout.output_offsets[-1], device=device, dtype=query.dtype)
    tiles = column_tiles(layout, key_latents, values)
    block_r, half = tiles.block_k, pow2(head_dim // 2)
    ws = plan_workspace(plan, batch, len(layout.key_ranks) * g, tiles.block_v, device)
    partials, partial_strides = workspace_arguments(ws, output)
    mask = mask_argument(allowed)
    kv_len_t, has_kv_len = kv_len_argument(kv_len, mask)
    _latent_split_kernel[(tables.n_tasks, batch)](
        query,
        key_latents,
        values,
        mask,
        kv_len_t,
        tables.tasks,
        k_up,
        cos,
        sin,
        *tables.heads,
        output,
        *partials,
        s_cap,
        head_dim // 2,
        scaling * LOG2E,
        query.stride(0),
        key_latents.stride(0),
        key_latents.stride(1),
        values.stride(0),
        values.stride(1),
        mask.stride(0),
        k_up.stride(0),
        k_up.stride(1),
        cos.stride(-2),
        sin.stride(-2),
        output.stride(0),
        *partial_strides,
        GROUP=g,
        BLOCK_G=pow2(g),
        BLOCK_N=plan.block_n,
        BLOCK_R=block_r,
        BLOCK_DV=tiles.block_v,
        HALF=half,
        HAS_KV_LEN=has_kv_len,
        PARTIAL=plan.partial,
        UPCAST=interpreter_upcast(query.dtype),
        **tiles.constexprs,
        SAME_HALVES=rope_halves_equal,
        num_warps=latent_warps(block_r, half),
        num_stages=NUM_STAGES,
    )
    if ws:
        merge_splits(ws, output, *tables.merge, max(layout.value_ranks))
    return output
