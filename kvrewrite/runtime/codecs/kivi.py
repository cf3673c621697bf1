"""`int4` / `int2`: KIVI's asymmetric quantization (keys per channel over a block of tokens, values per token
over groups of channels), and the KIVI helpers that tada, gear and the eviction tier build on."""

from __future__ import annotations

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.base import LayerCodec
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.packing import (
    SUPPORTED_BITS,
    dequantize_minmax,
    pack_bits,
    packed_length,
    quantize_minmax,
    unpack_bits,
)
from kvrewrite.runtime.codecs.readout import QuantizedBlocks
from kvrewrite.runtime.codecs.registry import register_codec


def check_bit_width(codec: str, key: str, value) -> None:
    if value not in SUPPORTED_BITS:
        raise InvalidArgumentError(f"codec {codec}: {key} must be 1, 2, 4 or 8, got {value}")


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


@register_codec
class KiviCodec(LayerCodec):
    """`int4`: KIVI at 4 bits (any of 1/2/4/8 with `bits=`)."""

    name = "int4"
    defaults = {"bits": 4, "group_size": 32, "residual": 32}

    def __init__(self, config: CodecConfig, key_ranks: list[int], value_ranks: list[int]):
        super().__init__(config, key_ranks, value_ranks)
        self.bits = int(config.params["bits"])
        self.group_size = int(config.params["group_size"])

    @classmethod
    def validate(cls, params):
        check_bit_width(cls.name, "bits", params["bits"])
        super().validate(params)

    def encode(self, x, side):
        return kivi_encode(x, side, self.bits, self.group_size)

    def decode(self, coded, side):
        return kivi_decode(coded, side, self.bits, self.group_size, self.block_tokens, self.channels[side])

    def block_bytes(self, side):
        return kivi_block_bytes(side, self.bits, self.group_size, self.block_tokens, self.channels[side])

    def fused_layout(self):
        # kivi_encode's store is exactly QuantizedBlocks: attention dequantises it block by block as it reads.
        return QuantizedBlocks(self.bits, self.block_tokens, self.group_size)


@register_codec
class Int2Codec(KiviCodec):
    """`int2`: KIVI at 2 bits."""

    name = "int2"
    defaults = {"bits": 2, "group_size": 32, "residual": 32}
