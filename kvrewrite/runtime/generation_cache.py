"""Which cache generate() builds for a kvrewrite model, from its cache policy and the call's `cache_implementation`.

- none (the default): the model's own cache (`make_kv_cache`): tiered with a tier policy, the codec cache with a
  codec, else an in-place cache sized for the call (runtime.inplace_cache);
- "dynamic": the same for a model with a codec or tiers (transformers' DynamicCache would drop them);
- "static" and transformers' other static names but "offloaded_static": with an in-place codec (int4, int2), its
  static cache (codecs.static_cache), as long as transformers would make its StaticCache (this call's length, or an
  earlier call's if longer, so a compiled step keeps its shapes); a model without codec or tiers gets
  transformers' own StaticCache;
- anything else, on a model with a codec or tiers: refused, since that cache would silently drop them.
"""

from __future__ import annotations

from transformers.cache_utils import Cache

# "offloaded_static" among them is the one an on-device static cache cannot honour.
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from kvrewrite.errors import InvalidArgumentError


def generation_cache(model, generation_config, batch_size: int | None, max_cache_length: int) -> Cache | None:
    """The cache for this generate() call, or None where transformers' own choice is right (a model without codec
    or tiers, asked for a cache_implementation)."""
    implementation = generation_config.cache_implementation
    if implementation is None:
        return model.make_kv_cache(capacity=max_cache_length)
    if model.kv_codec is None and model.tier_policy is None:
        return None
    if implementation == "dynamic":
        return model.make_kv_cache(capacity=max_cache_length)
    if implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS and implementation != "offloaded_static":
        length = max(
            max_cache_length, generation_config.max_cache_len or 0, getattr(model, "_previous_max_cache_length", -1)
        )
        model._previous_max_cache_length = length  # transformers' own record, shared with its StaticCache
        copies = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        return static_kv_cache(model, length, None if batch_size is None else copies * batch_size)
    what = "token tiers" if model.tier_policy is not None else f"{model.kv_codec.describe()} codec"
    raise InvalidArgumentError(
        f"cache_implementation={implementation!r} would build a cache without this model's {what}; generate "
        "without cache_implementation (the model's own cache), or with 'dynamic' or 'static'"
    )


def static_kv_cache(model, max_cache_len: int, batch: int | None = None) -> Cache:
    """A StaticCodecCache of `max_cache_len` tokens for the model's codec, its buffers allocated now when `batch` is
    given. Token tiers have no static form: refused here; so are codecs read whole (gear, csr, tada), by the cache."""
    from kvrewrite.runtime.codecs import build_layer_codecs
    from kvrewrite.runtime.codecs.static_cache import StaticCodecCache

    if model.tier_policy is not None:
        raise InvalidArgumentError(
            "cache_implementation='static': token tiers (recent_window, important, evict) have no static cache; "
            "generate without cache_implementation, or load without the tier policy"
        )
    codecs = build_layer_codecs(model.kv_codec, *model._layer_ranks(), model.kv_codec_tables)
    device = None if batch is None else model.device
    return StaticCodecCache(codecs, model.kv_codec.residual, max_cache_len, batch, device)
