"""What attention reads from a codec cache when it attends to the coded blocks directly (no whole-store decode).

A codec whose blocks attention can read in place declares their layout with `LayerCodec.fused_layout()`; today
that is KIVI's (`QuantizedBlocks`, codecs int4/int2). For such a codec the cache hands attention a
`CodedReadout` (the packed blocks plus the float16 window) instead of decoded tensors, and the attention kernels
(kernels.coded_attention on CPU, kernels.triton_coded_attention on CUDA) dequantise block by block as they attend.
Codecs without a layout (gear, csr, tada) keep the decode path: the cache returns decode(store) + window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedBlocks:
    """KIVI's store, per layer and side, for blocks of `block_tokens` tokens and C packed channels:

    - "codes": uint8 [B, n, ceil(G * C * bits / 8)], the block's [G, C] codes token-major, packed 8 // bits per
      byte along the flattened block, lowest bits first (packing.pack_bits);
    - keys: "scale" and "low" float16 [B, n, C], one per channel per block;
    - values: "scale" and "low" float16 [B, n, G, ceil(C / value_group)], one per token per group of
      `value_group` consecutive packed channels (groups run across KV-head boundaries).

    The value of a code is code * scale + low, computed in float32 (packing.dequantize_minmax).
    """

    bits: int
    block_tokens: int
    value_group: int


@dataclass(frozen=True)
class CodedReadout:
    """One layer's cache as one forward's attention reads it: the blocks coded by earlier updates, then the float16
    window that holds every later token (this forward's own tokens included), in cache order."""

    layout: QuantizedBlocks
    keys: dict[str, torch.Tensor] | None  # coded key blocks (None: nothing coded yet)
    values: dict[str, torch.Tensor] | None
    key_window: torch.Tensor  # [B, 1, W, sum key ranks] float16
    value_window: torch.Tensor  # [B, 1, W, sum value ranks] float16

    @property
    def coded_blocks(self) -> int:
        return 0 if self.keys is None else self.keys["codes"].shape[1]

    @property
    def coded_tokens(self) -> int:
        return self.coded_blocks * self.layout.block_tokens

    @property
    def length(self) -> int:
        return self.coded_tokens + self.key_window.shape[-2]
