"""Triton kernels for the recent window of an evicting layer's decode step, and for the step's output.

The kept tier's two kernels (kernels.kept_tier_kernels) read the codes; around them a decode step also needs the
queries rotated, the window's (at most window + 1) full-rank keys rebuilt, rotated and scored, the one softmax's
denominator over both tiers, the window's probabilities, values and evidence, and the kept tier's value sum mapped
back from its code space. In torch that is some forty small launches a layer. Here it is three programs per
(request, KV head), the window's tiles a few dozen rows:

- `window_logits` (before the kept logits): rotates the group's queries at the query's position and writes them
  for the kept-logits kernel; rebuilds the window's keys with the head's up-projection (tl.dot, float32), rotates
  them at their positions and writes the window's scaled logits and their softmax statistics (max, sum of exp);
- `window_finish` (after the kept logits): joins the kept tier's per-chunk statistics and the window's into the log
  of the denominator per head (lse), the kept rows' share of the weight, the window's probabilities times its values
  (float32, into the output buffer) and the window's evidence;
- `kept_finish` (after the kept values): adds the kept tier's per-chunk value sums, maps them back from the code
  space (sum p x = (sum p y) M + offset sum p), adds the window's part and writes o_proj's input in the model's dtype.

The window's keys and logits are products in the model's dtype summed in float32, as the torch path's GEMMs (float32
under the interpreter, whose narrow dots are wrong; IEEE float32, not TF32, for a float32 model); the probabilities'
sums run at float32's IEEE precision, which a few dozen rows afford. A window is one tile: tiers/kept_decode.py
sends a window of more than MAX_WINDOW_ROWS rows to the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.kernels.flash_decode_splits import NEG_INF, interpreting, mask_argument, pow2
from kvrewrite.runtime.kernels.kept_tier_kernels import DOT_DTYPES


@triton.jit
def _group_heads(GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    """This program's request b, KV head g, and the group's query heads (and which of the padded rows exist)."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    member = tl.arange(0, BLOCK_G)
    return b, g, g * GROUP + member, member < GROUP


@triton.jit
def _window_logits_kernel(
    q_ptr, q_out_ptr, keys_ptr, up_ptr, cos_ptr, sin_ptr, mask_ptr, logits_ptr, wmax_ptr, wsum_ptr,
    q_pos, first_pos, n_window, half_d, qk_scale,
    s_qb, s_ob, s_kb, s_kw, s_ug, s_ur, s_cos, s_sin, s_mb, s_lb, s_lh, s_sb,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b, g, heads, row_ok = _group_heads(GROUP, BLOCK_G)
    half = tl.arange(0, HALF)
    half_ok = half < half_d
    # The group's queries, rotated at the query's position (HF's rotate_half: the tables' halves are equal).
    q_rows = q_ptr + b * s_qb + heads[:, None] * (2 * half_d) + half[None, :]
    q_ok = row_ok[:, None] & half_ok[None, :]
    q1 = tl.load(q_rows, mask=q_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_rows + half_d, mask=q_ok, other=0.0).to(tl.float32)
    cq = tl.load(cos_ptr + q_pos * s_cos + half, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    sq = tl.load(sin_ptr + q_pos * s_sin + half, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    r1 = q1 * cq - q2 * sq
    r2 = q2 * cq + q1 * sq
    out_rows = q_out_ptr + b * s_ob + heads[:, None] * (2 * half_d) + half[None, :]
    tl.store(out_rows, r1.to(q_out_ptr.dtype.element_ty), mask=q_ok)
    tl.store(out_rows + half_d, r2.to(q_out_ptr.dtype.element_ty), mask=q_ok)
    # The window's keys: latents [W, d] times the head's up-projection [d, d], rotated at their positions.
    w = tl.arange(0, BLOCK_W)
    w_ok = w < n_window
    dl = tl.arange(0, BLOCK_D)
    dl_ok = dl < 2 * half_d
    lat = tl.load(
        keys_ptr + b * s_kb + w[:, None] * s_kw + g * (2 * half_d) + dl[None, :],
        mask=w_ok[:, None] & dl_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    up_rows = up_ptr + g * s_ug + dl[:, None] * s_ur + half[None, :]
    up_ok = dl_ok[:, None] & half_ok[None, :]
    up1 = tl.load(up_rows, mask=up_ok, other=0.0).to(DOT_DTYPE)
    up2 = tl.load(up_rows + half_d, mask=up_ok, other=0.0).to(DOT_DTYPE)
    k1 = tl.dot(lat, up1, input_precision=PRECISION)  # [W, HALF], float32 sums of the model dtype's products
    k2 = tl.dot(lat, up2, input_precision=PRECISION)
    position = first_pos + w
    rope_ok = w_ok[:, None] & half_ok[None, :]
    c = tl.load(cos_ptr + position[:, None] * s_cos + half[None, :], mask=rope_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + position[:, None] * s_sin + half[None, :], mask=rope_ok, other=0.0).to(tl.float32)
    kr1 = k1 * c - k2 * s
    kr2 = k2 * c + k1 * s
    logits = tl.dot(r1.to(DOT_DTYPE), tl.trans(kr1.to(DOT_DTYPE)), input_precision=PRECISION) + tl.dot(
        r2.to(DOT_DTYPE), tl.trans(kr2.to(DOT_DTYPE)), input_precision=PRECISION
    )
    allowed = w_ok & (tl.load(mask_ptr + b * s_mb + position, mask=w_ok, other=0) != 0)
    logits = tl.where(allowed[None, :], logits * qk_scale, NEG_INF)
    tl.store(logits_ptr + b * s_lb + heads[:, None] * s_lh + w[None, :], logits, mask=row_ok[:, None] & w_ok[None, :])
    top = tl.max(logits, axis=1)
    total = tl.sum(tl.where(allowed[None, :], tl.exp(logits - top[:, None]), 0.0), axis=1)
    tl.store(wmax_ptr + b * s_sb + heads, top, mask=row_ok)
    tl.store(wsum_ptr + b * s_sb + heads, total, mask=row_ok)


@triton.jit
def _window_finish_kernel(
    maxima_ptr, sums_ptr, wmax_ptr, wsum_ptr, logits_ptr, values_ptr, weight_ptr,
    lse_ptr, mass_ptr, out_ptr, evidence_ptr,
    chunks, n_window, head_dim,
    s_mb, s_mh, s_sb, s_lb, s_lh, s_vb, s_vw, s_wb, s_ob, s_oh, s_eb, s_eg,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr, EVIDENCE_MAX: tl.constexpr,
):  # fmt: skip
    b, g, heads, row_ok = _group_heads(GROUP, BLOCK_G)
    # The log of the softmax's denominator: the window and the kept tier's chunks (max NEG_INF, sum 0 where a chunk
    # has no row allowed), in one pass with a running max; both sums are relative to it.
    window_max = tl.load(wmax_ptr + b * s_sb + heads, mask=row_ok, other=NEG_INF)
    top = window_max
    kept = tl.zeros([BLOCK_G], tl.float32)
    for c0 in range(0, chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = row_ok[:, None] & (c < chunks)[None, :]
        m = tl.load(maxima_ptr + b * s_mb + heads[:, None] * s_mh + c[None, :], mask=ok, other=NEG_INF)
        l_c = tl.load(sums_ptr + b * s_mb + heads[:, None] * s_mh + c[None, :], mask=ok, other=0.0)
        new_top = tl.maximum(top, tl.max(m, axis=1))
        chunk_sum = tl.sum(tl.where(ok & (l_c > 0), l_c * tl.exp(m - new_top[:, None]), 0.0), axis=1)
        kept = kept * tl.exp(top - new_top) + chunk_sum
        top = new_top
    total = tl.load(wsum_ptr + b * s_sb + heads, mask=row_ok, other=0.0) * tl.exp(window_max - top)
    denominator = tl.where(row_ok, total + kept, 1.0)  # (the padded rows' is 0)
    lse = top + tl.log(denominator)
    tl.store(lse_ptr + b * s_sb + heads, lse, mask=row_ok)
    tl.store(mass_ptr + b * s_sb + heads, kept / denominator, mask=row_ok)
    # The window's probabilities, its evidence, and its values' weighted sum.
    w = tl.arange(0, BLOCK_W)
    w_ok = w < n_window
    s = tl.load(
        logits_ptr + b * s_lb + heads[:, None] * s_lh + w[None, :], mask=row_ok[:, None] & w_ok[None, :], other=NEG_INF
    )
    p = tl.where(row_ok[:, None] & w_ok[None, :], tl.exp(s - tl.where(row_ok, lse, 0.0)[:, None]), 0.0)
    weight = tl.load(weight_ptr + b * s_wb)
    if EVIDENCE_MAX:
        evidence = tl.max(p, axis=0) * weight
    else:
        evidence = tl.sum(p, axis=0) * weight
    tl.store(evidence_ptr + b * s_eb + g * s_eg + w, evidence, mask=w_ok)
    dv = tl.arange(0, BLOCK_D)
    dv_ok = dv < head_dim
    v = tl.load(
        values_ptr + b * s_vb + w[:, None] * s_vw + g * head_dim + dv[None, :],
        mask=w_ok[:, None] & dv_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    out = tl.dot(p, v, input_precision="ieee")  # [G, d]
    tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + dv[None, :], out, mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit
def _kept_finish_kernel(
    partial_ptr, mass_ptr, matrix_ptr, offset_ptr, window_out_ptr, out_ptr,
    chunks, rank, head_dim,
    s_pb, s_ph, s_pc, s_sb, s_xb, s_xg, s_xr, s_fb, s_fg, s_wb, s_wh, s_ob, s_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b, g, heads, row_ok = _group_heads(GROUP, BLOCK_G)
    dr = tl.arange(0, BLOCK_R)
    r_ok = dr < rank
    ok = row_ok[:, None] & r_ok[None, :]
    acc = tl.zeros([BLOCK_G, BLOCK_R], tl.float32)
    for c in range(0, chunks):
        acc += tl.load(partial_ptr + b * s_pb + heads[:, None] * s_ph + c * s_pc + dr[None, :], mask=ok, other=0.0)
    # The map into D columns (zero past the rank), so that the kept part adds to the window's in one tile.
    dv = tl.arange(0, BLOCK_D)
    dv_ok = dv < head_dim
    matrix = tl.load(
        matrix_ptr + b * s_xb + g * s_xg + dr[:, None] * s_xr + dv[None, :],
        mask=r_ok[:, None] & (dv < rank)[None, :],
        other=0.0,
    ).to(tl.float32)
    offset = tl.load(offset_ptr + b * s_fb + g * s_fg + dv, mask=dv < rank, other=0.0).to(tl.float32)
    mass = tl.load(mass_ptr + b * s_sb + heads, mask=row_ok, other=0.0)
    kept = tl.dot(acc, matrix, input_precision="ieee") + mass[:, None] * offset[None, :]  # [G, D]
    d_ok = row_ok[:, None] & dv_ok[None, :]
    window = tl.load(window_out_ptr + b * s_wb + heads[:, None] * s_wh + dv[None, :], mask=d_ok, other=0.0)
    tl.store(
        out_ptr + b * s_ob + heads[:, None] * s_oh + dv[None, :],
        (window + kept).to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def window_logits(
    queries: torch.Tensor,
    window_keys: torch.Tensor,
    up: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    allowed: torch.Tensor,
    first_position: int,
    scaling: float,
    rotated_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """queries [B, H, d] (projected, not rotated; the query at cache index first_position + W - 1), window_keys
    [B, W, n_kv * d] (full-rank latents of cache indices first_position..), up [n_kv, d, d] (rows: latent dims),
    cos / sin [>= positions, d] (HF's tables), allowed [B, >= positions] by cache index ->
    (rotated queries [B, H, d] in rotated_dtype, window logits [B, H, W] scaled, -1e30 where not allowed, and their
    max and sum of exp [B, H])."""
    batch, heads, head_dim = queries.shape
    n_window = window_keys.shape[1]
    n_kv = up.shape[0]
    device = queries.device
    rotated = torch.empty(batch, heads, head_dim, dtype=rotated_dtype, device=device)
    logits = torch.empty(batch, heads, n_window, dtype=torch.float32, device=device)
    maxima = torch.empty(batch, heads, dtype=torch.float32, device=device)
    sums = torch.empty_like(maxima)
    queries, up = queries.contiguous(), up.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    mask = mask_argument(allowed)
    group = heads // n_kv
    _window_logits_kernel[(batch, n_kv)](
        queries, rotated, window_keys, up, cos, sin, mask, logits, maxima, sums,
        first_position + n_window - 1, first_position, n_window, head_dim // 2, scaling,
        queries.stride(0), rotated.stride(0), window_keys.stride(0), window_keys.stride(1), up.stride(0),
        up.stride(1), cos.stride(0), sin.stride(0), mask.stride(0), logits.stride(0), logits.stride(1),
        maxima.stride(0),
        GROUP=group, BLOCK_G=pow2(group), BLOCK_W=pow2(n_window), BLOCK_D=pow2(head_dim),
        HALF=pow2(head_dim // 2), DOT_DTYPE=DOT_DTYPES[torch.float32 if interpreting() else rotated_dtype],
        PRECISION="ieee" if rotated_dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    return rotated, logits, maxima, sums


def window_finish(
    kept_maxima: torch.Tensor,
    kept_sums: torch.Tensor,
    window_maxima: torch.Tensor,
    window_sums: torch.Tensor,
    window_logits: torch.Tensor,
    window_values: torch.Tensor,
    weights: torch.Tensor,
    n_kv: int,
    evidence_max: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one softmax over the kept tier (its chunks' max and sum of exp [B, H, chunks]) and the window (its
    logits [B, H, W], their max and sum [B, H]) -> (lse [B, H], the kept rows' share of the weight [B, H], the
    window's probabilities times its values window_values [B, W, n_kv * d] as float32 [B, H, d], and the window's
    evidence per KV head group [B, n_kv, W]: probabilities summed (or max-ed) over its heads times weights [B])."""
    batch, heads, n_window = window_logits.shape
    head_dim = window_values.shape[-1] // n_kv
    chunks = kept_maxima.shape[-1]
    device = window_logits.device
    lse = torch.empty(batch, heads, dtype=torch.float32, device=device)
    mass = torch.empty_like(lse)
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=device)
    evidence = torch.empty(batch, n_kv, n_window, dtype=torch.float32, device=device)
    weights = weights.float().expand(batch)
    kept_maxima, kept_sums = kept_maxima.contiguous(), kept_sums.contiguous()
    group = heads // n_kv
    _window_finish_kernel[(batch, n_kv)](
        kept_maxima, kept_sums, window_maxima, window_sums, window_logits, window_values, weights,
        lse, mass, out, evidence,
        chunks, n_window, head_dim,
        kept_maxima.stride(0), kept_maxima.stride(1), lse.stride(0), window_logits.stride(0),
        window_logits.stride(1), window_values.stride(0), window_values.stride(1), weights.stride(0),
        out.stride(0), out.stride(1), evidence.stride(0), evidence.stride(1),
        GROUP=group, BLOCK_G=pow2(group), BLOCK_W=pow2(n_window), BLOCK_D=pow2(head_dim),
        BLOCK_C=pow2(min(chunks, 64)), EVIDENCE_MAX=evidence_max, num_warps=4,
    )  # fmt: skip
    return lse, mass, out, evidence


def kept_finish(
    partial: torch.Tensor,
    kept_mass: torch.Tensor,
    value_matrix: torch.Tensor,
    value_offset: torch.Tensor,
    window_out: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The kept tier's code-space value sums per chunk partial [B, H, chunks, R] mapped back (value_matrix
    [B, n_kv, R, R], value_offset [B, n_kv, R], kept_mass [B, H]) plus the window's part window_out [B, H, d]
    -> o_proj's input [B, 1, H * d] in `dtype` (columns past R: the window's alone)."""
    batch, heads, chunks, width = partial.shape
    head_dim = window_out.shape[-1]
    n_kv = value_matrix.shape[1]
    out = torch.empty(batch, 1, heads * head_dim, dtype=dtype, device=partial.device)
    flat = out.view(batch, heads, head_dim)
    group = heads // n_kv
    _kept_finish_kernel[(batch, n_kv)](
        partial, kept_mass, value_matrix, value_offset, window_out, flat,
        chunks, width, head_dim,
        partial.stride(0), partial.stride(1), partial.stride(2), kept_mass.stride(0), value_matrix.stride(0),
        value_matrix.stride(1), value_matrix.stride(2), value_offset.stride(0), value_offset.stride(1),
        window_out.stride(0), window_out.stride(1), flat.stride(0), flat.stride(1),
        GROUP=group, BLOCK_G=pow2(group), BLOCK_R=pow2(width), BLOCK_D=pow2(head_dim), num_warps=4,
    )  # fmt: skip
    return out
