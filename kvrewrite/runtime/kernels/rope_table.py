"""cos/sin of cache positions 0..S-1 for layers that rotate keys at attention time, computed once per model.

A `latent` layer rotates every cached key by its cache index on every step. Asking the rotary module for S
positions in each layer and step costs S x d transcendentals per layer; the values only depend on the position,
so one table serves every layer and step: [S, d] for the Triton decode kernel, transposed to [d, S] for the tile
loops of kernels.latent_decode. It grows in steps of GROW positions. Rotary types whose frequencies depend on the sequence length (dynamic NTK,
longrope) are computed per call instead.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrewrite.adapters.base import ArchitectureAdapter

GROW = 4096
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def _computed(
    rotary: nn.Module, like: torch.Tensor, length: int, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(length, device=like.device)[None]
    cos, sin = rotary(like, positions)  # [1, S, d]
    if transposed:
        return cos[0].transpose(0, 1).contiguous(), sin[0].transpose(0, 1).contiguous()
    return cos[0].contiguous(), sin[0].contiguous()


def rope_table(
    rotary: nn.Module, like: torch.Tensor, length: int, transposed: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) in `like`'s dtype and device for cache positions 0.. (at least `length` of them): [d, >= length]
    when transposed, else [>= length, d]."""
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if any(kind in rope_type for kind in _LENGTH_DEPENDENT):
        return _computed(rotary, like, length, transposed)
    tables = rotary.__dict__.setdefault("_kvrewrite_rope_tables", {})
    key = (like.device, like.dtype, transposed)
    held = tables.get(key)
    if held is None or held[0].shape[1 if transposed else 0] < length:
        held = _computed(rotary, like, -(-length // GROW) * GROW, transposed)
        tables[key] = held
    return held


def rope_phases(rotary: nn.Module, like: torch.Tensor, length: int) -> torch.Tensor:
    """complex64 [>= length, d / 2] on `like`'s device: for cache position p and rotary pair j, cos + i sin of its
    angle (times the rotary's attention scaling). Under rotate_half, dims (j, j + d / 2) of a head form pair j, and
    rotating a key is multiplying that pair, read as one complex number, by its phase: one pass over the keys."""
    cos, sin = rope_table(rotary, like.new_empty(0, dtype=torch.float32), length, transposed=False)
    tables = rotary.__dict__.setdefault("_kvrewrite_rope_phases", {})
    held = tables.get(like.device)
    if held is None or held[0] is not cos:  # a table that grew, or one computed per call
        half = cos.shape[-1] // 2
        held = (cos, torch.complex(cos[:, :half], sin[:, :half]))
        tables[like.device] = held
    return held[1]


def rotates_half_pairs(module: nn.Module) -> bool:
    """Whether the attention module rotates by the base adapter's rotate_half over the whole head, with HF's tables
    (each rotary pair's angle in both halves): then dims (j, j + d / 2) rotate as one complex number, which
    rope_phases and the paired key paths assume. An adapter with its own apply_rope takes the unpaired paths."""
    return getattr(module._apply_rope, "__func__", None) is ArchitectureAdapter.apply_rope
