"""Which dims a cached token keeps as it ages: the recent window at full rank, older tokens at their rate's ranks.

A compressed checkpoint stores every head's transform at full rank, ordered by importance, so a token can keep
any prefix of its latent dims. A `TierPolicy` says which prefix: a query reads the `window` tokens before it
(and itself) with all their dims, and every older token with its layer's `aged` ranks (a point of the
checkpoint's rate table), optionally coded further by a KV codec. It is a prefix truncation of one cached
latent, so one checkpoint serves every policy: nothing is recompiled.

Token-adaptive dims (ZDC §5.2): with `important_share`, tokens that leave the window wait in a pool of `pool`
tokens (read at the important ranks); when the pool is full, the share g_l of them with the highest importance
score keep the layer's `important` ranks and the rest drop to the aged ranks. Scores: "attention" (mean
attention the token received while in the window, summed over heads) or "denominator" (ZDC's: the token's own
softmax denominator as a query, summed over heads). Dropping tokens is re-scored eviction's
(kvrewrite.runtime.tiers.eviction), the one eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.config import CodecConfig

IMPORTANCE_SCORES = ("attention", "denominator")


@dataclass(frozen=True)
class TierPolicy:
    """window: tokens a query reads at full rank besides itself; aged_*: per layer, per KV head ranks of older tokens.

    codec: a KV codec (kvrewrite.runtime.codecs.CodecConfig) for the aged tier, or None for float16 latents.
    """

    window: int
    aged_key_ranks: tuple[tuple[int, ...], ...]
    aged_value_ranks: tuple[tuple[int, ...], ...]
    codec: CodecConfig | None = None
    important_key_ranks: tuple[tuple[int, ...], ...] | None = None
    important_value_ranks: tuple[tuple[int, ...], ...] | None = None
    important_share: tuple[float, ...] | None = None  # g_l per layer
    score: str = "attention"
    pool: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise InvalidArgumentError(f"recent window must be a whole number of tokens >= 0, got {self.window!r}")
        if len(self.aged_key_ranks) != len(self.aged_value_ranks):
            raise InvalidArgumentError("aged key and value ranks cover different numbers of layers")
        if self.score not in IMPORTANCE_SCORES:
            raise InvalidArgumentError(f"importance score {self.score!r}; choose one of {', '.join(IMPORTANCE_SCORES)}")
        if self.important_share is not None:
            if self.important_key_ranks is None or self.important_value_ranks is None:
                raise InvalidArgumentError("an important share needs important ranks")
            if len(self.important_share) != self.num_layers or any(not 0 <= g <= 1 for g in self.important_share):
                raise InvalidArgumentError(f"important share needs one value in [0, 1] per layer ({self.num_layers})")
            if self.pool < 1:
                raise InvalidArgumentError(f"importance pool must be >= 1 token, got {self.pool}")
            if self.codec is not None:
                raise InvalidArgumentError("token-adaptive dims with a codec on the aged tier are not supported yet")
            for i, (ak, ik) in enumerate(zip(self.aged_key_ranks, self.important_key_ranks)):
                if any(a > b for a, b in zip(ak, ik)) or any(
                    a > b for a, b in zip(self.aged_value_ranks[i], self.important_value_ranks[i])
                ):
                    raise InvalidArgumentError(f"layer {i}: important ranks must be at least the aged ranks")

    @property
    def adaptive(self) -> bool:
        return self.important_share is not None

    @property
    def changes_between_forwards(self) -> bool:
        """True when the cache is coded or classified only after a forward, so one long forward reads it more
        kindly than decoding would: such a policy must be measured with chunked feeding."""
        return self.codec is not None or self.adaptive

    @property
    def num_layers(self) -> int:
        return len(self.aged_key_ranks)

    def make_layers(self, head_dim: int, layer_codecs: list | None, storage_dtype, capacity: int | None = None) -> list:
        """One TieredLayer per decoder layer (layer_codecs: the aged tier's codec per layer, or None). `capacity`: the
        longest sequence the cache will hold (None: unknown); it sizes the stored tiers' buffers."""
        from kvrewrite.runtime.tiers.cache import TieredLayer

        codecs = layer_codecs if layer_codecs is not None else [None] * self.num_layers
        layers = []
        for i in range(self.num_layers):
            adaptive = {}
            if self.adaptive:
                adaptive = dict(
                    important_key_ranks=self.important_key_ranks[i],
                    important_value_ranks=self.important_value_ranks[i],
                    important_share=self.important_share[i],
                    score=self.score,
                    pool=self.pool,
                )
            layers.append(
                TieredLayer(
                    self.window,
                    head_dim,
                    self.aged_key_ranks[i],
                    self.aged_value_ranks[i],
                    codecs[i],
                    storage_dtype,
                    capacity=capacity,
                    **adaptive,
                )
            )
        return layers


def tier_policy_for_rate(
    spec,
    rate: float,
    window: int,
    codec: CodecConfig | None = None,
    *,
    important_rate: float | None = None,
    important_share: float | list[float] | None = None,
    score: str = "attention",
    pool: int = 64,
) -> TierPolicy:
    """Aged tokens at the ranks of `rate` in the checkpoint's rate table (kvrewrite.spec.CompressionSpec); with
    important_rate and important_share (one g for every layer, or one per layer), important tokens at that rate's."""
    key_ranks, value_ranks = spec.ranks_for_rate(rate)
    important = {}
    if important_share is not None:
        if important_rate is None:
            raise InvalidArgumentError("an important share needs an important rate")
        ik, iv = spec.ranks_for_rate(important_rate)
        shares = (
            [important_share] * spec.num_layers if isinstance(important_share, (int, float)) else list(important_share)
        )
        important = dict(
            important_key_ranks=tuple(tuple(k) for k in ik),
            important_value_ranks=tuple(tuple(v) for v in iv),
            important_share=tuple(float(g) for g in shares),
            score=score,
            pool=pool,
        )
    return TierPolicy(
        window=window,
        aged_key_ranks=tuple(tuple(k) for k in key_ranks),
        aged_value_ranks=tuple(tuple(v) for v in value_ranks),
        codec=codec,
        **important,
    )
