"""post-rope: q and k are projected after RoPE by per-head [d, r] maps (ZACK §5.1).

Nothing folds into q_proj/k_proj; the checkpoint stores the maps (q_map, k_map) and the runtime applies them to
the rotated query and key of every new token: a small, context-independent cost per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvrewrite.adapters.base import AttentionFeatures, AttentionGeometry
from kvrewrite.key_modes.base import KeyMode, KeyTransform, register_key_mode
from kvrewrite.method.key_transforms import post_rope_maps
from kvrewrite.method.statistics import LayerStatistics


@dataclass(frozen=True, eq=False)
class BilinearKeyTransform(KeyTransform):
    q_map: torch.Tensor  # [n_kv, d, d]: query maps of each KV head's group
    k_map: torch.Tensor  # [n_kv, d, d]


def _post_rope_map(attn: nn.Module) -> torch.Tensor:
    """Block-diagonal [(H + H_kv) * d, Qsum + Ksum]: every head's kept [d, r] map, q heads then k heads.

    One matmul of the rotated [q | k] rows with it yields the packed query and key at once. Cached with the
    module's indices (dropped whenever the ranks change).
    """
    maps = attn._indices.get("post_rope_map") if attn._indices is not None else None
    if maps is not None and maps.dtype == attn.q_map.dtype and maps.device == attn.q_map.device:
        return maps
    g = attn.group_size
    with torch.no_grad():
        blocks = [attn.q_map[h // g, :, : attn.key_ranks[h // g]] for h in range(attn.num_heads)]
        blocks += [attn.k_map[h, :, : attn.key_ranks[h]] for h in range(attn.num_kv_heads)]
        maps = torch.block_diag(*blocks).contiguous()
    attn._index("empty", maps.device)  # make sure the index cache exists on this device
    attn._indices["post_rope_map"] = maps
    return maps


@register_key_mode
class PostRopeMode(KeyMode):
    name = "post-rope"
    run_time_cost = 0.1  # projects only the new token's q and k (context-independent)
    run_time_sentence = "`post-rope` layers project the rotated queries and keys by a small per-head map on every step"

    def allowed_for(self, features: AttentionFeatures) -> bool:
        return features.has_rope  # the maps come after any per-head q/k norm

    def transform(self, objective: str, stats: LayerStatistics, geometry: AttentionGeometry) -> BilinearKeyTransform:
        q_maps, k_maps, spectra = post_rope_maps(objective, stats, geometry.num_key_value_heads)
        return BilinearKeyTransform(self.name, spectra, q_maps, k_maps)

    def stored_tensors(self, transform: BilinearKeyTransform) -> dict[str, torch.Tensor]:
        return {"q_map": transform.q_map, "k_map": transform.k_map}

    def add_parameters(self, attn: nn.Module) -> None:
        d = attn.head_dim
        attn.q_map = nn.Parameter(torch.empty(attn.num_kv_heads, d, d))
        attn.k_map = nn.Parameter(torch.empty(attn.num_kv_heads, d, d))

    def slice_query_key(self, attn: nn.Module, key_ranks: list[int]) -> None:
        """q_proj/k_proj stay whole (RoPE needs every dim); the maps are cut to the ranks when used."""

    def project(
        self, attn: nn.Module, query: torch.Tensor, key: torch.Tensor, cos, sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = attn._apply_rope(attn._heads(query, attn.num_heads), cos, sin)
        k = attn._apply_rope(attn._heads(key, attn.num_kv_heads), cos, sin)
        rotated = torch.cat((q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2)), dim=-1)
        projected = rotated @ _post_rope_map(attn)  # q and k maps of every head in one matmul
        query, key = projected.split((attn.layout.query_offsets[-1], attn.layout.key_offsets[-1]), dim=-1)
        return query, key
