"""Switching a loaded compressed model to token tiers, and building its TieredCache."""

from __future__ import annotations

import torch

from kvrewrite.runtime.cache_policy import CachePolicy
from kvrewrite.runtime.tiers.cache import STORAGE_DTYPE, TieredCache
from kvrewrite.runtime.tiers.eviction import EvictionPolicy, eviction_policy_for_rate
from kvrewrite.runtime.tiers.policy import TierPolicy, tier_policy_for_rate


def enable_tiers(
    model, spec, policy: CachePolicy, tables: dict, subject: str = "the checkpoint"
) -> TierPolicy | EvictionPolicy:
    """Keep `model` at full rank and make it cache through a TieredCache built for `policy` (which has a recent
    window): older tokens at the policy's rate's ranks, coded by its codec, or its important tokens, or its eviction.
    What the checkpoint cannot honour is refused first, naming `subject`."""
    from kvrewrite.runtime.cache_forms import check_per_head
    from kvrewrite.runtime.tiers.attention import check_full_rank

    check_per_head(model, policy, subject)
    for attention in model.compressed_attentions():
        check_full_rank(attention)
    codec = policy.codec(model.kv_codec)
    rate = spec.target_rate if policy.rate is None else policy.rate
    if policy.evict is not None:
        tiers = _eviction_policy(spec, rate, policy)
    else:
        options = {}
        if policy.important is not None:
            important = policy.important
            options = dict(
                important_rate=important.rate,
                important_share=important.share,
                score=important.score,
                pool=important.pool,
            )
        tiers = tier_policy_for_rate(spec, rate, policy.recent_window, codec, **options)
        _aged_tier_codecs(tiers, tables)  # a codec that cannot serve the aged ranks fails now, not at the first forward
    model.kv_codec, model.kv_codec_tables = None, dict(tables)
    model.tier_policy = tiers
    return tiers


def _eviction_policy(spec, rate: float, policy: CachePolicy) -> EvictionPolicy:
    evict = policy.evict
    floor = None if evict.floor is None else evict.floor.to_dict()
    return eviction_policy_for_rate(
        spec,
        rate,
        policy.recent_window,
        evict.keep,
        bits=evict.bits,
        group_size=evict.group_size,
        observed_queries=evict.observed_queries,
        floor=floor,
        prefill_score=evict.prefill_score,
        reconstruction_share=evict.reconstruction_share,
        pool_repeats=evict.pool_repeats,
        sinks=evict.sinks,
    )


def _aged_tier_codecs(policy: TierPolicy | EvictionPolicy, tables: dict) -> list | None:
    """One codec per layer, built for the aged tier's ranks (None without a codec)."""
    from kvrewrite.runtime.codecs import build_layer_codecs

    if policy.codec is None:
        return None
    return build_layer_codecs(
        policy.codec, [list(k) for k in policy.aged_key_ranks], [list(v) for v in policy.aged_value_ranks], tables
    )


def make_tiered_cache(
    model,
    policy: TierPolicy | EvictionPolicy,
    storage_dtype: torch.dtype = STORAGE_DTYPE,
    capacity: int | None = None,
) -> TieredCache:
    """The TieredCache a tiered model attends through (its aged-tier codecs built for the aged ranks); `capacity`:
    the longest sequence it will hold, where known (an evicting cache then allocates its stores once)."""
    head_dim = model.compressed_attentions()[0].head_dim
    return TieredCache(policy, head_dim, _aged_tier_codecs(policy, model.kv_codec_tables), storage_dtype, capacity)
