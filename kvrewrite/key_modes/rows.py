"""Row helpers the key modes share with the compressed attention: prefix slicing, row folding, pair rotation."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

# A linear layer's (weight [out, in], bias [out] or None), as the fold works on it (float64).
Linear64 = tuple[torch.Tensor, "torch.Tensor | None"]


def map_rows(linear: Linear64, maps: Iterable[tuple[slice, Callable[[torch.Tensor], torch.Tensor]]]) -> Linear64:
    """A copy of `linear` whose rows `rows` are fn(original rows), for every (rows, fn) in `maps`.

    A bias row is transformed exactly like its weight row (the bias is the weight's column for a constant 1).
    """
    weight, bias = linear
    new_weight, new_bias = weight.clone(), None if bias is None else bias.clone()
    for rows, fn in maps:
        new_weight[rows] = fn(weight[rows])
        if bias is not None:
            new_bias[rows] = fn(bias[rows])
    return new_weight, new_bias


def block_prefix_rows(weight: torch.Tensor, block_sizes: list[int], keep: list[int]) -> torch.Tensor:
    """Keep the first keep[i] rows of each consecutive row block of size block_sizes[i]."""
    pieces, start = [], 0
    for size, k in zip(block_sizes, keep):
        pieces.append(weight[start : start + k])
        start += size
    return torch.cat(pieces, dim=0).contiguous()


def slice_linear_rows(linear: nn.Linear, block_sizes: list[int], keep: list[int]) -> None:
    """Keep a prefix of every head's output rows of a linear layer (weight and bias alike)."""
    linear.weight = nn.Parameter(block_prefix_rows(linear.weight, block_sizes, keep))
    if linear.bias is not None:
        linear.bias = nn.Parameter(block_prefix_rows(linear.bias, block_sizes, keep))
    linear.out_features = linear.weight.shape[0]


def rotate_interleaved_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs stored as (a0, b0, a1, b1, ...) with per-pair cos/sin [B, T, P]."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)


def turn_interleaved_pairs(x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """rotate_interleaved_pairs as one complex product: pair j of x [..., 2P] times phase[..., j] = cos + i sin
    (complex [..., P], in float32 or float64), in that precision, back in x's dtype. Eager decode launches three
    operations here instead of seven (at small batch a step costs its launches, not its bytes); under torch.compile
    the real formula is better, as the compiler fuses it and generates no code for complex numbers."""
    real = torch.float64 if phase.dtype == torch.complex128 else torch.float32
    return torch.view_as_real(complex_pairs(x, real) * phase).flatten(-2).to(x.dtype)


def phase_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos + i sin as complex (float64 for float64 tables, else float32), made once per forward: every layer gets the
    same (cos, sin) tensors, so the table is held on `cos` itself and lives exactly as long as the forward's tables."""
    held = getattr(cos, "_kvrewrite_phase", None)
    if held is None or held[0] is not sin:
        real = torch.float64 if cos.dtype == torch.float64 else torch.float32
        held = (sin, torch.complex(cos.to(real), sin.to(real)))
        cos._kvrewrite_phase = held
    return held[1]


def complex_pairs(x: torch.Tensor, real: torch.dtype) -> torch.Tensor:
    """x [..., 2P] in `real` precision as complex [..., P] (pair j = x[2j] + i x[2j + 1]); a copy only where x is not
    already dense in that precision at an even offset, as view_as_complex needs."""
    dense = x.to(real, memory_format=torch.contiguous_format).contiguous()  # one copy: widened and dense at once
    if dense.storage_offset() % 2:  # a dense slice of a larger tensor, at an odd element
        dense = dense.clone()
    # A dense tensor's size-1 dims may carry any stride, and view_as_complex has refused odd ones in some torch
    # releases: give them the dense strides (a view, no copy).
    strides = [1] * dense.dim()
    for i in range(dense.dim() - 2, -1, -1):
        strides[i] = strides[i + 1] * dense.shape[i + 1]
    dense = dense.as_strided(dense.shape, strides, dense.storage_offset())
    return torch.view_as_complex(dense.view(*dense.shape[:-1], dense.shape[-1] // 2, 2))
