"""`gear` / `gear-l`: GEAR (quantized backbone + low-rank residual per KV head + sparse outliers per vector).

One coded block of G tokens is GEAR's streaming buffer of n_b tokens: the cache keeps new tokens in float16 and
codes them when G have arrived (defaults G = n_b = 64 with no extra float16 window, `residual` = 0: the paper's
2-bit setting, a KIVI backbone with g = 64 and n_b = 64). Per block, as the paper's Algorithm 1 does per buffer:

1. S = Filter_s(X): in every vector, the top and bottom s/2 % of its entries (rounded to the nearest count), the
   vectors aligned with the backbone's groups: keys per channel (the block's G tokens), values per token (its C
   channels). Stored exactly: float16 values and their positions inside the vector (uint8 up to 256 entries).
2. D = Quant_b(X - S): KIVI (keys per channel over the block, values per token in groups of G channels). The
   outlier positions are filled with the mean of their quantization group's other entries, not 0, so the group's
   range is that of the entries it really codes (a 0 would widen a key channel whose entries are all far from 0).
3. L_h = A_h B_h^T ~ R_h, R = X - S - dequant(D), for each KV head h (its slice of channels): rank
   min(rank, G, r_h) by power iteration, A_h [G, rank] with orthonormal columns and B_h = R_h^T A_h, float16.

decode = dequant(D) + L, with the outlier entries written back exactly (so R is taken as 0 there: the low-rank
part spends nothing on entries the decoder overwrites, and can then only lower the backbone's error).
`gear-l` is the same without outliers.
"""

from __future__ import annotations

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.base import LayerCodec
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.kivi import check_bit_width, kivi_block_bytes, kivi_decode, kivi_encode
from kvrewrite.runtime.codecs.packing import META_DTYPE
from kvrewrite.runtime.codecs.registry import register_codec


def low_rank(residual: torch.Tensor, rank: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-`rank` approximation A B^T of each [G, C] matrix in residual [M, G, C] by power (subspace) iteration.

    GEAR's Algorithm 2 orthonormalises only in its last iteration; doing it in every iteration spans the same
    subspace (a QR only changes the basis) in exact arithmetic and keeps the columns apart in floating point.
    A has orthonormal columns and B = R^T A, so A B^T = A A^T R projects R: it never adds error.
    """
    m, g, c = residual.shape
    generator = torch.Generator(device=residual.device).manual_seed(0)  # deterministic start, so coding is reproducible
    basis = torch.randn(m, c, rank, generator=generator, device=residual.device)
    for _ in range(max(iterations, 1)):
        left, _ = torch.linalg.qr(residual @ basis)  # [M, G, rank], orthonormal columns
        basis = residual.transpose(1, 2) @ left  # [M, C, rank]
    return left, basis


def position_dtype(length: int) -> torch.dtype:
    """The smallest integer type that holds a position inside a vector of `length` entries."""
    if length <= 256:
        return torch.uint8
    return torch.int16 if length <= torch.iinfo(torch.int16).max + 1 else torch.int32


@register_codec
class GearCodec(LayerCodec):
    name = "gear"
    # rank: per KV head and block (power iteration); outlier_percent: s, top + bottom s/2 % of every vector kept exactly.
    defaults = {"bits": 2, "rank": 2, "outlier_percent": 2.0, "power_iterations": 3, "group_size": 64, "residual": 0}

    @classmethod
    def validate(cls, params):
        check_bit_width(cls.name, "bits", params["bits"])
        super().validate(params)
        if params["rank"] < 0:
            raise InvalidArgumentError(f"codec {cls.name}: rank must be >= 0, got {params['rank']}")
        if not 0 <= params["outlier_percent"] < 50:
            raise InvalidArgumentError(
                f"codec {cls.name}: outlier_percent must be in [0, 50), got {params['outlier_percent']}"
            )

    def __init__(self, config: CodecConfig, key_ranks, value_ranks):
        super().__init__(config, key_ranks, value_ranks)
        p = config.params
        self.bits, self.group_size = int(p["bits"]), int(p["group_size"])
        self.rank, self.iterations = int(p["rank"]), int(p["power_iterations"])
        self.outlier_share = float(p["outlier_percent"]) / 100.0

    # ---- layout ------------------------------------------------------------------------------------------

    def vector_length(self, side: str) -> int:
        """Entries per outlier vector: a key channel's G tokens, a value token's C channels."""
        return self.block_tokens if side == "key" else self.channels[side]

    def outliers_per_end(self, side: str) -> int:
        """Outliers taken from each end (top and bottom) of every vector: s/2 % of its length, rounded."""
        return int(self.outlier_share / 2 * self.vector_length(side) + 0.5)

    def head_ranks(self, side: str) -> list[tuple[int, int, int]]:
        """(first channel, end channel, low-rank rank) of every KV head with a low-rank part."""
        off, g = self.offsets[side], self.block_tokens
        heads = [(off[h], off[h + 1], min(self.rank, g, off[h + 1] - off[h])) for h in range(len(off) - 1)]
        return [head for head in heads if head[2] > 0]

    # ---- coding ------------------------------------------------------------------------------------------

    def _group_mean_fill(self, x: torch.Tensor, outlier: torch.Tensor, side: str) -> torch.Tensor:
        """x with each outlier entry replaced by the mean of the other entries of its quantization group."""
        batch, n, g, c = x.shape
        kept = (~outlier).to(x.dtype)
        if side == "key":  # one group per channel over the block's tokens
            total, count = (x * kept).sum(2, keepdim=True), kept.sum(2, keepdim=True)
            return torch.where(outlier, total / count.clamp_min(1), x)
        group = self.group_size
        pad = (-c) % group
        xk, kp = torch.nn.functional.pad(x * kept, (0, pad)), torch.nn.functional.pad(kept, (0, pad))
        total = xk.reshape(batch, n, g, -1, group).sum(-1)
        count = kp.reshape(batch, n, g, -1, group).sum(-1)
        mean = (total / count.clamp_min(1)).repeat_interleave(group, -1)[..., :c]
        return torch.where(outlier, mean, x)

    def encode(self, x, side):
        batch, n, g, c = x.shape
        coded = {}
        k = self.outliers_per_end(side)
        dense, outlier = x, None
        if k > 0:
            dim = 2 if side == "key" else 3
            order = x.argsort(dim=dim)
            length = x.shape[dim]
            keep = torch.cat([order.narrow(dim, 0, k), order.narrow(dim, length - k, k)], dim=dim)  # disjoint ends
            outlier = torch.zeros_like(x, dtype=torch.bool).scatter(dim, keep, True)
            coded["outlier_position"] = keep.to(position_dtype(length))
            coded["outlier_value"] = x.gather(dim, keep).to(META_DTYPE)
            dense = self._group_mean_fill(x, outlier, side)
        backbone = kivi_encode(dense, side, self.bits, self.group_size)
        coded.update(backbone)
        heads = self.head_ranks(side)
        if heads:
            residual = dense - kivi_decode(backbone, side, self.bits, self.group_size, g, c)
            if outlier is not None:
                residual = residual.masked_fill(outlier, 0.0)  # decode writes these entries back exactly
            lefts, rights = [], []
            for start, end, rank in heads:
                left, right = low_rank(
                    residual[..., start:end].reshape(batch * n, g, end - start), rank, self.iterations
                )
                lefts.append(left.reshape(batch, n, g, rank))
                rights.append(right.reshape(batch, n, (end - start) * rank))
            coded["lowrank_left"] = torch.cat(lefts, -1).to(META_DTYPE)  # [B, n, G, sum of ranks]
            coded["lowrank_right"] = torch.cat(rights, -1).to(META_DTYPE)  # [B, n, sum of r_h * rank_h]
        return coded

    def decode(self, coded, side):
        g, c = self.block_tokens, self.channels[side]
        out = kivi_decode(coded, side, self.bits, self.group_size, g, c)
        if "lowrank_left" in coded:
            batch, n = out.shape[:2]
            left, right = coded["lowrank_left"].float(), coded["lowrank_right"].float()
            col, flat = 0, 0
            for start, end, rank in self.head_ranks(side):
                a = left[..., col : col + rank]  # [B, n, G, rank]
                b = right[..., flat : flat + (end - start) * rank].reshape(batch, n, end - start, rank)
                out[..., start:end] += a @ b.transpose(-1, -2)
                col, flat = col + rank, flat + (end - start) * rank
        if "outlier_position" in coded:
            dim = 2 if side == "key" else 3
            out = out.scatter(dim, coded["outlier_position"].long(), coded["outlier_value"].float())
        return out

    def block_bytes(self, side):
        g, c = self.block_tokens, self.channels[side]
        total = kivi_block_bytes(side, self.bits, self.group_size, g, c)
        total += sum((g + end - start) * rank * 2 for start, end, rank in self.head_ranks(side))  # float16 A_h, B_h
        k = self.outliers_per_end(side)
        if k > 0:
            vectors = c if side == "key" else g
            position = torch.empty((), dtype=position_dtype(self.vector_length(side))).element_size()
            total += vectors * 2 * k * (position + 2)  # a position and a float16 value per outlier
        return total


@register_codec
class GearLCodec(GearCodec):
    """`gear-l`: GEAR without outliers (backbone + low-rank residual)."""

    name = "gear-l"
    defaults = {**GearCodec.defaults, "outlier_percent": 0.0}
