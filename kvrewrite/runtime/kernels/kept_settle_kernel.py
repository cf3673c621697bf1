"""One Triton kernel for an evicting layer's decode-step settle: the token leaving the window enters the kept tier.

After every decode forward the window's oldest token moves to the kept tier and, when the tier is over its budget,
the lowest-scored token leaves (runtime.tiers.eviction). In torch that is about seventy small operations a layer
(columns taken, centred and scaled, each head's block turned, min/max quantized per group, packed, the row chosen,
scattered) and two reads of device numbers by the host. Here a program owns one request and does all of it:

1. with EVICT, it finds the row to free: the lowest-scored token of the kept rows and the moving token, ties going
   to the newest (the moving token is the newest of all), as tiers.eviction's top mask ranks them;
2. it takes the moving token's kept columns from the window, centres and scales them by the layer's channel
   statistics and turns each head's block by its rotation (the code space of tiers.eviction._to_code_space), into a
   float32 scratch row;
3. per group of channels it quantizes that row (minimum, float16 scale floored at 1e-4, round half to even, as
   codecs.packing.quantize_minmax), packs the codes (lowest bits first, as codecs.packing.pack_bits) and writes the
   codes, scale, minimum and cache index into the freed row, or into the next row when nothing is evicted. When the
   moving token is itself the lowest, nothing is written.

Nothing returns to the host, so an eager step keeps launching while the device works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.kernels.flash_decode_splits import pow2

ROWS_BLOCK = 256  # kept rows read per iteration of the eviction scan


@triton.jit
def _round_half_even(v):
    """torch.round's rounding (half to even) of non-negative float32 values, without libdevice."""
    low = tl.floor(v)
    frac = v - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)


@triton.jit
def _evicted_row(scores_ptr, pos_ptr, b, n_old, moving_score, s_sb, s_pb, BLOCK: tl.constexpr):
    """The kept row the moving token replaces: the lowest score, the newest among equals; -1 when the moving token
    (the newest of all) scores no higher than every kept row."""
    best = tl.full([], float("inf"), tl.float32)
    best_pos = tl.full([], -1, tl.int64)
    best_row = tl.full([], -1, tl.int64)
    for n0 in range(0, n_old, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        live = n < n_old
        s = tl.load(scores_ptr + b * s_sb + n, mask=live, other=float("inf")).to(tl.float32)
        p = tl.load(pos_ptr + b * s_pb + n, mask=live, other=-1).to(tl.int64)
        low = tl.min(s, axis=0)
        newest = tl.max(tl.where(live & (s == low), p, -1), axis=0)
        row = tl.max(tl.where(live & (s == low) & (p == newest), n.to(tl.int64), -1), axis=0)
        better = (low < best) | ((low == best) & (newest > best_pos))
        best_row = tl.where(better, row, best_row)
        best_pos = tl.where(better, newest, best_pos)
        best = tl.where(better, low, best)
    return tl.where(moving_score <= best, -1, best_row)


@triton.jit
def _to_code_space(
    window_ptr, s_wb, cols_ptr, starts_ptr, ranks_ptr, mean_ptr, rms_ptr, s_mb, rot_ptr, s_rg, s_rr, row_ptr, b,
    N_HEADS: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """The moving token's kept columns of one side, (x - mean) / rms per channel, each head's block times its
    rotation, as float32 into row_ptr (the request's scratch row)."""
    dr = tl.arange(0, BLOCK_R)
    for g in range(N_HEADS):
        start = tl.load(starts_ptr + g)
        rank = tl.load(ranks_ptr + g)
        ok = dr < rank
        c = start + dr
        col = tl.load(cols_ptr + c, mask=ok, other=0)
        x = tl.load(window_ptr + b * s_wb + col, mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + b * s_mb + c, mask=ok, other=0.0).to(tl.float32)
        rms = tl.load(rms_ptr + b * s_mb + c, mask=ok, other=1.0).to(tl.float32)
        x = tl.where(ok, tl.div_rn(x - mean, rms), 0.0)  # IEEE division, as torch's (CUDA's `/` is approximate)
        rot = tl.load(rot_ptr + g * s_rg + dr[:, None] * s_rr + dr[None, :], mask=ok[:, None] & ok[None, :], other=0.0)
        tl.store(row_ptr + c, tl.sum(x[:, None] * rot, axis=0), mask=ok)


@triton.jit
def _quantize_into(
    row_ptr, channels, slot, codes_ptr, scale_ptr, low_ptr, b, s_cb, s_cs, s_gb, s_gs,
    N_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_GS: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Min/max quantization of the scratch row per group of channels, packed, written to row `slot` (none if < 0)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    write = slot >= 0
    at = tl.maximum(slot, 0)
    levels = (1 << BITS) - 1
    j = tl.arange(0, BLOCK_GS)
    n_bytes = (channels * BITS + 7) // 8
    for k in range(N_GROUPS):
        c = k * GROUP_SIZE + j
        ok = (j < GROUP_SIZE) & (c < channels)
        y = tl.load(row_ptr + c, mask=ok, other=0.0)
        lo = tl.min(tl.where(ok, y, float("inf")), axis=0)
        hi = tl.max(tl.where(ok, y, float("-inf")), axis=0)
        scale = tl.maximum(tl.div_rn(hi - lo, levels + 0.0), 1e-4).to(tl.float16)
        low = lo.to(tl.float16)
        code = _round_half_even(tl.div_rn(y - low.to(tl.float32), scale.to(tl.float32)))
        code = tl.where(ok, tl.minimum(tl.maximum(code, 0.0), levels), 0.0).to(tl.int32)
        shifts = tl.arange(0, PER_BYTE) * BITS
        packed = tl.sum(tl.reshape(code, [BLOCK_GS // PER_BYTE, PER_BYTE]) << shifts[None, :], axis=1)
        jb = tl.arange(0, BLOCK_GS // PER_BYTE)
        byte = k * (GROUP_SIZE // PER_BYTE) + jb
        # (the interpreter takes no scalar-and-vector mask: the slot's test is made per byte)
        byte_ok = (jb < GROUP_SIZE // PER_BYTE) & (byte < n_bytes) & ((jb * 0 + slot) >= 0)
        tl.store(codes_ptr + b * s_cb + at * s_cs + byte, packed.to(tl.uint8), mask=byte_ok)
        tl.store(scale_ptr + b * s_gb + at * s_gs + k, scale, mask=write)
        tl.store(low_ptr + b * s_gb + at * s_gs + k, low, mask=write)


@triton.jit
def _settle_kernel(
    key_window_ptr, value_window_ptr, s_kw, s_vw,
    key_cols_ptr, key_starts_ptr, key_ranks_ptr, value_cols_ptr, value_starts_ptr, value_ranks_ptr,
    key_mean_ptr, key_rms_ptr, value_mean_ptr, value_rms_ptr, s_km, s_vm,
    key_rot_ptr, s_krg, s_krr, value_rot_ptr, s_vrg, s_vrr,
    scratch_ptr, s_xb, key_channels, value_channels,
    scores_ptr, moving_ptr, s_sb, s_mb, pos_ptr, s_pb, n_old, position,
    k_codes_ptr, k_scale_ptr, k_low_ptr, s_kcb, s_kcs, s_kgb, s_kgs,
    v_codes_ptr, v_scale_ptr, v_low_ptr, s_vcb, s_vcs, s_vgb, s_vgs,
    EVICT: tl.constexpr, N_HEADS: tl.constexpr, BLOCK_RK: tl.constexpr, BLOCK_RV: tl.constexpr,
    GROUP_SIZE: tl.constexpr, BLOCK_GS: tl.constexpr, K_GROUPS: tl.constexpr, V_GROUPS: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    if EVICT:
        moving_score = tl.load(moving_ptr + b * s_mb).to(tl.float32)
        slot = _evicted_row(scores_ptr, pos_ptr, b, n_old, moving_score, s_sb, s_pb, ROWS)
    else:
        slot = n_old + tl.zeros([], tl.int64)  # room past the end: the caller grew the store by one row
    key_row = scratch_ptr + b * s_xb
    value_row = key_row + key_channels
    _to_code_space(
        key_window_ptr, s_kw, key_cols_ptr, key_starts_ptr, key_ranks_ptr, key_mean_ptr, key_rms_ptr, s_km,
        key_rot_ptr, s_krg, s_krr, key_row, b, N_HEADS, BLOCK_RK,
    )  # fmt: skip
    _to_code_space(
        value_window_ptr, s_vw, value_cols_ptr, value_starts_ptr, value_ranks_ptr, value_mean_ptr, value_rms_ptr,
        s_vm, value_rot_ptr, s_vrg, s_vrr, value_row, b, N_HEADS, BLOCK_RV,
    )  # fmt: skip
    tl.debug_barrier()  # the scratch row's channels were written by other threads than the groups read them
    _quantize_into(
        key_row, key_channels, slot, k_codes_ptr, k_scale_ptr, k_low_ptr, b, s_kcb, s_kcs, s_kgb, s_kgs,
        K_GROUPS, GROUP_SIZE, BLOCK_GS, K_BITS,
    )  # fmt: skip
    _quantize_into(
        value_row, value_channels, slot, v_codes_ptr, v_scale_ptr, v_low_ptr, b, s_vcb, s_vcs, s_vgb, s_vgs,
        V_GROUPS, GROUP_SIZE, BLOCK_GS, V_BITS,
    )  # fmt: skip
    position = (position + tl.zeros([], tl.int64)).to(pos_ptr.dtype.element_ty)
    tl.store(pos_ptr + b * s_pb + tl.maximum(slot, 0), position, mask=slot >= 0)


def stacked_rotations(rotations: dict[int, torch.Tensor], ranks: tuple[int, ...], device) -> torch.Tensor:
    """Each head's rotation (by its width) in one zero-padded float32 tensor [n_kv, R, R]."""
    width = max(ranks)
    out = torch.zeros(len(ranks), width, width, device=device)
    for g, r in enumerate(ranks):
        if r:
            out[g, :r, :r] = rotations[r].to(device)
    return out


@dataclass(frozen=True)
class SideTables:
    """One side's device tables for the settle kernel: the window's column of each kept channel, each head's first
    channel and width, and each head's rotation stacked [n_kv, R, R] (stacked_rotations)."""

    columns: torch.Tensor
    starts: torch.Tensor
    ranks: torch.Tensor
    rotations: torch.Tensor
    widths: tuple[int, ...]


def side_tables(columns: list[int], ranks: tuple[int, ...], rotations: dict[int, torch.Tensor], device) -> SideTables:
    starts = [sum(ranks[:g]) for g in range(len(ranks))]
    return SideTables(
        torch.tensor(columns, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(ranks, dtype=torch.int32, device=device),
        stacked_rotations(rotations, ranks, device),
        tuple(ranks),
    )


def settle_moving_token(
    key_window: torch.Tensor,
    value_window: torch.Tensor,
    tables: dict[str, SideTables],
    stats: dict[str, torch.Tensor],
    bits: dict[str, int],
    group_size: int,
    store: dict[str, torch.Tensor],
    n_old: int,
    position: int,
    scores: torch.Tensor | None = None,
    moving_score: torch.Tensor | None = None,
) -> None:
    """Code the moving token (the window's oldest row: key_window / value_window [B, n_kv * d]) into the kept
    store's row n_old (scores None: the store already has that row), or, given the kept rows' scores [B, n_old] and
    the moving token's [B], into the row of the token it evicts (nothing when it is the lowest itself).

    tables: per side, SideTables; stats: "key_mean", "key_rms", "value_mean", "value_rms" [B, C]; store: the flat
    kept store ("key.codes", "key.scale", "key.low", the value's, "positions"), written in place."""
    batch = key_window.shape[0]
    keys, values = tables["key"], tables["value"]
    k_channels, v_channels = sum(keys.widths), sum(values.widths)
    if len(keys.widths) != len(values.widths):
        raise ValueError("the key and value sides must have one rank per KV head each")
    scratch = torch.empty(batch, k_channels + v_channels, dtype=torch.float32, device=key_window.device)
    evict = scores is not None
    scores = scores if evict else scratch  # unread without EVICT
    moving_score = moving_score if evict else scratch[:, 0]
    positions = store["positions"]
    k_codes, k_scale, k_low = store["key.codes"], store["key.scale"], store["key.low"]
    v_codes, v_scale, v_low = store["value.codes"], store["value.scale"], store["value.low"]
    key_rot, value_rot = keys.rotations, values.rotations
    _settle_kernel[(batch,)](
        key_window, value_window, key_window.stride(0), value_window.stride(0),
        keys.columns, keys.starts, keys.ranks, values.columns, values.starts, values.ranks,
        stats["key_mean"], stats["key_rms"], stats["value_mean"], stats["value_rms"],
        stats["key_mean"].stride(0), stats["value_mean"].stride(0),
        key_rot, key_rot.stride(0), key_rot.stride(1), value_rot, value_rot.stride(0), value_rot.stride(1),
        scratch, scratch.stride(0), k_channels, v_channels,
        scores, moving_score, scores.stride(0), moving_score.stride(0), positions, positions.stride(0), n_old, position,
        k_codes, k_scale, k_low, k_codes.stride(0), k_codes.stride(1), k_scale.stride(0), k_scale.stride(1),
        v_codes, v_scale, v_low, v_codes.stride(0), v_codes.stride(1), v_scale.stride(0), v_scale.stride(1),
        EVICT=evict, N_HEADS=len(keys.widths), BLOCK_RK=pow2(max(keys.widths), 2),
        BLOCK_RV=pow2(max(values.widths), 2), GROUP_SIZE=group_size, BLOCK_GS=pow2(group_size, 8),
        K_GROUPS=-(-k_channels // group_size), V_GROUPS=-(-v_channels // group_size), K_BITS=bits["key"],
        V_BITS=bits["value"], ROWS=ROWS_BLOCK, num_warps=4,
    )  # fmt: skip
