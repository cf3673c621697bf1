"""latent: the cache holds an r-dim latent of the pre-RoPE key (folded into k_proj).

Attention rebuilds every cached key with a per-head up-projection (k_up, stored) and rotates it by its cache
position, so its run-time work grows with the context. Sliding-window caches renumber positions: not allowed there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvrewrite.adapters.base import AttentionFeatures, AttentionGeometry
from kvrewrite.key_modes.base import KeyMode, KeyTransform, register_key_mode
from kvrewrite.key_modes.rows import Linear64, map_rows, slice_linear_rows
from kvrewrite.method.key_transforms import latent_key_basis
from kvrewrite.method.statistics import LayerStatistics


def pair_order(head_dim: int, device: torch.device) -> torch.Tensor:
    """Head dims with each rotate_half rotary pair (j, j + d / 2) side by side, at 2j and 2j + 1."""
    half = torch.arange(head_dim // 2, device=device)
    return torch.stack([half, half + head_dim // 2], dim=-1).flatten()


@dataclass(frozen=True, eq=False)
class LatentKeyTransform(KeyTransform):
    down: torch.Tensor  # [n_kv, d, d] folded into k_proj
    up: torch.Tensor  # [n_kv, d, d] rebuilds the pre-RoPE key


@register_key_mode
class LatentMode(KeyMode):
    name = "latent"
    rebuilds_keys = True
    run_time_cost = 1.0  # r x d multiply-adds per cached token and KV head, every step
    context_independent = False
    run_time_sentence = (
        "`latent` layers rebuild every cached key from its latent and rotate it on every step, "
        "a cost that grows with the context"
    )

    def allowed_for(self, features: AttentionFeatures) -> bool:
        # latent rotates keys by cache index, which a sliding-window cache renumbers.
        return features.has_rope and not features.qk_norm and not features.sliding_layers

    def transform(self, objective: str, stats: LayerStatistics, geometry: AttentionGeometry) -> LatentKeyTransform:
        downs, ups, spectra = latent_key_basis(objective, stats, geometry.num_key_value_heads)
        return LatentKeyTransform(self.name, spectra, downs, ups)

    def fold(
        self, transform: LatentKeyTransform, q: Linear64, k: Linear64, geometry: AttentionGeometry
    ) -> tuple[Linear64, Linear64]:
        d = geometry.head_dim
        k_maps = [
            (slice(g * d, (g + 1) * d), lambda x, m=transform.down[g]: m.T @ x)
            for g in range(geometry.num_key_value_heads)
        ]
        return map_rows(q, ()), map_rows(k, k_maps)

    def stored_tensors(self, transform: LatentKeyTransform) -> dict[str, torch.Tensor]:
        return {"k_up": transform.up}

    def add_parameters(self, attn: nn.Module) -> None:
        attn.k_up = nn.Parameter(torch.empty(attn.num_kv_heads, attn.head_dim, attn.head_dim))

    def slice_query_key(self, attn: nn.Module, key_ranks: list[int]) -> None:
        slice_linear_rows(attn.k_proj, attn.key_ranks, key_ranks)  # queries stay whole: rotated at attention time

    def rebuild_keys(
        self,
        attn: nn.Module,
        latent: torch.Tensor,
        g: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        latent_map: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        up = attn.k_up[g, : latent.shape[-1]]
        if latent_map is None:
            return attn._apply_rope(latent @ up, cos, sin)
        # The cached code y reads as latent y @ matrix + offset (per batch row): fold the map into k_up once.
        matrix, offset = latent_map
        return attn._apply_rope(latent @ (matrix @ up)[:, None] + (offset @ up)[:, None, None], cos, sin)

    def rotated_key_pairs(
        self,
        attn: nn.Module,
        latent: torch.Tensor,
        g: int,
        phases: torch.Tensor,
        latent_map: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """rebuild_keys under rotate_half RoPE, with each rotary pair's dims side by side (pair_order; read them
        against queries in that order): latent [B, 1, S, r] -> keys [B, 1, S, d], each pair multiplied by
        its position's phase (`phases` [B, 1, S, d / 2], complex) in one pass, and the map's offset added in the
        product."""
        up = attn.k_up[g, : latent.shape[-1]]
        up = up[:, pair_order(up.shape[-1], up.device)]
        batch, _, n, _ = latent.shape
        if latent_map is None:
            keys = latent @ up
        else:
            matrix, offset = latent_map
            keys = torch.baddbmm((offset @ up)[:, None], latent[:, 0], matrix @ up).unsqueeze(1)
        d = up.shape[-1]
        pairs = torch.view_as_complex(keys.float().reshape(batch, 1, n, d // 2, 2)) * phases
        return torch.view_as_real(pairs).reshape(batch, 1, n, d).to(keys.dtype)
