"""Bit packing and min/max (asymmetric) quantization: the storage primitives every codec shares.

Codes are packed along the last dimension, 8 // bits codes per byte, lowest bits first. Scales and zero
points are stored in float16 (what a deployment keeps), and codes are computed against the float16-rounded
values so that decode(encode(x)) is exactly what the stored bytes give back.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (1, 2, 4, 8)
META_DTYPE = torch.float16


def packed_length(n: int, bits: int) -> int:
    """Bytes that n codes of `bits` bits occupy."""
    return math.ceil(n * bits / 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] (each < 2**bits) -> uint8 [..., ceil(n * bits / 8)]."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    per_byte = 8 // bits
    n = codes.shape[-1]
    pad = (-n) % per_byte
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.view(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., m] -> uint8 codes [..., n]."""
    if bits == 8:
        return packed[..., :n]
    mask = (1 << bits) - 1
    # One shift by a number per code slot: shifting by a broadcast tensor of shifts is several times slower on a CPU.
    codes = torch.stack([(packed >> shift if shift else packed) & mask for shift in range(0, 8, bits)], dim=-1)
    return codes.flatten(-2)[..., :n]


def quantize_minmax(
    x: torch.Tensor, reduce_dims: tuple[int, ...], bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization with one (scale, minimum) per slice over `reduce_dims`.

    Returns uint8 codes shaped like x, and float16 scale and minimum with the reduced dims kept (size 1).
    """
    levels = (1 << bits) - 1
    xf = x.float()
    low = xf.amin(dim=reduce_dims, keepdim=True)
    high = xf.amax(dim=reduce_dims, keepdim=True)
    # A floor on the scale keeps it a normal float16 number (and constant slices exact).
    scale = ((high - low) / levels).clamp_min(1e-4).to(META_DTYPE)
    low = low.to(META_DTYPE)
    codes = torch.round((xf - low.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    return codes, scale, low


def dequantize_minmax(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + low.float()
