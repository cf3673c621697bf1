"""What each spawned process of tests/test_sequence_parallel.py runs (a light module: spawned children import it)."""

from __future__ import annotations

import torch

import kvrewrite
from kvrewrite.runtime.kernels.cache_layout import packed_view
from kvrewrite.runtime.sequence_parallel import greedy_continue, prefill


def prefill_jobs(rank: int, world: int, jobs: list, tokens: torch.Tensor, new_tokens: int) -> dict:
    """Per (checkpoint directory, rate) job: this rank's logits slice, the full cache it holds (cache_on="all"), its
    collective calls and the greedy continuation from that cache."""
    out = {}
    for directory, rate in jobs:
        model = kvrewrite.load(directory, rate=rate).eval()
        result = prefill(model, tokens, cache_on="all", all_logits=True, query_chunk=8)  # several row chunks
        caches = [(packed_view(layer.keys).clone(), packed_view(layer.values).clone()) for layer in result.cache.layers]
        out[(directory, rate)] = {
            "tokens": result.tokens,
            "logits": result.logits,
            "cache": caches,
            "calls": [vars(call) for call in result.collectives.calls],
            "continuation": greedy_continue(model, result, new_tokens),
        }
    return out
