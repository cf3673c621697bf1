"""`tada`: mean-centering across the KV heads of a layer, quantized deviations, per-layer bit widths (TaDA).

Per token, m = mean over heads of each head's latent (heads of lower rank are zero-padded and not counted
in dims they lack); the cache stores m and the deviations D_h = m - x_h, quantized KIVI-style (keys per
channel, values per token), at a bit width per layer and side that `search_tada_bits` picks under a budget
at compile time. The paper keeps m in 16 bits; with few KV heads (SmolLM2 has 3) that alone is a third of the fp16
cache, so m is quantized per token too (`mean_bits`, default 4: the deviations are taken from the stored
mean, so its rounding only widens their range, it adds no error of its own).
"""

from __future__ import annotations

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.base import SIDES, Latents, LayerCodec, relative_error
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.kivi import check_bit_width, kivi_block_bytes, kivi_decode, kivi_encode
from kvrewrite.runtime.codecs.registry import register_codec

BITS_TABLE = "tada.bits"  # int tensor [num_layers, 2]: deviation bits for (key, value)
TADA_WIDTHS = (2, 4, 8)  # the deviation widths the budget search chooses from


@register_codec
class TadaCodec(LayerCodec):
    name = "tada"
    # bits: the uniform deviation width when no budget search runs; mean_bits: the per-token shared mean.
    defaults = {"bits": 4, "mean_bits": 4, "group_size": 32, "residual": 32}
    takes_bits_budget = True

    def __init__(self, config: CodecConfig, key_ranks, value_ranks, bits: tuple[int, int] | None = None):
        super().__init__(config, key_ranks, value_ranks)
        uniform = int(config.params["bits"])
        self.bits = {"key": bits[0] if bits else uniform, "value": bits[1] if bits else uniform}
        self.mean_bits = int(config.params["mean_bits"])
        self.group_size = int(config.params["group_size"])
        self.mean_dims = {side: max(r, default=0) for side, r in self.ranks.items()}
        # For every packed channel: which mean dim it deviates from.
        self.dim_index = {
            side: torch.tensor([d for r in ranks for d in range(r)], dtype=torch.long)
            for side, ranks in self.ranks.items()
        }
        self.head_index = {
            side: torch.tensor([h for h, r in enumerate(ranks) for _ in range(r)], dtype=torch.long)
            for side, ranks in self.ranks.items()
        }

    @classmethod
    def validate(cls, params):
        check_bit_width(cls.name, "bits", params["bits"])
        check_bit_width(cls.name, "mean_bits", params["mean_bits"])
        super().validate(params)

    @classmethod
    def fit_tables(cls, config, latents, key_ranks, value_ranks, *, budget_bits=None, weights=None, progress=None):
        """Without a budget every layer keeps `bits`; with one, the per-layer widths of search_tada_bits."""
        if budget_bits is None:
            return {}, {}
        table, info = search_tada_bits(config, latents, key_ranks, value_ranks, budget_bits, weights)
        return {BITS_TABLE: table}, {**info, "bits": table.tolist()}

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
        mean_hat = kivi_decode(
            {k[5:]: v for k, v in coded.items() if k.startswith("mean_")},
            "value",
            self.mean_bits,
            self.group_size,
            g,
            self.mean_dims[side],
        )
        deviation = kivi_decode(
            {k[4:]: v for k, v in coded.items() if k.startswith("dev_")}, side, self.bits[side], self.group_size, g, c
        )
        return mean_hat[..., self.dim_index[side].to(mean_hat.device)] - deviation

    def block_bytes(self, side):
        g = self.block_tokens
        return kivi_block_bytes("value", self.mean_bits, self.group_size, g, self.mean_dims[side]) + kivi_block_bytes(
            side, self.bits[side], self.group_size, g, self.channels[side]
        )


def search_tada_bits(
    config: CodecConfig, latents: Latents, key_ranks, value_ranks, budget_bits: float, weights=None
) -> tuple[torch.Tensor, dict]:
    """Greedy marginal search: start every (layer, side) at 2 bits and repeatedly raise the one with the largest
    drop in weighted calibration error per added byte (2 -> 4 -> 8) while the whole cache stays within
    `budget_bits` stored bits per latent element (codes, means, scales and zero points all counted).

    weights: (layer, side) -> multiplier on that side's relative error (the sensitivity pass's KL weights).
    The paper runs a random search on task accuracy; this is its cheaper deterministic counterpart.
    """
    n_layers = len(latents)
    block = config.block_tokens
    elements = sum(sum(k) + sum(v) for k, v in zip(key_ranks, value_ranks)) * block
    errors, costs = {}, {}
    for i in range(n_layers):
        for bits in TADA_WIDTHS:
            codec = TadaCodec(config, key_ranks[i], value_ranks[i], (bits, bits))
            for side in SIDES:
                if codec.channels[side] == 0:
                    errors[(i, side, bits)], costs[(i, side, bits)] = 0.0, 0
                    continue
                weight = weights[(i, side)] if weights else 1.0
                errors[(i, side, bits)] = weight * relative_error(codec, latents[i][side], side)
                costs[(i, side, bits)] = codec.block_bytes(side)
    choice = {(i, side): TADA_WIDTHS[0] for i in range(n_layers) for side in SIDES}

    def total_bits() -> float:
        return 8 * sum(costs[(i, side, b)] for (i, side), b in choice.items()) / elements

    if total_bits() > budget_bits + 1e-9:
        raise InvalidArgumentError(
            f"kv_bits_budget {budget_bits} is below what tada needs at 2 bits everywhere ({total_bits():.2f} bits per "
            "cached element, metadata included)"
        )
    while True:
        best, best_gain = None, 0.0
        for key, bits in choice.items():
            if bits == TADA_WIDTHS[-1]:
                continue
            nxt = TADA_WIDTHS[TADA_WIDTHS.index(bits) + 1]
            extra = costs[(*key, nxt)] - costs[(*key, bits)]
            trial = total_bits() + 8 * extra / elements
            if trial > budget_bits + 1e-9:
                continue
            gain = (errors[(*key, bits)] - errors[(*key, nxt)]) / max(extra, 1)
            if gain > best_gain:
                best, best_gain = key, gain
        if best is None:
            break
        choice[best] = TADA_WIDTHS[TADA_WIDTHS.index(choice[best]) + 1]
    table = torch.tensor([[choice[(i, "key")], choice[(i, "value")]] for i in range(n_layers)], dtype=torch.int32)
    return table, {"bits_per_element": round(total_bits(), 4), "budget_bits": budget_bits}
