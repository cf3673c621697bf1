"""The codec interface for one cache layer, and KIVI-style quantization that several codecs build on.

A codec codes one side (keys or values) of one layer's packed latents, G tokens at a time: encode takes
x [B, n, G, C] (n blocks of G tokens, C = the layer's packed channels, the sum of its KV heads' ranks) and
returns a dict of tensors whose first two dims are [B, n]; decode inverts it. Everything in that dict is
what the cache stores, so the cache's size is read off those tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from itertools import accumulate

import torch

from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.packing import dequantize_minmax, pack_bits, packed_length, quantize_minmax, unpack_bits

SIDES = ("key", "value")


class LayerCodec(ABC):
    def __init__(self, config: CodecConfig, key_ranks: list[int], value_ranks: list[int]):
        self.config = config
        self.ranks = {"key": list(key_ranks), "value": list(value_ranks)}
        self.channels = {side: sum(r) for side, r in self.ranks.items()}
        self.offsets = {side: [0, *accumulate(r)] for side, r in self.ranks.items()}
        self.block_tokens = config.block_tokens

    @classmethod
    def for_layer(cls, config: CodecConfig, layer_idx: int, key_ranks: list[int], value_ranks: list[int],
                  tables: dict[str, torch.Tensor]) -> "LayerCodec":
        """The codec of one layer; codecs with trained tables read theirs from `tables`."""
        return cls(config, key_ranks, value_ranks)

    @abstractmethod
    def encode(self, x: torch.Tensor, side: str) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def decode(self, coded: dict[str, torch.Tensor], side: str) -> torch.Tensor:
        """-> float32 [B, n, G, C]."""

    @abstractmethod
    def block_bytes(self, side: str) -> int:
        """Bytes one coded block of G tokens occupies (one batch row): the formula the stored tensors must match."""


# ---- KIVI: keys per channel over a block of tokens, values per token over groups of channels -------------


def kivi_encode(x: torch.Tensor, side: str, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    batch, n, g, c = x.shape
    if side == "key":
        codes, scale, low = quantize_minmax(x, (2,), bits)  # one (scale, min) per channel per block
        scale, low = scale.squeeze(2), low.squeeze(2)  # [B, n, C]
    else:
        groups = -(-c // group_size)
        pad = groups * group_size - c
        # Padding repeats the last channel so it never widens a group's range; the padded codes are not stored.
        xp = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1) if pad else x
        codes, scale, low = quantize_minmax(xp.reshape(batch, n, g, groups, group_size), (4,), bits)
        codes = codes.reshape(batch, n, g, groups * group_size)[..., :c]
        scale, low = scale.squeeze(-1), low.squeeze(-1)  # [B, n, G, groups]
    return {"codes": pack_bits(codes.reshape(batch, n, g * c), bits), "scale": scale, "low": low}


def kivi_decode(coded: dict[str, torch.Tensor], side: str, bits: int, group_size: int, g: int, c: int) -> torch.Tensor:
    packed = coded["codes"]
    batch, n = packed.shape[:2]
    codes = unpack_bits(packed, bits, g * c).reshape(batch, n, g, c)
    if side == "key":
        return dequantize_minmax(codes, coded["scale"].unsqueeze(2), coded["low"].unsqueeze(2))
    index = torch.arange(c, device=packed.device) // group_size  # channel -> its group's scale
    return dequantize_minmax(codes, coded["scale"][..., index], coded["low"][..., index])


def kivi_block_bytes(side: str, bits: int, group_size: int, g: int, c: int) -> int:
    """Packed codes + float16 scale and minimum per channel (keys) or per token and channel group (values)."""
    meta = c if side == "key" else g * -(-c // group_size)
    return packed_length(g * c, bits) + 2 * 2 * meta


class KiviCodec(LayerCodec):
    """`int4` / `int2`: KIVI's asymmetric quantization (keys per channel, values per token)."""

    def __init__(self, config: CodecConfig, key_ranks: list[int], value_ranks: list[int]):
        super().__init__(config, key_ranks, value_ranks)
        self.bits = int(config.params["bits"])
        self.group_size = int(config.params["group_size"])

    def encode(self, x, side):
        return kivi_encode(x, side, self.bits, self.group_size)

    def decode(self, coded, side):
        return kivi_decode(coded, side, self.bits, self.group_size, self.block_tokens, self.channels[side])

    def block_bytes(self, side):
        return kivi_block_bytes(side, self.bits, self.group_size, self.block_tokens, self.channels[side])
