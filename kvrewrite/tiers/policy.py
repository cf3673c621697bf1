"""Which dims a cached token keeps as it ages: the recent window at full rank, older tokens at their rate's ranks.

A compressed checkpoint stores every head's transform at full rank, ordered by importance, so a token can keep
any prefix of its latent dims. A `TierPolicy` says which prefix: a query reads the `window` tokens before it
(and itself) with all their dims, and every older token with its layer's `aged` ranks (a point of the
checkpoint's rate table), optionally coded further by a KV codec. It is a prefix truncation of one cached
latent, so one checkpoint serves every policy: nothing is recompiled.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrewrite.errors import InvalidArgumentError


@dataclass(frozen=True)
class TierPolicy:
    """window: tokens a query reads at full rank besides itself; aged_*: per layer, per KV head ranks of older tokens.

    codec: a KV codec config dict (kvrewrite.codecs.CodecConfig.to_dict()) for the aged tier, or None for float16.
    """

    window: int
    aged_key_ranks: tuple[tuple[int, ...], ...]
    aged_value_ranks: tuple[tuple[int, ...], ...]
    codec: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise InvalidArgumentError(f"recent window must be a whole number of tokens >= 0, got {self.window!r}")
        if len(self.aged_key_ranks) != len(self.aged_value_ranks):
            raise InvalidArgumentError("aged key and value ranks cover different numbers of layers")

    @property
    def num_layers(self) -> int:
        return len(self.aged_key_ranks)

    def aged_elements_per_token(self, layer: int) -> int:
        return sum(self.aged_key_ranks[layer]) + sum(self.aged_value_ranks[layer])


def tier_policy_for_rate(spec, rate: float, window: int, codec: dict | None = None) -> TierPolicy:
    """Aged tokens at the ranks of `rate` in the checkpoint's rate table (kvrewrite.spec.CompressionSpec)."""
    key_ranks, value_ranks = spec.ranks_for_rate(rate)
    return TierPolicy(
        window=window,
        aged_key_ranks=tuple(tuple(k) for k in key_ranks),
        aged_value_ranks=tuple(tuple(v) for v in value_ranks),
        codec=codec,
    )
