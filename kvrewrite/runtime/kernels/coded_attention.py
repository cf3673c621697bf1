"""Attention straight from a codec cache's packed int4/int2 blocks, in torch: dequantise a chunk, attend, move on.

The cache hands attention a `CodedReadout` (codecs.readout): KIVI-coded blocks of G tokens and the float16
window. `readout_chunks` walks the cache in order, unpacking and dequantising `chunk_tokens` tokens' worth of whole
blocks at a time into one float32 buffer (keys: code * scale + low per channel and block; values: per token and
group of channels; the float16 window rides along with the last chunk), so at most one chunk of the cache exists in
float32 at a time. `OnlineSoftmax` carries the running maximum, normaliser and weighted values of every query head
from chunk to chunk (flash attention's recurrence), so the result is softmax(q k^T) v over the whole cache without
a decoded copy of it. The dequantisation is bit for bit the codec's decode, so the only difference from the decode
path (decode the store, concatenate the window, attend) is the order of the softmax sums.

The key modes differ only in how a chunk's keys are scored (packed heads, rebuilt latent keys, one shared block);
CompressedAttention.attend_coded supplies that as a function. kernels.triton_coded_attention is the CUDA version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from kvrewrite.runtime.codecs.readout import CodedReadout, QuantizedBlocks
from kvrewrite.runtime.kernels.reference import softmax_dtype

CHUNK_TOKENS = 1024  # tokens dequantised per step of the walk (rounded down to whole blocks, at least one)


def dequantize_blocks(
    coded: dict[str, torch.Tensor], side: str, layout: QuantizedBlocks, start: int, stop: int, out: torch.Tensor
) -> torch.Tensor:
    """Blocks start..stop-1 of a KIVI store written into out [B, (stop - start) * G, C] (float32), bit for bit
    kivi_decode's values (code * scale + low, one float32 multiply and one add, in place: no temporaries)."""
    packed = coded["codes"][:, start:stop]
    batch, n = packed.shape[:2]
    g, channels = layout.block_tokens, out.shape[-1]
    x = out.view(batch, n, g, channels)
    x.copy_(unpack_codes(packed, layout.bits, g * channels).view(batch, n, g, channels))
    scale, low = coded["scale"][:, start:stop].float(), coded["low"][:, start:stop].float()
    if side == "key":  # one (scale, min) per channel per block
        x.mul_(scale[:, :, None, :]).add_(low[:, :, None, :])
    else:  # one (scale, min) per token per group of `value_group` channels
        size = layout.value_group
        for j in range(scale.shape[-1]):
            cols = x[..., j * size : (j + 1) * size]
            cols.mul_(scale[..., j : j + 1]).add_(low[..., j : j + 1])
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """packing.unpack_bits with scalar shifts, one per code slot of a byte (torch's CPU kernels for a broadcast
    shift of uint8 are several times slower) -> uint8 [..., n]."""
    if bits == 8:
        return packed[..., :n]
    mask, slots = (1 << bits) - 1, 8 // bits
    codes = torch.stack([(packed >> (i * bits)) & mask if i else packed & mask for i in range(slots)], dim=-1)
    return codes.flatten(-2)[..., :n]


def readout_chunks(
    readout: CodedReadout, dtype: torch.dtype, chunk_tokens: int | None = None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(first cache index, keys [B, 1, n, Ck], values [B, 1, n, Cv]) of consecutive chunks, in cache order: the
    coded blocks dequantised a chunk at a time, the float16 window appended to the last one (one step fewer)."""
    layout = readout.layout
    per_chunk = max(1, (chunk_tokens or CHUNK_TOKENS) // layout.block_tokens)
    blocks = readout.coded_blocks
    key_window, value_window = readout.key_window, readout.value_window
    batch = key_window.shape[0]
    if blocks == 0:
        yield 0, key_window.to(dtype), value_window.to(dtype)
        return
    window = key_window.shape[-2]
    for start in range(0, blocks, per_chunk):
        stop = min(start + per_chunk, blocks)
        coded = (stop - start) * layout.block_tokens
        tail = window if stop == blocks else 0  # the window rides with the last chunk: one step fewer, no cat
        keys = key_window.new_empty(batch, coded + tail, key_window.shape[-1], dtype=torch.float32)
        values = value_window.new_empty(batch, coded + tail, value_window.shape[-1], dtype=torch.float32)
        dequantize_blocks(readout.keys, "key", layout, start, stop, keys[:, :coded])
        dequantize_blocks(readout.values, "value", layout, start, stop, values[:, :coded])
        if tail:
            keys[:, coded:], values[:, coded:] = readout.key_window[:, 0], readout.value_window[:, 0]
        yield start * layout.block_tokens, keys.unsqueeze(1).to(dtype), values.unsqueeze(1).to(dtype)


class OnlineSoftmax:
    """softmax(scores) @ values accumulated over key chunks: running max m, normaliser l and output acc.

    Masked scores are filled with the dtype's lowest finite value, as the reference does, so a query that may
    read nothing gets the reference's uniform average rather than NaN.
    """

    def __init__(self) -> None:
        self.m: torch.Tensor | None = None
        self.l: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None  # in the softmax dtype (float32 / float64), whatever the values' dtype
        self.dtype: torch.dtype | None = None

    def add(self, scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor) -> None:
        """scores [B, H, T, n] (already scaled), allowed [B|1, 1, T, n], values [B, 1, n, C]."""
        scores = scores.to(softmax_dtype(scores.dtype))
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        m_new = scores.amax(dim=-1, keepdim=True)
        if self.m is not None:
            m_new = torch.maximum(self.m, m_new)
        p = torch.exp(scores - m_new)
        chunk_sum = p.sum(dim=-1, keepdim=True)
        # One GEMM per request, [H * T, n] @ [n, C]: a broadcast matmul over the heads would re-read the values per head.
        batch, heads, q_len, n = p.shape
        chunk_out = torch.matmul(p.to(values.dtype).reshape(batch, heads * q_len, n), values[:, 0])
        chunk_out = chunk_out.view(batch, heads, q_len, -1).to(p.dtype)
        if self.m is None:
            self.l, self.acc, self.dtype = chunk_sum, chunk_out, values.dtype
        else:
            alpha = torch.exp(self.m - m_new)
            self.l = self.l * alpha + chunk_sum
            self.acc = self.acc * alpha + chunk_out
        self.m = m_new

    def result(self) -> torch.Tensor:
        return (self.acc / self.l).to(self.dtype)


# score(first cache index, keys [B, 1, n, Ck]) -> every query head's scaled scores [B, H, T, n]
ScoreFn = Callable[[int, torch.Tensor], torch.Tensor]


def blockwise_coded_attention(
    readout: CodedReadout, score: ScoreFn, allowed: torch.Tensor, dtype: torch.dtype, chunk_tokens: int | None = None
) -> torch.Tensor:
    """softmax(score) @ values over the whole cache -> [B, H, T, Cv]: every query head against ALL packed value
    columns (one GEMM per chunk; the caller keeps each head's own KV head's columns, the block diagonal).
    allowed: [B|1, 1, T, S] (S = readout.length)."""
    state = OnlineSoftmax()
    for start, keys, values in readout_chunks(readout, dtype, chunk_tokens):
        state.add(score(start, keys), allowed[..., start : start + keys.shape[-2]], values)
    return state.result()
