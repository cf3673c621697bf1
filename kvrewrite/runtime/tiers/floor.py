"""The floor tier: what an evicting cache keeps of a token it would otherwise drop.

Every head's latent dims are ordered by importance, so a token can keep a short prefix of them. With a floor,
re-scored eviction (kvrewrite.runtime.tiers.eviction) demotes instead of dropping: a token that loses its place in
the kept tier keeps the first `key_ranks[g]` dims of each head's key latent and `value_ranks[g]` of its value
latent, quantized per token to `bits`. Attention still reads every token, the demoted ones at the floor's ranks,
so a token that matters only later (the answer to a question asked after the context) is scored by the question
and read, where eviction decided before the question arrived and lost it for good.

The floor is coded like the kept tier: per channel centred and scaled (statistics of the first demoted tokens of
the sequence, float16 per layer and batch row), each head's block turned by the width's fixed rotation, then
asymmetric min/max per token over groups of `group_size` channels. Demoted tokens interleave positions, so each
keeps its cache index (int32). A floor never grows back: its tokens stay at the floor until the sequence ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.packing import SUPPORTED_BITS, packed_length

DEFAULT_FLOOR_BITS = 4


@dataclass(frozen=True)
class FloorPolicy:
    """Per layer, per KV head: the key and value latent dims a demoted token keeps; bits per number (None:
    float16)."""

    key_ranks: tuple[tuple[int, ...], ...]
    value_ranks: tuple[tuple[int, ...], ...]
    bits: int | None = DEFAULT_FLOOR_BITS

    def __post_init__(self) -> None:
        if len(self.key_ranks) != len(self.value_ranks):
            raise InvalidArgumentError("floor: key and value ranks cover different numbers of layers")
        if any(r < 0 for layer in self.key_ranks + self.value_ranks for r in layer):
            raise InvalidArgumentError("floor: ranks must be >= 0")
        if not any(r for layer in self.key_ranks for r in layer):
            raise InvalidArgumentError(
                "floor: a floor needs at least one key dim (attention cannot score a token without a key)"
            )
        if self.bits is not None and self.bits not in SUPPORTED_BITS:
            raise InvalidArgumentError(f"floor: bits must be one of {SUPPORTED_BITS} or None, got {self.bits!r}")


def floor_policy(
    kept_key_ranks: tuple[tuple[int, ...], ...],
    kept_value_ranks: tuple[tuple[int, ...], ...],
    key: int | list[int],
    value: int | list[int],
    bits: int | None = DEFAULT_FLOOR_BITS,
) -> FloorPolicy:
    """A floor of `key` / `value` dims per head (one width for every layer, or one per layer), never wider than the
    kept tier's ranks of that head."""
    n = len(kept_key_ranks)

    def widths(value_or_list, name: str) -> list[int]:
        widths = [value_or_list] * n if isinstance(value_or_list, int) else list(value_or_list)
        if len(widths) != n or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in widths):
            raise InvalidArgumentError(
                f"floor: {name} must be a whole number of dims >= 0, or one per layer ({n}), got {value_or_list!r}"
            )
        return widths

    key_widths, value_widths = widths(key, "key"), widths(value, "value")
    return FloorPolicy(
        key_ranks=tuple(tuple(min(w, r) for r in ranks) for w, ranks in zip(key_widths, kept_key_ranks)),
        value_ranks=tuple(tuple(min(w, r) for r in ranks) for w, ranks in zip(value_widths, kept_value_ranks)),
        bits=bits,
    )


def floor_columns(kept_ranks: tuple[int, ...], floor_ranks: tuple[int, ...], device) -> torch.Tensor:
    """Columns of the kept tier's packed latents (head blocks of `kept_ranks`) that the floor keeps: the first
    floor_ranks[g] of head g's block."""
    columns, start = [], 0
    for kept, floor in zip(kept_ranks, floor_ranks):
        columns.extend(range(start, start + floor))
        start += kept
    return torch.tensor(columns, dtype=torch.long, device=device)


def coded_token_bytes(channels: int, bits: int | None, group_size: int) -> int:
    """Bytes one token's `channels` latents occupy when coded per token: packed codes and a float16 scale and minimum
    per group of `group_size` channels, or float16 numbers without bits (the kept tier's formula too)."""
    if bits is None:
        return 2 * channels
    return packed_length(channels, bits) + 2 * 2 * -(-channels // group_size)


def floor_token_bytes(
    key_ranks: tuple[int, ...], value_ranks: tuple[int, ...], bits: int | None, group_size: int
) -> int:
    """Bytes one demoted token holds in one layer: both sides' floor latents (the formula the stored tensors must
    match) and its int32 cache index."""
    sides = [sum(r) for r in (key_ranks, value_ranks) if sum(r)]  # a side of width 0 holds nothing
    return sum(coded_token_bytes(c, bits, group_size) for c in sides) + 4
