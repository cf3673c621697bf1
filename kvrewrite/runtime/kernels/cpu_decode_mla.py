"""Absorbed-MLA decode on CPU in torch ops: the cache read once, in blocks of rows, with an online softmax.

The plain form (scores = queries @ rows^T over the whole cache, softmax, probs @ rows[:, :r]) reads every cached
row twice, and at 8K tokens x batch 8 a layer's rows (50 MB in fp32) do not fit the last-level cache, so both reads
come from DRAM. Here the rows go by blocks of slots, across the batch: a block's scores for every head and its
latent value sum both run while the block is cache-resident, and a running max / normaliser per head merges the
blocks (flash-decoding, as kernels.flash_decode_mla does on CUDA). Two choices were timed on this project's CPU
(one core, MKL sgemm) while building it; the end-to-end figure is benchmarks/results/gpu_decode_cpu_8k_mla.json:

- a small-M GEMM (M = heads) reads a cold operand slower than a plain reduction streams it, so each block is first
  touched by one (.sum()) and the GEMMs then run on cache-resident rows;
- blocks of about 2 MB across the batch: larger ones fall out of the cache shared with the other cores, smaller
  ones pay more in per-op overhead (about a dozen torch ops per block).
"""

from __future__ import annotations

import torch

from kvrewrite.runtime.kernels.reference import softmax_dtype

# Bytes of cached rows (all sequences of the batch) one block holds, and the fewest slots a block spans.
BLOCK_BYTES = 2 << 20
MIN_BLOCK_SLOTS = 128


def block_slots(batch: int, width: int, element_size: int) -> int:
    """Slots per block: about BLOCK_BYTES of rows across the batch, a multiple of 64, at least MIN_BLOCK_SLOTS."""
    slots = BLOCK_BYTES // max(1, batch * width * element_size)
    return max(MIN_BLOCK_SLOTS, slots // 64 * 64)


def mla_block_decode(
    q_rows: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor, rank: int, slots: int | None = None
) -> torch.Tensor:
    """q_rows [B, H, r + d_r] (already scaled), rows [B, S, r + d_r] (unit last stride), allowed [B|1, S] bool
    -> latent_out [B, H, r] in q_rows' dtype.

    Masked slots score finfo.min, as the dense path's masked_fill does: a fully masked query row averages all S
    rows uniformly (no NaN), a partly masked one gives them weight exactly 0.
    """
    batch, heads, _ = q_rows.shape
    kv_len = rows.shape[1]
    slots = slots or block_slots(batch, rows.shape[2], rows.element_size())
    stat_dtype = softmax_dtype(q_rows.dtype)
    # The mask as an additive bias in the scores' dtype, added inside the score GEMM (baddbmm's beta term).
    bias = torch.zeros(allowed.shape, dtype=q_rows.dtype, device=q_rows.device)
    bias = bias.masked_fill_(~allowed, torch.finfo(q_rows.dtype).min)[:, None]  # [B|1, 1, S]
    running_max = torch.full((batch, heads, 1), float("-inf"), dtype=stat_dtype, device=q_rows.device)
    normaliser = torch.zeros(batch, heads, 1, dtype=stat_dtype, device=q_rows.device)
    acc = torch.zeros(batch, heads, rank, dtype=stat_dtype, device=q_rows.device)
    for start in range(0, kv_len, slots):
        block = rows[:, start : start + slots]
        if kv_len > slots:
            block.sum()  # brings the block into the cache at streaming speed (see the module docstring)
        span = block.shape[1]
        scores = torch.baddbmm(bias[..., start : start + span].expand(batch, heads, span), q_rows, block.mT)
        scores = scores.to(stat_dtype)
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        rescale = running_max.sub_(new_max).exp_()  # exp(-inf) = 0 on the first block
        probs = scores.sub_(new_max).exp_()
        normaliser.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
        acc.mul_(rescale)
        if stat_dtype == rows.dtype:
            acc.baddbmm_(probs, block[..., :rank])
        else:  # low-precision rows: the GEMM in their dtype, as the dense path's probs @ rows
            acc.add_(torch.bmm(probs.to(rows.dtype), block[..., :rank]))
        running_max = new_max
    return acc.div_(normaliser).to(q_rows.dtype)
