"""Switching a loaded compressed model to token tiers, and building its TieredCache."""

from __future__ import annotations

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.tiers.cache import STORAGE_DTYPE, TieredCache
from kvrewrite.runtime.tiers.eviction import EvictionPolicy, eviction_policy_for_rate
from kvrewrite.runtime.tiers.policy import TierPolicy, tier_policy_for_rate

EVICT_OPTIONS = ("keep", "bits", "group_size", "observed_queries", "floor", "prefill_score", "reconstruction_share")


def enable_tiers(
    model,
    spec,
    rate: float | None,
    window: int,
    kv_codec,
    tables: dict,
    important: dict | None = None,
    evict: dict | None = None,
) -> TierPolicy | EvictionPolicy:
    """Keep `model` at full rank and make it cache through a TieredCache with aged tokens at `rate`'s ranks.

    kv_codec: "compiled" (the checkpoint's codec, if any), None / "none", or a codec for the aged tier.
    important: token-adaptive dims, {"rate": r_i, "share": g (or one per layer), "score": "attention" |
        "denominator", "pool": tokens classified together}; see kvrewrite.runtime.tiers.policy.
    evict: re-scored eviction, {"keep": share beyond the window (or one per layer), "bits": None | 8 | 4 | 2,
        "group_size": channels per scale, "observed_queries": scoring queries per forward, "floor": {"key": dims,
        "value": dims, "bits": ...} kept by an evicted token instead of dropping it}; the kept tokens hold `rate`'s
        ranks. See kvrewrite.runtime.tiers.eviction and kvrewrite.runtime.tiers.floor.
    """
    from kvrewrite.runtime.codecs.config import parse_codec
    from kvrewrite.runtime.tiers.attention import check_full_rank

    for attention in model.compressed_attentions():
        check_full_rank(attention)
    if model.kvrewrite_adapter.features(model.config).sliding_layers:
        raise InvalidArgumentError(
            f"{model.kvrewrite_adapter.family} has sliding-window layers; a tiered cache (recent window) does not support them yet"
        )
    codec = model.kv_codec if kv_codec == "compiled" else kv_codec
    codec = parse_codec(codec) if isinstance(codec, str) or codec is None else codec
    rate = spec.target_rate if rate is None else rate
    if evict is not None:
        policy = _eviction_policy(spec, rate, window, codec, important, evict)
        model.kv_codec, model.kv_codec_tables = None, dict(tables)
        model.tier_policy = policy
        return policy
    options = {}
    if important:
        if (
            "evict_rest" in important
        ):  # one eviction: re-scored eviction measured better at both budgets (results/frontier.md)
            raise InvalidArgumentError(
                "important= evict_rest was replaced by re-scored eviction: pass evict={'keep': share} (and "
                "kv_codec='none') instead of important={..., 'evict_rest': True}; see docs/tiers.md"
            )
        unknown = set(important) - {"rate", "share", "score", "pool"}
        if unknown or "rate" not in important or "share" not in important:
            raise InvalidArgumentError(
                f"important= takes rate, share and optionally score and pool; got {sorted(important)}"
            )
        options = dict(
            important_rate=important["rate"],
            important_share=important["share"],
            score=important.get("score", "attention"),
            pool=important.get("pool", 64),
        )
    policy = tier_policy_for_rate(spec, rate, window, codec, **options)
    _aged_tier_codecs(policy, tables)  # a codec that cannot serve the aged ranks fails now, not at the first forward
    model.kv_codec, model.kv_codec_tables = None, dict(tables)
    model.tier_policy = policy
    return policy


def _eviction_policy(spec, rate: float, window: int, codec, important: dict | None, evict: dict) -> EvictionPolicy:
    if important is not None:
        raise InvalidArgumentError("evict= and important= are two token policies; choose one")
    if codec is not None:
        raise InvalidArgumentError(
            f"evict= quantizes kept tokens per token (evict={{'bits': 4}}); it takes no block codec, got {codec.describe()} "
            "(pass kv_codec='none')"
        )
    unknown = set(evict) - set(EVICT_OPTIONS)
    if unknown or "keep" not in evict:
        raise InvalidArgumentError(
            f"evict= takes keep and optionally {', '.join(EVICT_OPTIONS[1:])}; got {sorted(evict)}"
        )
    options = {k: evict[k] for k in EVICT_OPTIONS[1:] if k in evict}
    return eviction_policy_for_rate(spec, rate, window, evict["keep"], **options)


def _aged_tier_codecs(policy: TierPolicy | EvictionPolicy, tables: dict) -> list | None:
    """One codec per layer, built for the aged tier's ranks (None without a codec)."""
    from kvrewrite.runtime.codecs import build_layer_codecs

    if policy.codec is None:
        return None
    return build_layer_codecs(
        policy.codec, [list(k) for k in policy.aged_key_ranks], [list(v) for v in policy.aged_value_ranks], tables
    )


def make_tiered_cache(
    model, policy: TierPolicy | EvictionPolicy, storage_dtype: torch.dtype = STORAGE_DTYPE
) -> TieredCache:
    """The TieredCache a tiered model attends through (its aged-tier codecs built for the aged ranks)."""
    head_dim = model.compressed_attentions()[0].head_dim
    return TieredCache(policy, head_dim, _aged_tier_codecs(policy, model.kv_codec_tables), storage_dtype)
