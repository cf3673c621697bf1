"""Token tiers over one importance-ordered latent: a full-rank recent window, older tokens at fewer dims (and bits),
or only the tokens attention still reads (re-scored eviction)."""

from kvrewrite.runtime.tiers.cache import TieredCache, TieredLayer
from kvrewrite.runtime.tiers.eviction import EvictingLayer, EvictionPolicy, eviction_policy_for_rate
from kvrewrite.runtime.tiers.policy import TierPolicy, tier_policy_for_rate

__all__ = [
    "EvictingLayer",
    "EvictionPolicy",
    "TierPolicy",
    "TieredCache",
    "TieredLayer",
    "eviction_policy_for_rate",
    "tier_policy_for_rate",
]
