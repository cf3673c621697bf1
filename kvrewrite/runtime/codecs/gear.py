"""`gear` / `gear-l`: quantized backbone + low-rank residual (power iteration) + sparse outliers (GEAR).

Per block of G tokens: S = the top and bottom s/2 % entries (kept exactly, as int16/int32 positions and
float16 values); D = X - S is quantized KIVI-style; the quantization residual R = D - dequant(D) is
approximated by a rank-rho product A B^T found by power iteration, stored in float16. decode = dequant + A B^T
with the outlier entries put back. `gear-l` is the same without outliers.
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
    """Rank-`rank` approximation A B^T of each [G, C] matrix in residual [M, G, C] by subspace (power) iteration."""
    m, g, c = residual.shape
    generator = torch.Generator(device=residual.device).manual_seed(0)  # deterministic start, so coding is reproducible
    basis = torch.randn(m, c, rank, generator=generator, device=residual.device)
    for _ in range(max(iterations, 1)):
        left, _ = torch.linalg.qr(residual @ basis)  # [M, G, rank], orthonormal columns
        basis = residual.transpose(1, 2) @ left  # [M, C, rank]
    return left, basis


@register_codec
class GearCodec(LayerCodec):
    name = "gear"
    # rank: low-rank residual per block (power iteration); outlier_percent: top + bottom s% kept exactly.
    defaults = {"bits": 2, "rank": 2, "outlier_percent": 2.0, "power_iterations": 3, "group_size": 32, "residual": 32}

    @classmethod
    def validate(cls, params):
        check_bit_width(cls.name, "bits", params["bits"])
        super().validate(params)
        if params["rank"] < 0:
            raise InvalidArgumentError(f"codec {cls.name}: rank must be >= 0, got {params['rank']}")
        if not 0 <= params["outlier_percent"] < 50:
            raise InvalidArgumentError(f"codec {cls.name}: outlier_percent must be in [0, 50), got {params['outlier_percent']}")

    def __init__(self, config: CodecConfig, key_ranks, value_ranks):
        super().__init__(config, key_ranks, value_ranks)
        p = config.params
        self.bits, self.group_size = int(p["bits"]), int(p["group_size"])
        self.rank, self.iterations = int(p["rank"]), int(p["power_iterations"])
        self.outlier_share = float(p["outlier_percent"]) / 100.0

    def _outliers_per_end(self, side: str) -> int:
        return int(self.outlier_share * self.block_tokens * self.channels[side] / 2)

    def _index_dtype(self, side: str) -> torch.dtype:
        return torch.int16 if self.block_tokens * self.channels[side] <= torch.iinfo(torch.int16).max else torch.int32

    def encode(self, x, side):
        batch, n, g, c = x.shape
        coded = {}
        k = self._outliers_per_end(side)
        dense = x
        if k > 0:
            flat = x.reshape(batch, n, g * c)
            top = flat.topk(k, dim=-1).indices
            bottom = (-flat).topk(k, dim=-1).indices
            index = torch.cat([top, bottom], dim=-1)
            coded["outlier_index"] = index.to(self._index_dtype(side))
            coded["outlier_value"] = flat.gather(-1, index).to(META_DTYPE)
            dense = flat.scatter(-1, index, 0.0).reshape(batch, n, g, c)
        backbone = kivi_encode(dense, side, self.bits, self.group_size)
        coded.update(backbone)
        if self.rank > 0:
            residual = dense - kivi_decode(backbone, side, self.bits, self.group_size, g, c)
            left, right = low_rank(residual.reshape(batch * n, g, c), min(self.rank, g, c), self.iterations)
            coded["lowrank_left"] = left.reshape(batch, n, g, -1).to(META_DTYPE)
            coded["lowrank_right"] = right.reshape(batch, n, c, -1).to(META_DTYPE)
        return coded

    def decode(self, coded, side):
        g, c = self.block_tokens, self.channels[side]
        out = kivi_decode(coded, side, self.bits, self.group_size, g, c)
        if "lowrank_left" in coded:
            out = out + coded["lowrank_left"].float() @ coded["lowrank_right"].float().transpose(-1, -2)
        if "outlier_index" in coded:
            batch, n = out.shape[:2]
            index = coded["outlier_index"].long()
            out = out.reshape(batch, n, g * c).scatter(-1, index, coded["outlier_value"].float()).reshape(batch, n, g, c)
        return out

    def block_bytes(self, side):
        g, c = self.block_tokens, self.channels[side]
        total = kivi_block_bytes(side, self.bits, self.group_size, g, c)
        if self.rank > 0:
            total += (g + c) * min(self.rank, g, c) * 2
        k = self._outliers_per_end(side)
        if k > 0:
            total += 2 * k * (torch.empty((), dtype=self._index_dtype(side)).element_size() + 2)
        return total


@register_codec
class GearLCodec(GearCodec):
    """`gear-l`: GEAR without outliers (backbone + low-rank residual)."""

    name = "gear-l"
    defaults = {**GearCodec.defaults, "outlier_percent": 0.0}
