"""Reconstruction evidence of repeated context, pooled into one copy (tiers/reconstruction.py's `pool_repeats`).

While the model repeats its context, the head that copies a token attends to the token after each earlier
occurrence of what it just wrote. A phrase said twice (a key and its restatement) therefore has its attention
split between its copies, and each copy scores about half of what a word said once scores: under the eighth's
budget, rare words said once outrank a pass key said twice (docs/results/frontier.md). The information is needed
once, so each group of identical n-grams gives the sum of its members' scores to its best-scored copy, which then
competes as a token said once would; the other copies keep their own scores.
"""

from __future__ import annotations

import torch


def pool_repeated_ngrams(scores: torch.Tensor, ids: torch.Tensor, ngram: int) -> torch.Tensor:
    """scores [B, n] (one per context position), ids [B, n] the context's tokens -> scores where, per row, the
    position whose n-gram (the `ngram` tokens ending there) occurs more than once and scores highest among its
    occurrences (the first of equals) holds at least the sum of their scores. Positions before the first whole
    n-gram, and n-grams said once, are unchanged."""
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    out = scores.clone()
    batch, n = scores.shape
    if n < ngram:
        return out
    for row in range(batch):
        # Row j of `grams` is the n-gram ending at position j + ngram - 1.
        grams = torch.stack([ids[row, i : n - ngram + 1 + i] for i in range(ngram)], dim=1)
        _, group = torch.unique(grams, dim=0, return_inverse=True)
        own = scores[row, ngram - 1 :].to(torch.float64)
        groups = int(group.max()) + 1
        size = torch.zeros(groups, dtype=torch.long, device=scores.device).index_add_(0, group, torch.ones_like(group))
        total = torch.zeros(groups, dtype=torch.float64, device=scores.device).index_add_(0, group, own)
        best = torch.full((groups,), float("-inf"), dtype=torch.float64, device=scores.device)
        best = best.scatter_reduce(0, group, own, reduce="amax")
        # The first position of each group that reaches its best score takes the sum.
        reaches = own == best[group]
        order = torch.arange(own.shape[0], device=scores.device)
        first = torch.full((groups,), own.shape[0], dtype=torch.long, device=scores.device)
        first = first.scatter_reduce(0, group[reaches], order[reaches], reduce="amin")
        chosen = first[size > 1]
        positions = chosen + ngram - 1
        raised = torch.maximum(own[chosen], total[size > 1]).to(scores.dtype)
        out[row, positions] = raised
    return out
