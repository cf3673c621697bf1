"""Triton kernel: attention straight from a codec cache's packed int4/int2 blocks (codecs.readout.QuantizedBlocks).

The counterpart of kernels.coded_attention for CUDA. A program owns one (request, KV head, block of query rows);
tile rows are (query position, group member) pairs, so the group shares every K/V tile it builds. It walks the
cache one coded block of G tokens at a time: loads the block's packed bytes for its head's columns, unpacks and
dequantises them in registers (code * scale + low; keys one (scale, min) per channel per block, values one per
token per group of channels), attends with an online softmax, and then walks the float16 window the same way.
Nothing the size of the cache is written to memory.

Flash-decoding split: a decode step has few programs (batch x KV heads), so one program walking the whole cache
leaves most of a GPU idle. The cache's coded blocks are therefore split over a second grid axis: each program of
a split walks its share of the blocks (the last split also walks the float16 window) and writes its unnormalised
partial output with its running max and normaliser; a small torch step then merges the splits (the same rescaling
the online softmax does between tiles). With one split the kernel writes the normalised output directly.

Key modes: packed per-head keys (freq / post-rope / folded: `latent=False`), and rebuilt latent keys
(`latent=True`): the key tile is up-projected in registers by the head's k_up rows and rotated with the cache
positions' cos/sin (two half-width dots, rotate_half convention), the queries arriving already rotated.
Crosshead layers (one key block shared by every head) use the torch path.

The kernel runs on CUDA; its tests run it on CPU tensors under TRITON_INTERPRET=1 against the torch path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvrewrite.runtime.codecs.readout import CodedReadout
from kvrewrite.runtime.kernels.flash_decode_coded import unpack_codes
from kvrewrite.runtime.kernels.flash_decode_splits import NEG_INF, interpreting, pow2
from kvrewrite.runtime.kernels.reference import PackedLayout, boolean_mask

MIN_BLOCKS_PER_SPLIT = 4


@triton.jit
def _scores(
    q1,
    q2,
    k,
    up_base,
    cos_ptr,
    sin_ptr,
    n,
    n_ok,
    rdims,
    rk,
    head_d,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
    LATENT: tl.constexpr,
):
    """Scores of the tile rows against a key tile k [N, BLOCK_D] (packed keys, or latents to rebuild and rotate)."""
    if LATENT:
        half = tl.arange(0, HALF)
        up_ok = (rdims[:, None] < rk) & (half[None, :] < head_d // 2)
        up_rows = up_base + rdims[:, None] * head_d + half[None, :]
        k1 = tl.dot(k, tl.load(up_rows, mask=up_ok, other=0.0).to(tl.float32))  # first half of the rebuilt key
        k2 = tl.dot(k, tl.load(up_rows + head_d // 2, mask=up_ok, other=0.0).to(tl.float32))
        cs_ok = n_ok[:, None] & (half[None, :] < head_d // 2)
        cs = n[:, None] * head_d + half[None, :]
        cos1 = tl.load(cos_ptr + cs, mask=cs_ok, other=0.0)
        sin1 = tl.load(sin_ptr + cs, mask=cs_ok, other=0.0)
        cos2 = tl.load(cos_ptr + cs + head_d // 2, mask=cs_ok, other=0.0)
        sin2 = tl.load(sin_ptr + cs + head_d // 2, mask=cs_ok, other=0.0)
        r1 = k1 * cos1 - k2 * sin1  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        r2 = k2 * cos2 + k1 * sin2
        return tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))
    return tl.dot(q1, tl.trans(k))


@triton.jit
def _online_step(m_i, l_i, acc, s, allowed, v):
    s = tl.where(allowed, s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(allowed, tl.exp(s - m_new[:, None]), 0.0)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def _coded_attention_kernel(
    q_ptr,
    o_ptr,
    mask_ptr,
    kc_ptr,
    ks_ptr,
    kl_ptr,
    vc_ptr,
    vs_ptr,
    vl_ptr,
    kw_ptr,
    vw_ptr,
    up_ptr,
    cos_ptr,
    sin_ptr,
    q_off_ptr,
    k_off_ptr,
    v_off_ptr,
    o_off_ptr,
    k_rank_ptr,
    v_rank_ptr,
    pm_ptr,
    pl_ptr,
    n_blocks,
    window,
    q_len,
    row_blocks,
    n_kv,
    key_channels,
    value_channels,
    head_d,
    scaling,
    blocks_per_split,
    s_qb,
    s_qt,
    s_ob,
    s_ot,
    s_mb,
    s_mt,
    s_os,
    s_ps,
    s_pb,
    s_pt,
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
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
    BITS: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
    LATENT: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    last_split = split == tl.num_programs(1) - 1
    rb = pid % row_blocks
    b = (pid // row_blocks // n_kv).to(tl.int64)
    h = pid // row_blocks % n_kv
    rk = tl.load(k_rank_ptr + h)
    rv = tl.load(v_rank_ptr + h)
    k_off = tl.load(k_off_ptr + h)
    v_off = tl.load(v_off_ptr + h)
    flat = tl.arange(0, BLOCK_M * BLOCK_G)
    member = flat % BLOCK_G
    pos = rb * BLOCK_M + flat // BLOCK_G
    row_ok = (member < GROUP) & (pos < q_len)
    dims = tl.arange(0, BLOCK_D)
    q_base = q_ptr + b * s_qb + pos[:, None] * s_qt + tl.load(q_off_ptr + h)
    if LATENT:  # rotated full-width queries [.., head_d] per member, in two halves
        half = tl.arange(0, HALF)
        q_ok = row_ok[:, None] & (half[None, :] < head_d // 2)
        q1 = tl.load(q_base + member[:, None] * head_d + half[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_base + member[:, None] * head_d + head_d // 2 + half[None, :], mask=q_ok, other=0.0).to(
            tl.float32
        )
    else:
        q1 = tl.load(
            q_base + member[:, None] * rk + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < rk), other=0.0
        ).to(tl.float32)
        q2 = q1
    up_base = up_ptr + h * head_d * head_d
    m_i = tl.full([BLOCK_M * BLOCK_G], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    k_ok = dims[None, :] < rk
    v_ok = dims[None, :] < rv
    k_cols = k_off + dims
    v_cols = v_off + dims
    tok = tl.arange(0, BLOCK_T)
    first_block = split * blocks_per_split
    for blk in range(first_block, tl.minimum(first_block + blocks_per_split, n_blocks)):
        n = blk * BLOCK_T + tok
        n_ok = tok < BLOCK_T
        # Keys: one (scale, min) per channel per block; codes token-major over the block's [G, C] grid.
        kidx = tok[:, None] * key_channels + k_cols[None, :]
        codes = unpack_codes(kc_ptr + b * s_kcb + blk * s_kcn, kidx, k_ok, BITS)
        kmeta = b * s_ksb + blk * s_ksn + k_cols
        scale = tl.load(ks_ptr + kmeta, mask=dims < rk, other=0.0).to(tl.float32)
        low = tl.load(kl_ptr + kmeta, mask=dims < rk, other=0.0).to(tl.float32)
        k = tl.where(k_ok, codes * scale[None, :] + low[None, :], 0.0)
        s = _scores(q1, q2, k, up_base, cos_ptr, sin_ptr, n, n_ok, dims, rk, head_d, BLOCK_D, HALF, LATENT) * scaling
        # Values: one (scale, min) per token per group of VALUE_GROUP packed channels.
        vidx = tok[:, None] * value_channels + v_cols[None, :]
        vcodes = unpack_codes(vc_ptr + b * s_vcb + blk * s_vcn, vidx, v_ok, BITS)
        vmeta = b * s_vsb + blk * s_vsn + tok[:, None] * s_vst + (v_cols // VALUE_GROUP)[None, :]
        vscale = tl.load(vs_ptr + vmeta, mask=v_ok, other=0.0).to(tl.float32)
        vlow = tl.load(vl_ptr + vmeta, mask=v_ok, other=0.0).to(tl.float32)
        v = tl.where(v_ok, vcodes * vscale + vlow, 0.0)
        allowed = tl.load(mask_ptr + b * s_mb + pos[:, None] * s_mt + n[None, :], mask=row_ok[:, None], other=0) != 0
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, allowed & row_ok[:, None], v)
    coded = n_blocks * BLOCK_T
    wtok = tl.arange(0, BLOCK_W)
    for start in range(0, tl.where(last_split, window, 0), BLOCK_W):
        w = start + wtok
        w_ok = w < window
        n = coded + w
        k = tl.load(kw_ptr + b * s_kwb + w[:, None] * s_kwt + k_cols[None, :], mask=w_ok[:, None] & k_ok, other=0.0).to(
            tl.float32
        )
        s = _scores(q1, q2, k, up_base, cos_ptr, sin_ptr, n, w_ok, dims, rk, head_d, BLOCK_D, HALF, LATENT) * scaling
        v = tl.load(vw_ptr + b * s_vwb + w[:, None] * s_vwt + v_cols[None, :], mask=w_ok[:, None] & v_ok, other=0.0).to(
            tl.float32
        )
        allowed = (
            tl.load(
                mask_ptr + b * s_mb + pos[:, None] * s_mt + n[None, :], mask=row_ok[:, None] & w_ok[None, :], other=0
            )
            != 0
        )
        m_i, l_i, acc = _online_step(m_i, l_i, acc, s, allowed & row_ok[:, None] & w_ok[None, :], v)
    o_ptrs = (
        o_ptr
        + split * s_os
        + b * s_ob
        + pos[:, None] * s_ot
        + tl.load(o_off_ptr + h)
        + member[:, None] * rv
        + dims[None, :]
    )
    if PARTIAL:  # this split's unnormalised sum, running max and normaliser, merged by _merge_splits
        tl.store(o_ptrs, acc, mask=row_ok[:, None] & v_ok)
        stat = split * s_ps + b * s_pb + pos * s_pt + h * GROUP + member
        tl.store(pm_ptr + stat, m_i, mask=row_ok)
        tl.store(pl_ptr + stat, l_i, mask=row_ok)
    else:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok)


def supports(readout: CodedReadout) -> bool:
    """Whether the kernel can tile this store: a coded block is one key tile, so G must be a power of two (and at
    least 16 where tl.dot runs on real hardware)."""
    g = readout.layout.block_tokens
    return g & (g - 1) == 0 and (g >= 16 or interpreting())


def split_count(programs: int, blocks: int, device: torch.device) -> int:
    """How many splits of the coded blocks a call gets: enough programs for about two per streaming multiprocessor,
    and at most blocks // MIN_BLOCKS_PER_SPLIT splits (a split's partial costs a write and a merge)."""
    if device.type != "cuda" or blocks < 2 * MIN_BLOCKS_PER_SPLIT:
        return 1
    wanted = -(-2 * torch.cuda.get_device_properties(device).multi_processor_count // programs)
    return max(1, min(wanted, blocks // MIN_BLOCKS_PER_SPLIT))


def _merge_splits(
    partial: torch.Tensor, running_max: torch.Tensor, normaliser: torch.Tensor, column_heads: torch.Tensor
) -> torch.Tensor:
    """partial [splits, B, T, Osum] unnormalised outputs, running_max / normaliser [splits, B, T, H] -> [B, T, Osum]:
    each split is rescaled to the common max, as the online softmax rescales between tiles."""
    weight = torch.exp(running_max - running_max.amax(0, keepdim=True))  # [splits, B, T, H]; masked splits -> 0
    total = (normaliser * weight).sum(0)[..., column_heads]  # [B, T, Osum]
    summed = (partial * weight[..., column_heads]).sum(0)
    return torch.where(total > 0, summed / total.clamp_min(1e-30), torch.zeros_like(summed))


def triton_coded_attention(
    query: torch.Tensor,
    readout: CodedReadout,
    attention_mask,
    scaling: float,
    layout: PackedLayout,
    k_up: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """query [B, T, Qsum] (latent: the rotated full-width queries [B, T, H * d]) over a CodedReadout -> [B, T, Osum].

    Latent layers pass k_up [n_kv, d, d] (rows = latent dims) and rope = (cos, sin) [S, d] at cache indices 0..S-1.
    `splits` fixes how many programs share one row block's coded blocks (default: split_count).
    """
    batch, q_len, _ = query.shape
    kv_len = readout.length
    group, n_kv = layout.group_size, len(layout.key_ranks)
    latent = k_up is not None
    device = query.device
    allowed = boolean_mask(attention_mask, q_len, kv_len, device)
    mask = allowed.expand(batch, 1, q_len, kv_len)[:, 0].to(torch.int8).contiguous()  # [B, T, S]
    head_d = k_up.shape[-1] if latent else 1
    q_offsets = [h * group * head_d for h in range(n_kv)] if latent else layout.query_offsets[:-1]
    tables = torch.tensor(
        [
            q_offsets,
            layout.key_offsets[:-1],
            layout.value_offsets[:-1],
            layout.output_offsets[:-1],
            list(layout.key_ranks),
            list(layout.value_ranks),
        ],
        dtype=torch.int32,
        device=device,
    )
    output = torch.zeros(batch, q_len, layout.output_offsets[-1], device=device, dtype=query.dtype)
    query = query.contiguous()
    blocks = readout.coded_blocks
    g = readout.layout.block_tokens
    key_window = readout.key_window[:, 0].contiguous()  # [B, W, Ck] float16
    value_window = readout.value_window[:, 0].contiguous()
    if blocks:
        kc, ks, kl = (readout.keys[n].contiguous() for n in ("codes", "scale", "low"))
        vc, vs, vl = (readout.values[n].contiguous() for n in ("codes", "scale", "low"))
    else:  # nothing coded yet: dummies the kernel never reads
        kc = vc = torch.zeros(batch, 1, 1, dtype=torch.uint8, device=device)
        ks = kl = torch.zeros(batch, 1, 1, dtype=torch.float16, device=device)
        vs = vl = torch.zeros(batch, 1, 1, 1, dtype=torch.float16, device=device)
    dummy = torch.zeros(1, device=device, dtype=torch.float32)
    up = k_up.float().contiguous() if latent else dummy
    cos, sin = (rope[0].float().contiguous(), rope[1].float().contiguous()) if latent else (dummy, dummy)
    block_d = pow2(max(max(layout.key_ranks), max(layout.value_ranks)))
    block_g = pow2(group, floor=1)
    # Tile rows = BLOCK_M positions x BLOCK_G members, at least 16 (tl.dot's minimum on the GPU; spare rows masked).
    block_m = max(16 // block_g, min(pow2(q_len, floor=1), 64 // block_g), 1)
    row_blocks = -(-q_len // block_m)
    programs = batch * n_kv * row_blocks
    splits = max(1, min(splits or split_count(programs, blocks, device), max(blocks, 1)))
    blocks_per_split = -(-blocks // splits) if blocks else 0
    target = output
    running_max = normaliser = dummy
    if splits > 1:
        target = torch.zeros(splits, *output.shape, device=device, dtype=torch.float32)
        running_max = torch.full(
            (splits, batch, q_len, n_kv * group), NEG_INF.value, device=device, dtype=torch.float32
        )
        normaliser = torch.zeros_like(running_max)
    _coded_attention_kernel[(programs, splits)](
        query,
        target,
        mask,
        kc,
        ks,
        kl,
        vc,
        vs,
        vl,
        key_window,
        value_window,
        up,
        cos,
        sin,
        *tables.unbind(0),
        running_max,
        normaliser,
        blocks,
        key_window.shape[1],
        q_len,
        row_blocks,
        n_kv,
        key_window.shape[-1],
        value_window.shape[-1],
        head_d,
        scaling,
        blocks_per_split,
        query.stride(0),
        query.stride(1),
        target.stride(-3),
        target.stride(-2),
        mask.stride(0),
        mask.stride(1),
        target.stride(0) if splits > 1 else 0,
        running_max.stride(0) if splits > 1 else 0,
        running_max.stride(1) if splits > 1 else 0,
        running_max.stride(2) if splits > 1 else 0,
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
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_T=g,
        BLOCK_W=16,
        BLOCK_D=block_d,
        HALF=pow2(head_d // 2) if latent else 16,
        BITS=readout.layout.bits,
        VALUE_GROUP=readout.layout.value_group,
        LATENT=latent,
        PARTIAL=splits > 1,
    )
    if splits == 1:
        return output
    return _merge_splits(target, running_max, normaliser, _column_heads(layout, str(device))).to(output.dtype)


@functools.lru_cache(maxsize=64)
def _column_heads(layout: PackedLayout, device: str) -> torch.Tensor:
    """The query head each packed output column belongs to ([Osum]); built once per layout and device, not per step."""
    return torch.cat(
        [
            torch.full((rv,), h * layout.group_size + m, dtype=torch.long, device=device)
            for h, rv in enumerate(layout.value_ranks)
            for m in range(layout.group_size)
        ]
    )
