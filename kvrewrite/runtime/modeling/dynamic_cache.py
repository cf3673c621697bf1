"""A DynamicCache that counts its tokens when a layer caches zero key dims.

At a high rate of the table a layer may keep no key dims (its cached keys are [B, 1, S, 0]); transformers'
DynamicLayer reads its length as 0 from such an empty tensor, and a chunked prefill then builds masks for a cache
of the wrong length. This layer reads the length from the token axis whatever the width.
"""

from __future__ import annotations

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class TokenCountingLayer(DynamicLayer):
    def get_seq_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized and self.keys.dim() >= 2 else 0


def plain_cache(config) -> DynamicCache:
    """DynamicCache(config=config) whose full-attention layers count tokens by shape."""
    cache = DynamicCache(config=config)
    cache.layers = [TokenCountingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = TokenCountingLayer
    return cache
