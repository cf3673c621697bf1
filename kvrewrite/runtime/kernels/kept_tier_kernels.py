"""Triton decode kernels for the eviction policy's kept tier: per-token codes read once, dequantised in registers.

The kept tier (runtime.tiers.eviction) holds each kept token's latents as packed codes with a float16 scale and
minimum per group of channels, in a turned and scaled code space, rows in no order with each row's cache index.
A decode step needs, besides the output, the attention every kept token received (the policy re-scores its tokens
after every forward), so the step runs in two passes over the store, each reading one side's codes once:

- `kept_key_logits`: a program owns one (request, KV head, chunk of rows). It holds the head's up-projection with
  the code space's map folded in ([r, d] as two halves, plus the map's offset through it) and the group's rotated
  queries, and per block of rows dequantises the codes (code x scale + minimum), rebuilds the pre-RoPE keys with two
  tl.dot, rotates them at the rows' cache positions (HF's rotate_half, the tables' first half) and writes the
  group's scaled logits [B, H, S], with the chunk's softmax statistics over the allowed rows (max, sum of exp).
  Keys exist only as a register tile.
- the caller joins the chunks' statistics with the recent window's logits into the log of the softmax's
  denominator per head, lse [B, H] (a few numbers per request);
- `kept_weighted_values`: a program owns one (request, KV head, chunk), turns the logits into probabilities
  exp(logit - lse) in registers, writes the evidence of its query heads per row, and sums probabilities times the
  dequantised value codes into a partial [B, H, chunks, r]; the caller adds the chunks and maps the sum back.

Beyond the codes, a kept token costs a float32 logit per query head, written once and read once. Chunks of
ROWS_PER_PROGRAM rows keep each program's up-projection load small against the codes it reads, and leave enough
programs for one request at long contexts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.kernels.flash_decode_coded import unpack_codes
from kvrewrite.runtime.kernels.flash_decode_splits import (
    NEG_INF,
    int_table,
    interpreter_upcast,
    interpreting,
    mask_argument,
    pow2,
)

ROWS_PER_PROGRAM = 1024
# 32 rows a block, 8 warps, two stages: at the frontier recipe's Llama-3-8B form (full rank 128, 8-bit keys, 4-bit
# values) the two kernels compile for sm_90 with 209 / 183 registers and no spills under triton 3.6, 139 / 113 under
# 3.9; at 64 rows the logits kernel spills under both (benchmarks/results/flash_decode_resources_sm90*.json).
BLOCK_ROWS = 32
NUM_WARPS = 8
NUM_STAGES = 2
DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _dequantised_tile(
    codes_ptr, scale_ptr, low_ptr, b, n, live, col0, rank,
    s_cb, s_cs, s_gb, s_gs,
    BLOCK_R: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
):  # fmt: skip
    """Rows n of one head's codes (columns col0 .. col0 + rank - 1 of the packed rows) as float32 latents
    [BLOCK_N, BLOCK_R]: code x scale + minimum of the column's group; zero outside the live rows and the rank."""
    dr = tl.arange(0, BLOCK_R)
    ok = live[:, None] & (dr < rank)[None, :]
    col = col0 + dr
    codes = unpack_codes(codes_ptr + b * s_cb + n[:, None] * s_cs, col[None, :], ok, BITS)
    meta = b * s_gb + n[:, None] * s_gs + (col // GROUP_SIZE)[None, :]
    scale = tl.load(scale_ptr + meta, mask=ok, other=0.0).to(tl.float32)
    low = tl.load(low_ptr + meta, mask=ok, other=0.0).to(tl.float32)
    return tl.where(ok, codes * scale + low, 0.0)


@triton.jit
def _program_rows(col_ptr, rank_ptr, n_rows, rows_per_program):
    """This program's request b, KV head g and chunk of rows [start, stop), and the head's first column and rank in
    the packed store (grid: requests, KV heads, chunks)."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    chunk = tl.program_id(2)
    start = chunk * rows_per_program
    stop = tl.minimum(start + rows_per_program, n_rows)
    return b, g, chunk, start, stop, tl.load(col_ptr + g), tl.load(rank_ptr + g)


@triton.jit
def _kept_logits_kernel(
    q_ptr, codes_ptr, scale_ptr, low_ptr, pos_ptr, mask_ptr, up_ptr, shift_ptr, cos_ptr, sin_ptr, col_ptr, rank_ptr,
    out_ptr, m_ptr, l_ptr,
    n_rows, rows_per_program, half_d, qk_scale,
    s_qb, s_cb, s_cs, s_gb, s_gs, s_pb, s_mb, s_ub, s_ug, s_ur, s_hb, s_hg, s_cos, s_sin, s_ob, s_oh, s_lb, s_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b, g, chunk, start, stop, col0, rank = _program_rows(col_ptr, rank_ptr, n_rows, rows_per_program)
    member = tl.arange(0, BLOCK_G)
    row_ok = member < GROUP
    half = tl.arange(0, HALF)
    half_ok = half < half_d
    dr = tl.arange(0, BLOCK_R)
    heads = g * GROUP + member
    # The group's rotated queries and the head's folded up-projection, both as their two rotate_half halves.
    q_rows = q_ptr + b * s_qb + heads[:, None] * (2 * half_d) + half[None, :]
    q_ok = row_ok[:, None] & half_ok[None, :]
    q1 = tl.load(q_rows, mask=q_ok, other=0.0)
    q2 = tl.load(q_rows + half_d, mask=q_ok, other=0.0)
    up_rows = up_ptr + b * s_ub + g * s_ug + dr[:, None] * s_ur + half[None, :]
    up_ok = (dr < rank)[:, None] & half_ok[None, :]
    up1 = tl.load(up_rows, mask=up_ok, other=0.0)
    up2 = tl.load(up_rows + half_d, mask=up_ok, other=0.0)
    shift1 = tl.load(shift_ptr + b * s_hb + g * s_hg + half, mask=half_ok, other=0.0).to(tl.float32)
    shift2 = tl.load(shift_ptr + b * s_hb + g * s_hg + half_d + half, mask=half_ok, other=0.0).to(tl.float32)
    if UPCAST:  # the CPU interpreter computes narrow dots wrongly: widen there, compiled kernels keep the dtype
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        up1 = up1.to(tl.float32)
        up2 = up2.to(tl.float32)
    m_i = tl.full([BLOCK_G], NEG_INF, tl.float32)  # this chunk's running max and sum of exp per head
    l_i = tl.zeros([BLOCK_G], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < stop
        y = _dequantised_tile(
            codes_ptr, scale_ptr, low_ptr, b, n, live, col0, rank, s_cb, s_cs, s_gb, s_gs, BLOCK_R, BITS, GROUP_SIZE
        )
        k1 = tl.dot(y.to(up1.dtype), up1) + shift1[None, :]  # [N, HALF] fp32: first half of the pre-RoPE keys
        k2 = tl.dot(y.to(up2.dtype), up2) + shift2[None, :]
        position = tl.load(pos_ptr + b * s_pb + n, mask=live, other=0).to(tl.int64)
        rope_ok = live[:, None] & half_ok[None, :]
        # HF's tables repeat each pair's angle in both halves: the first half serves both.
        cos = tl.load(cos_ptr + position[:, None] * s_cos + half[None, :], mask=rope_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + position[:, None] * s_sin + half[None, :], mask=rope_ok, other=0.0).to(tl.float32)
        r1 = k1 * cos - k2 * sin  # rotate_half(k) = (-k2, k1)
        r2 = k2 * cos + k1 * sin
        s = (tl.dot(q1, tl.trans(r1.to(q1.dtype))) + tl.dot(q2, tl.trans(r2.to(q2.dtype)))) * qk_scale
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + n[None, :], s, mask=row_ok[:, None] & live[None, :])
        # The softmax statistics over the allowed rows (a left-padded request's pads are kept rows too).
        allowed = live & (tl.load(mask_ptr + b * s_mb + position, mask=live, other=0) != 0)
        s = tl.where(allowed[None, :], s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        rescale = tl.where(m_new == NEG_INF, 0.0, tl.exp(m_i - m_new))
        p = tl.where(allowed[None, :], tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * rescale + tl.sum(p, axis=1)
        m_i = m_new
    stats = b * s_lb + heads * s_lh + chunk
    tl.store(m_ptr + stats, m_i, mask=row_ok)
    tl.store(l_ptr + stats, l_i, mask=row_ok)


@triton.jit
def _kept_value_kernel(
    logits_ptr, lse_ptr, pos_ptr, mask_ptr, weight_ptr, codes_ptr, scale_ptr, low_ptr, col_ptr, rank_ptr,
    out_ptr, evidence_ptr,
    n_rows, rows_per_program,
    s_pb, s_ph, s_eb, s_xb, s_mb, s_wb, s_cb, s_cs, s_gb, s_gs, s_ob, s_oh, s_oc, s_vb, s_vg,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, EVIDENCE_MAX: tl.constexpr,
):  # fmt: skip
    b, g, chunk, start, stop, col0, rank = _program_rows(col_ptr, rank_ptr, n_rows, rows_per_program)
    member = tl.arange(0, BLOCK_G)
    row_ok = member < GROUP
    heads = g * GROUP + member
    dr = tl.arange(0, BLOCK_R)
    lse = tl.load(lse_ptr + b * s_eb + heads, mask=row_ok, other=0.0)
    weight = tl.load(weight_ptr + b * s_wb)  # the query's weight in the evidence (0: a row that reads no key)
    acc = tl.zeros([BLOCK_G, BLOCK_R], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < stop
        position = tl.load(pos_ptr + b * s_xb + n, mask=live, other=0).to(tl.int64)
        allowed = live & (tl.load(mask_ptr + b * s_mb + position, mask=live, other=0) != 0)
        ok = row_ok[:, None] & allowed[None, :]
        s = tl.load(logits_ptr + b * s_pb + heads[:, None] * s_ph + n[None, :], mask=ok, other=0.0)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)  # the probabilities of one softmax over kept and window
        if EVIDENCE_MAX:
            evidence = tl.max(p, axis=0) * weight
        else:
            evidence = tl.sum(p, axis=0) * weight
        tl.store(evidence_ptr + b * s_vb + g * s_vg + n, evidence, mask=live)
        y = _dequantised_tile(
            codes_ptr, scale_ptr, low_ptr, b, n, live, col0, rank, s_cb, s_cs, s_gb, s_gs, BLOCK_R, BITS, GROUP_SIZE
        )
        # Probabilities times values in the model's dtype, as the torch path multiplies them (float32 under the
        # interpreter, whose narrow dots are wrong).
        acc += tl.dot(p.to(DOT_DTYPE), y.to(DOT_DTYPE))
    out = out_ptr + b * s_ob + heads[:, None] * s_oh + chunk * s_oc + dr[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & (dr < rank)[None, :])


def _block_rows() -> int:
    return 16 if interpreting() else BLOCK_ROWS


def _head_columns(ranks: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each KV head's first column in the packed store and its width, as device tables (int_table: made once)."""
    starts = tuple(sum(ranks[:g]) for g in range(len(ranks)))
    return int_table(starts, str(device)), int_table(tuple(ranks), str(device))


def kept_key_logits(
    queries: torch.Tensor,
    coded: dict[str, torch.Tensor],
    positions: torch.Tensor,
    allowed: torch.Tensor,
    ranks: tuple[int, ...],
    bits: int,
    group_size: int,
    up: torch.Tensor,
    shift: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled logits [B, H, S] of the rotated decode queries [B, H, d] against the kept tier's keys, and per head
    and chunk of rows the softmax statistics of the allowed ones: max and sum of exp(logit - max), [B, H, chunks]
    (max -inf and sum 0 where a chunk has none).

    coded: the key store {"codes" [B, S, bytes] uint8, "scale", "low" [B, S, groups]} (unit last stride);
    positions [B, S] cache indices; allowed [B, >= positions] bool / int8 by cache index; ranks: each KV head's
    columns in the store (packed in order); up [B, n_kv, R, d]: each head's up-projection with the code space's map
    folded in (rows: code dims; R >= max rank), shift [B, n_kv, d]: the map's offset through it; cos / sin
    [>= positions, d] (HF's tables, halves equal)."""
    batch, heads, head_dim = queries.shape
    n_kv, n_rows = len(ranks), positions.shape[-1]
    logits = torch.empty(batch, heads, n_rows, dtype=torch.float32, device=queries.device)
    if n_rows == 0:
        empty = torch.full((batch, heads, 1), float("-inf"), dtype=torch.float32, device=queries.device)
        return logits, empty, torch.zeros_like(empty)
    chunks = -(-n_rows // ROWS_PER_PROGRAM)  # ceil; triton.cdiv costs microseconds a call on the host
    # Every program writes its chunk's statistics: nothing to fill first.
    maxima = torch.empty(batch, heads, chunks, dtype=torch.float32, device=queries.device)
    sums = torch.empty_like(maxima)
    columns, widths = _head_columns(ranks, queries.device)
    queries, up, shift = queries.contiguous(), up.contiguous(), shift.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    mask = mask_argument(allowed)
    codes, scale, low = coded["codes"], coded["scale"], coded["low"]
    group = heads // n_kv
    _kept_logits_kernel[(batch, n_kv, chunks)](
        queries, codes, scale, low, positions, mask, up, shift, cos, sin, columns, widths, logits, maxima, sums,
        n_rows, ROWS_PER_PROGRAM, head_dim // 2, scaling,
        queries.stride(0), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1), positions.stride(0),
        mask.stride(0), up.stride(0), up.stride(1), up.stride(2), shift.stride(0), shift.stride(1), cos.stride(0),
        sin.stride(0), logits.stride(0), logits.stride(1), maxima.stride(0), maxima.stride(1),
        GROUP=group, BLOCK_G=pow2(group), BLOCK_N=_block_rows(), BLOCK_R=pow2(max(ranks)), HALF=pow2(head_dim // 2),
        BITS=bits, GROUP_SIZE=group_size, UPCAST=interpreter_upcast(queries.dtype), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    return logits, maxima, sums


def kept_weighted_values(
    logits: torch.Tensor,
    lse: torch.Tensor,
    positions: torch.Tensor,
    allowed: torch.Tensor,
    weights: torch.Tensor,
    coded: dict[str, torch.Tensor],
    ranks: tuple[int, ...],
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
    evidence_max: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept rows' probabilities exp(logit - lse) (lse [B, H]: the log of the softmax's whole denominator, kept
    rows and window), zero where not allowed, times the dequantised value codes of each head's KV head, the products
    in `dtype`, per chunk of ROWS_PER_PROGRAM rows: [B, H, chunks, R] float32 code-space sums (R = max rank; columns
    past a head's rank are zero; kept_window_kernels.kept_finish adds the chunks); and the evidence per KV head
    group, the probabilities summed (or with evidence_max, max-ed) over its query heads times the request's weight
    [B]: [B, n_kv, S] float32."""
    batch, heads, n_rows = logits.shape
    n_kv = len(ranks)
    width = max(ranks)
    evidence = torch.empty(batch, n_kv, n_rows, dtype=torch.float32, device=logits.device)  # every row written
    if n_rows == 0:
        return logits.new_zeros(batch, heads, 1, width), evidence
    columns, widths = _head_columns(ranks, logits.device)
    mask = mask_argument(allowed)
    weights = weights.float().expand(batch)
    lse = lse.contiguous()
    codes, scale, low = coded["codes"], coded["scale"], coded["low"]
    chunks = -(-n_rows // ROWS_PER_PROGRAM)  # ceil; triton.cdiv costs microseconds a call on the host
    # Zeros where a head narrower than the widest leaves its columns past its rank unwritten (else every program
    # writes its whole tile: one launch fewer).
    allocate = torch.empty if min(ranks) == width else torch.zeros
    partial = allocate(batch, heads, chunks, width, dtype=torch.float32, device=logits.device)
    group = heads // n_kv
    _kept_value_kernel[(batch, n_kv, chunks)](
        logits, lse, positions, mask, weights, codes, scale, low, columns, widths, partial, evidence,
        n_rows, ROWS_PER_PROGRAM,
        logits.stride(0), logits.stride(1), lse.stride(0), positions.stride(0), mask.stride(0), weights.stride(0),
        codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), evidence.stride(0), evidence.stride(1),
        GROUP=group, BLOCK_G=pow2(group), BLOCK_N=_block_rows(), BLOCK_R=pow2(width),
        BITS=bits, GROUP_SIZE=group_size, DOT_DTYPE=DOT_DTYPES[torch.float32 if interpreting() else dtype],
        EVIDENCE_MAX=evidence_max, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return partial, evidence
