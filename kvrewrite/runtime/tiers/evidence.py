"""Which queries count in the attention evidence a tiered layer re-scores its tokens by (tiers/attention.py and the
kept-tier kernels' path, tiers/kept_decode.py, weigh them alike)."""

from __future__ import annotations

import torch


def scored_queries(layer, allowed: torch.Tensor, q_len: int) -> torch.Tensor:
    """[B, T] weight of each query in the importance evidence: the layer's last `observed_queries` (all when None)
    that can read any key (a left-padding row reads none and would spread a uniform, meaningless softmax)."""
    weights = allowed.any(dim=-1)[:, 0].float()  # [B or 1, T]
    observed = layer.observed_queries
    if observed is not None and observed < q_len:
        weights = weights * (torch.arange(q_len, device=allowed.device) >= q_len - observed)
    return weights
