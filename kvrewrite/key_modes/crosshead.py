"""crosshead: per rotary frequency, a complex-linear mix across the layer's KV heads (method/crosshead_keys.py).

The mix commutes with RoPE, so it folds into q_proj/k_proj (zero extra ops). The layer then caches ONE shared
key block that every query head scores against; its rank is key_ranks[0] (the other KV heads' entries are 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvrewrite.adapters.base import AttentionFeatures, AttentionGeometry
from kvrewrite.key_modes.base import KeyMode, KeyTransform, register_key_mode
from kvrewrite.key_modes.freq import rotate_stored_pairs
from kvrewrite.key_modes.rows import Linear64, slice_linear_rows
from kvrewrite.method.crosshead_keys import crosshead_maps
from kvrewrite.method.statistics import LayerStatistics
from kvrewrite.spec import LayerSpec


@dataclass(frozen=True, eq=False)
class CrossheadKeyTransform(KeyTransform):
    freq_order: torch.Tensor  # [1, n_kv*d/2] frequency of every stored pair of the shared block
    k_fold: torch.Tensor  # [n_kv*d, n_kv*d] new k_proj rows from the old ones
    q_fold: torch.Tensor  # [n_q, n_kv*d, d] new rows of each query head


@register_key_mode
class CrossheadMode(KeyMode):
    name = "crosshead"
    rank_step = 2
    shared_key_block = True
    run_time_cost = 0.0
    run_time_sentence = (
        "`crosshead` layers do nothing extra at run time: the shared key block is folded into the projections"
    )

    def allowed_for(self, features: AttentionFeatures) -> bool:
        # Mixes heads inside k_proj: its fold has no bias path (yet); the latent's cache-index rule applies too.
        return (
            features.has_rope
            and not features.qk_norm
            and not features.sliding_layers
            and not (features.q_bias or features.k_bias)
        )

    def transform(self, objective: str, stats: LayerStatistics, geometry: AttentionGeometry) -> CrossheadKeyTransform:
        maps = crosshead_maps(stats, geometry)  # query-aware for both objectives (no paper version exists)
        return CrossheadKeyTransform(self.name, maps.spectrum[None], maps.freq_order[None], maps.k_fold, maps.q_fold)

    def fold(
        self, transform: CrossheadKeyTransform, q: Linear64, k: Linear64, geometry: AttentionGeometry
    ) -> tuple[Linear64, Linear64]:
        # Every query head now scores against the whole shared key block: n_kv*d rows per head at full rank.
        (w_q, b_q), (w_k, b_k) = q, k
        d, heads = geometry.head_dim, range(geometry.num_attention_heads)
        new_k = (transform.k_fold @ w_k, None if b_k is None else transform.k_fold @ b_k)
        new_q = (
            torch.cat([transform.q_fold[h] @ w_q[h * d : (h + 1) * d] for h in heads]),
            None if b_q is None else torch.cat([transform.q_fold[h] @ b_q[h * d : (h + 1) * d] for h in heads]),
        )
        return new_q, new_k

    def stored_order(self, transform: CrossheadKeyTransform) -> list[list[int]]:
        return transform.freq_order.tolist()

    def key_rank_problems(self, index: int, layer: LayerSpec, num_kv_heads: int, head_dim: int) -> list[str]:
        problems = []
        shared, rest = layer.key_ranks[0], layer.key_ranks[1:]
        if any(rest) or not (0 <= shared <= num_kv_heads * head_dim) or shared % 2:
            problems.append(
                f"layer {index}: crosshead key ranks must be [R, 0, ...] with even R <= {num_kv_heads * head_dim}, "
                f"got {layer.key_ranks}"
            )
        order = layer.freq_order or []
        if len(order) != 1 or sorted(order[0]) != sorted(j for j in range(head_dim // 2) for _ in range(num_kv_heads)):
            problems.append(
                f"layer {index}: crosshead freq_order must be one list holding each of range({head_dim // 2}) "
                f"{num_kv_heads} times"
            )
        return problems

    def query_width(self, num_kv_heads: int, head_dim: int) -> int:
        return num_kv_heads * head_dim  # each query head scores against the whole shared block

    def slice_query_key(self, attn: nn.Module, key_ranks: list[int]) -> None:
        slice_linear_rows(attn.k_proj, attn.key_ranks, key_ranks)
        slice_linear_rows(attn.q_proj, [attn.key_ranks[0]] * attn.num_heads, [key_ranks[0]] * attn.num_heads)

    def indices(self, attn: nn.Module) -> dict[str, torch.Tensor]:
        shared = attn.freq_order[0][: attn.key_ranks[0] // 2]
        return {
            "key_pair_freq": torch.tensor(shared, dtype=torch.long),
            "query_pair_freq": torch.tensor(shared * attn.num_heads, dtype=torch.long),
        }

    def project(
        self, attn: nn.Module, query: torch.Tensor, key: torch.Tensor, cos, sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_stored_pairs(attn, query, key, cos, sin)
