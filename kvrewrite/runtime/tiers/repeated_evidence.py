"""Reconstruction evidence of repeated context, pooled into one copy (tiers/reconstruction.py's `pool_repeats`).

Why: while the model repeats its context, the head that copies a token can attend to the token after any earlier
occurrence of what it just wrote, so a phrase said twice (a key and its restatement) may have its attention split
between its copies and each copy score less than a word said once. That is a reading of how copying works, not a
measurement; what was measured is that the eighth's score ranks the wiki key line among rare words and drops it
(benchmarks/results/needle_survival_eighth_wiki.json). The information is needed once, so each group of identical
n-grams gives the sum of its members' scores to every token of its best-scored copy; the other copies keep their
own scores.
"""

from __future__ import annotations

import torch


def pool_repeated_ngrams(scores: torch.Tensor, ids: torch.Tensor, ngram: int) -> torch.Tensor:
    """scores [B, n] (one per context position), ids [B, n] the context's tokens -> scores where, per row, each
    n-gram said more than once (the `ngram` tokens ending at a position) raises every token of its best-scored
    occurrence (scored at its last token; the first of equals) to at least the sum of its occurrences' scores.
    Tokens in no repeated n-gram are unchanged."""
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
        raise ValueError(f"ngram must be a whole number >= 1, got {ngram!r}")
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
        # The first occurrence of each group that reaches its best score takes the sum, on all of its tokens.
        reaches = own == best[group]
        order = torch.arange(own.shape[0], device=scores.device)
        first = torch.full((groups,), own.shape[0], dtype=torch.long, device=scores.device)
        first = first.scatter_reduce(0, group[reaches], order[reaches], reduce="amin")
        repeated = size > 1
        starts, sums = first[repeated], total[repeated].to(scores.dtype)
        for offset in range(ngram):  # the n-gram starting at `start` covers start .. start + ngram - 1
            positions = starts + offset
            out[row] = out[row].scatter_reduce(0, positions, sums, reduce="amax")
    return out
