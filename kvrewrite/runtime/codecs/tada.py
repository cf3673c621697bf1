"""`tada`: mean-centering across the KV heads of a layer, quantized deviations, per-layer bit widths (TaDA).

Per token, m = mean over heads of each head's latent (heads of lower rank are zero-padded and not counted
in dims they lack); the cache stores m and the deviations D_h = m - x_h, quantized KIVI-style (keys per
channel, values per token), at a bit width per layer and side that `fitting.search_tada_bits` picks under a
budget. The paper keeps m in 16 bits; with few KV heads (SmolLM2 has 3) that alone is a third of the fp16
cache, so m is quantized per token too (`mean_bits`, default 4: the deviations are taken from the stored
mean, so its rounding only widens their range, it adds no error of its own).
"""

from __future__ import annotations

import torch

from kvrewrite.runtime.codecs.base import LayerCodec, kivi_block_bytes, kivi_decode, kivi_encode
from kvrewrite.runtime.codecs.config import CodecConfig

BITS_TABLE = "tada.bits"  # int tensor [num_layers, 2]: deviation bits for (key, value)


class TadaCodec(LayerCodec):
    def __init__(self, config: CodecConfig, key_ranks, value_ranks, bits: tuple[int, int] | None = None):
        super().__init__(config, key_ranks, value_ranks)
        uniform = int(config.params["bits"])
        self.bits = {"key": bits[0] if bits else uniform, "value": bits[1] if bits else uniform}
        self.mean_bits = int(config.params["mean_bits"])
        self.group_size = int(config.params["group_size"])
        self.mean_dims = {side: max(r, default=0) for side, r in self.ranks.items()}
        # For every packed channel: which mean dim it deviates from.
        self.dim_index = {side: torch.tensor([d for r in ranks for d in range(r)], dtype=torch.long) for side, ranks in self.ranks.items()}
        self.head_index = {side: torch.tensor([h for h, r in enumerate(ranks) for _ in range(r)], dtype=torch.long) for side, ranks in self.ranks.items()}

    @classmethod
    def for_layer(cls, config, layer_idx, key_ranks, value_ranks, tables):
        table = tables.get(BITS_TABLE)
        bits = tuple(int(b) for b in table[layer_idx].tolist()) if table is not None else None
        return cls(config, key_ranks, value_ranks, bits)

    def _mean(self, x: torch.Tensor, side: str) -> torch.Tensor:
        """Per token, the mean over heads of each latent dim (counting only heads that have that dim)."""
        dims, idx = self.mean_dims[side], self.dim_index[side].to(x.device)
        total = x.new_zeros(*x.shape[:-1], dims).index_add_(-1, idx, x)
        count = torch.zeros(dims, device=x.device).index_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))
        return total / count.clamp_min(1)

    def encode(self, x, side):
        mean = self._mean(x, side)
        coded_mean = kivi_encode(mean, "value", self.mean_bits, self.group_size)
        mean_hat = kivi_decode(coded_mean, "value", self.mean_bits, self.group_size, x.shape[2], self.mean_dims[side])
        # Deviations from the *stored* mean, so the mean's own rounding does not add to the error.
        deviation = mean_hat[..., self.dim_index[side].to(x.device)] - x
        coded_dev = kivi_encode(deviation, side, self.bits[side], self.group_size)
        return {**{f"mean_{k}": v for k, v in coded_mean.items()}, **{f"dev_{k}": v for k, v in coded_dev.items()}}

    def decode(self, coded, side):
        g, c = self.block_tokens, self.channels[side]
        mean_hat = kivi_decode({k[5:]: v for k, v in coded.items() if k.startswith("mean_")}, "value", self.mean_bits,
                               self.group_size, g, self.mean_dims[side])
        deviation = kivi_decode({k[4:]: v for k, v in coded.items() if k.startswith("dev_")}, side, self.bits[side],
                                self.group_size, g, c)
        return mean_hat[..., self.dim_index[side].to(mean_hat.device)] - deviation

    def block_bytes(self, side):
        g = self.block_tokens
        return (kivi_block_bytes("value", self.mean_bits, self.group_size, g, self.mean_dims[side])
                + kivi_block_bytes(side, self.bits[side], self.group_size, g, self.channels[side]))
