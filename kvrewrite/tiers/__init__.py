"""Token tiers over one importance-ordered latent: a full-rank recent window, older tokens at fewer dims (and bits)."""

from kvrewrite.tiers.cache import TieredCache, TieredLayer
from kvrewrite.tiers.policy import TierPolicy, tier_policy_for_rate

__all__ = ["TierPolicy", "TieredCache", "TieredLayer", "tier_policy_for_rate"]
