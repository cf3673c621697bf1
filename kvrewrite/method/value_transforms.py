"""Value side: an invertible per-KV-head map folded into v_proj (columns) and o_proj (rows).

Head h's output P_h V_g W_O^h is unchanged by V_g -> V_g A, W_O^h -> A^{-1} W_O^h; keeping the first
r columns of A stores r value dims per token and needs no decompression (ZACK Lemma 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.adapters.base import AttentionGeometry
from kvrewrite.method.linalg import principal_basis, whitened_projection
from kvrewrite.method.statistics import LayerStatistics


@dataclass
class ValueTransform:
    down: torch.Tensor  # [n_kv, d, d]: folded into v_proj; value latents are v @ down
    up: torch.Tensor  # [n_kv, d, d]: folded into o_proj rows; down @ up = I
    spectrum: torch.Tensor  # [n_kv, d]: the objective's singular values, descending


def stacked_output_rows(o_proj_weight: torch.Tensor, geometry: AttentionGeometry, kv_head: int) -> torch.Tensor:
    """W_O,g = [W_O^h for h in group g] side by side, [d, group_size * hidden]."""
    d = geometry.head_dim
    blocks = [o_proj_weight[:, h * d : (h + 1) * d].T for h in geometry.query_heads_of(kv_head)]
    return torch.cat(blocks, dim=1).double()


def value_transform(
    objective: str,
    stats: LayerStatistics,
    o_proj_weight: torch.Tensor,
    geometry: AttentionGeometry,
    output_metric: torch.Tensor | None = None,
) -> ValueTransform:
    """output_metric: optional [hidden, hidden] right factor M on what o_proj writes (optimal objective only):
    the error is then measured as ||... W_O M||, e.g. M = F^{1/2} for a Fisher-weighted objective."""
    downs, ups, spectra = [], [], []
    for g in range(geometry.num_key_value_heads):
        w_o = stacked_output_rows(o_proj_weight, geometry, g)
        if objective == "zack":
            # Paper-faithful: right singular vectors of the row-stack [V_g ; (W_O^h)^T for h in g].
            pair = principal_basis(stats.gram("value", g) + w_o @ w_o.T)
        else:
            # Output-aware: minimise E||O_h (I - A_r B_r) W_O^h||^2 with the Gram of the attention
            # outputs O_h = P_h V_g (what W_O actually sees), summed over the group's query heads.
            outputs = sum(stats.gram("output", h) for h in geometry.query_heads_of(g))
            if output_metric is not None:
                hidden = output_metric.shape[0]
                w_o = torch.cat([block @ output_metric for block in w_o.split(hidden, dim=1)], dim=1)
            pair = whitened_projection(outputs, w_o)
        downs.append(pair.down)
        ups.append(pair.up)
        spectra.append(pair.spectrum)
    return ValueTransform(torch.stack(downs), torch.stack(ups), torch.stack(spectra))
