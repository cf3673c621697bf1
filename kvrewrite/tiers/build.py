"""Switching a loaded compressed model to token tiers, and building its TieredCache."""

from __future__ import annotations

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.tiers.cache import STORAGE_DTYPE, TieredCache
from kvrewrite.tiers.policy import TierPolicy, tier_policy_for_rate


def enable_tiers(model, spec, rate: float | None, window: int, kv_codec, tables: dict,
                 important: dict | None = None) -> TierPolicy:
    """Keep `model` at full rank and make it cache through a TieredCache with aged tokens at `rate`'s ranks.

    kv_codec: "compiled" (the checkpoint's codec, if any), None / "none", or a codec for the aged tier.
    important: token-adaptive dims, {"rate": r_i, "share": g (or one per layer), "score": "attention" |
        "denominator", "pool": tokens classified together, "evict_rest": drop the others}; see kvrewrite.tiers.policy.
    """
    from kvrewrite.codecs.config import parse_codec
    from kvrewrite.tiers.attention import check_full_rank

    for attention in model.compressed_attentions():
        check_full_rank(attention)
    if model.kvrewrite_adapter.features(model.config).sliding_layers:
        raise InvalidArgumentError(
            f"{model.kvrewrite_adapter.family} has sliding-window layers; a tiered cache (recent window) does not support them yet"
        )
    codec = model.kv_codec if kv_codec == "compiled" else kv_codec
    codec = parse_codec(codec) if isinstance(codec, str) or codec is None else codec
    options = {}
    if important:
        unknown = set(important) - {"rate", "share", "score", "pool", "evict_rest"}
        if unknown or "rate" not in important or "share" not in important:
            raise InvalidArgumentError(
                f"important= takes rate, share and optionally score, pool and evict_rest; got {sorted(important)}")
        options = dict(important_rate=important["rate"], important_share=important["share"],
                       score=important.get("score", "attention"), pool=important.get("pool", 64),
                       evict_rest=bool(important.get("evict_rest", False)))
    policy = tier_policy_for_rate(spec, spec.target_rate if rate is None else rate, window,
                                  codec, **options)
    _aged_tier_codecs(policy, tables)  # a codec that cannot serve the aged ranks fails now, not at the first forward
    model.kv_codec, model.kv_codec_tables = None, dict(tables)
    model.tier_policy = policy
    return policy


def _aged_tier_codecs(policy: TierPolicy, tables: dict) -> list | None:
    """One codec per layer, built for the aged tier's ranks (None without a codec)."""
    from kvrewrite.codecs import build_layer_codecs

    if policy.codec is None:
        return None
    return build_layer_codecs(policy.codec, [list(k) for k in policy.aged_key_ranks],
                              [list(v) for v in policy.aged_value_ranks], tables)


def make_tiered_cache(model, policy: TierPolicy, storage_dtype: torch.dtype = STORAGE_DTYPE) -> TieredCache:
    """The TieredCache a tiered model attends through (its aged-tier codecs built for the aged ranks)."""
    head_dim = model.compressed_attentions()[0].head_dim
    return TieredCache(policy, head_dim, _aged_tier_codecs(policy, model.kv_codec_tables), storage_dtype)
