"""freq: keep whole rotary frequency pairs ranked by score energy.

A pure selection of pairs commutes with RoPE, so it folds into q_proj/k_proj (pairs stored interleaved, most
important first) and the runtime rotates stored pair i with its own frequency: no extra work at decode time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvrewrite.adapters.base import AttentionFeatures, AttentionGeometry
from kvrewrite.key_modes.base import KeyMode, KeyTransform, register_key_mode
from kvrewrite.key_modes.rows import (
    Linear64,
    map_rows,
    phase_table,
    rotate_interleaved_pairs,
    turn_interleaved_pairs,
)
from kvrewrite.method.key_transforms import frequency_pair_selection, interleaved_pair_rows
from kvrewrite.method.statistics import LayerStatistics
from kvrewrite.spec import LayerSpec


@dataclass(frozen=True, eq=False)
class FreqTransform(KeyTransform):
    freq_order: torch.Tensor  # [n_kv, d/2] frequencies, most important first


def rotate_stored_pairs(
    attn: nn.Module, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate every stored pair of the packed query and key by its own frequency (the `*_pair_freq` indices)."""
    q_freq, k_freq = attn._index("query_pair_freq", query.device), attn._index("key_pair_freq", query.device)
    if torch.compiler.is_compiling():  # the real formula, which the compiler fuses
        query = rotate_interleaved_pairs(query, cos[..., q_freq], sin[..., q_freq])
        key = rotate_interleaved_pairs(key, cos[..., k_freq], sin[..., k_freq])
        return query, key
    # Eagerly: one complex phase table per forward, gathered once per side (turn_interleaved_pairs says why).
    phase = phase_table(cos, sin)
    return turn_interleaved_pairs(query, phase[..., q_freq]), turn_interleaved_pairs(key, phase[..., k_freq])


@register_key_mode
class FreqMode(KeyMode):
    name = "freq"
    rank_step = 2
    run_time_cost = 0.0
    run_time_sentence = (
        "`freq` layers do nothing extra at run time: the kept rotary pairs are folded into the projections"
    )

    def allowed_for(self, features: AttentionFeatures) -> bool:
        return features.has_rope and not features.qk_norm

    def transform(self, objective: str, stats: LayerStatistics, geometry: AttentionGeometry) -> FreqTransform:
        orders, spectra = frequency_pair_selection(stats, geometry.num_key_value_heads)
        return FreqTransform(self.name, spectra, orders)

    def fold(
        self, transform: FreqTransform, q: Linear64, k: Linear64, geometry: AttentionGeometry
    ) -> tuple[Linear64, Linear64]:
        d = geometry.head_dim
        q_maps, k_maps = [], []
        for g in range(geometry.num_key_value_heads):
            perm = interleaved_pair_rows(transform.freq_order[g], d)
            k_maps.append((slice(g * d, (g + 1) * d), lambda x, p=perm: x[p]))
            q_maps += [(slice(h * d, (h + 1) * d), lambda x, p=perm: x[p]) for h in geometry.query_heads_of(g)]
        return map_rows(q, q_maps), map_rows(k, k_maps)

    def stored_order(self, transform: FreqTransform) -> list[list[int]]:
        return transform.freq_order.tolist()

    def layer_problems(self, index: int, layer: LayerSpec, num_kv_heads: int, head_dim: int) -> list[str]:
        problems = []
        if any(r % 2 for r in layer.key_ranks):
            problems.append(f"layer {index}: freq-mode key ranks must be even, got {layer.key_ranks}")
        half = head_dim // 2
        order = layer.freq_order or []
        if len(order) != num_kv_heads or any(sorted(o) != list(range(half)) for o in order):
            problems.append(f"layer {index}: freq_order must be a permutation of range({half}) per KV head")
        return problems

    def indices(self, attn: nn.Module) -> dict[str, torch.Tensor]:
        # Frequency of every stored pair, in packed query / key order.
        key_freqs = [attn.freq_order[h][: r // 2] for h, r in enumerate(attn.key_ranks)]
        g = attn.group_size
        return {
            "key_pair_freq": torch.tensor([f for fs in key_freqs for f in fs], dtype=torch.long),
            "query_pair_freq": torch.tensor([f for fs in key_freqs for _ in range(g) for f in fs], dtype=torch.long),
        }

    def project(
        self, attn: nn.Module, query: torch.Tensor, key: torch.Tensor, cos, sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_stored_pairs(attn, query, key, cos, sin)
