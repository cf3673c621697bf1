"""folded (models without RoPE, e.g. OPT, GPT-2): the post-rope maps, folded into q_proj/k_proj (ZACK Fig. 8).

q.k = (q Q).(k K), so W_Q and W_K absorb the maps and the runtime does nothing extra.
"""

from __future__ import annotations

from kvrewrite.adapters.base import AttentionFeatures, AttentionGeometry
from kvrewrite.key_modes.base import KeyMode, register_key_mode
from kvrewrite.key_modes.post_rope import BilinearKeyTransform
from kvrewrite.key_modes.rows import Linear64, map_rows
from kvrewrite.method.key_transforms import post_rope_maps
from kvrewrite.method.statistics import LayerStatistics


@register_key_mode
class FoldedMode(KeyMode):
    name = "folded"
    run_time_sentence = "`folded` layers do nothing extra at run time"

    def allowed_for(self, features: AttentionFeatures) -> bool:
        return not features.has_rope

    def transform(self, objective: str, stats: LayerStatistics, geometry: AttentionGeometry) -> BilinearKeyTransform:
        # Without RoPE, post-RoPE Grams equal pre-RoPE ones: the post-rope solver, applied in the projections.
        q_maps, k_maps, spectra = post_rope_maps(objective, stats, geometry.num_key_value_heads)
        return BilinearKeyTransform(self.name, spectra, q_maps, k_maps)

    def fold(
        self, transform: BilinearKeyTransform, q: Linear64, k: Linear64, geometry: AttentionGeometry
    ) -> tuple[Linear64, Linear64]:
        d = geometry.head_dim
        q_maps, k_maps = [], []
        for g in range(geometry.num_key_value_heads):
            k_maps.append((slice(g * d, (g + 1) * d), lambda x, m=transform.k_map[g]: m.T @ x))
            q_maps += [
                (slice(h * d, (h + 1) * d), lambda x, m=transform.q_map[g]: m.T @ x) for h in geometry.query_heads_of(g)
            ]
        return map_rows(q, q_maps), map_rows(k, k_maps)
