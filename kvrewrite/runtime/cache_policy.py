"""The cache policy behind load(): rate, recent window, codec, important tokens and eviction as one frozen,
validated object.

`kvrewrite.load(dir, rate=..., recent_window=..., kv_codec=..., important=..., evict=...)` builds a `CachePolicy`
from its keywords; `kvrewrite.load(dir, policy=CachePolicy(...))` takes one whole; `kvrewrite budget` records one in
token_policy.json (runtime.tiers.token_policy_file) and load reads it back. The fields are named as load's keywords,
so a policy's dict is the keywords that rebuild it. Each token policy is its own frozen part (`ImportantTokens`,
`Eviction` with its `Floor`), composed into the policy the way kvpress composes presses; an unused part is None.

What is checked here holds for every checkpoint: types, ranges and combinations. What depends on the checkpoint (its
rate table and layer count, its key mode and family, a compiled codec, an MLA export) is checked once it is known,
by `CacheForm.check` (runtime.cache_forms), naming the field and the form.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.config import CodecConfig, parse_codec
from kvrewrite.runtime.codecs.packing import SUPPORTED_BITS
from kvrewrite.runtime.tiers.eviction import DEFAULT_GROUP_SIZE, DEFAULT_OBSERVED_QUERIES, PREFILL_SCORES
from kvrewrite.runtime.tiers.floor import DEFAULT_FLOOR_BITS
from kvrewrite.runtime.tiers.policy import IMPORTANCE_SCORES

COMPILED = "compiled"  # kv_codec: the codec the checkpoint was compiled with, if any
NO_CODEC = "none"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shares(value, name: str) -> float | tuple[float, ...]:
    """A share in [0, 1], or one per layer (a tuple)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(_is_number(v) and 0 <= v <= 1 for v in values):
        raise InvalidArgumentError(
            f"{name} must be a number in [0, 1] (or a list of them, one per layer), got {value!r}"
        )
    return tuple(float(v) for v in values) if isinstance(value, (list, tuple)) else float(value)


def _widths(value, name: str, unit: str = "dims") -> int | tuple[int, ...]:
    """A whole number (of `unit`) >= 0, or one per layer (a tuple)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(_is_whole(w) and w >= 0 for w in values):
        raise InvalidArgumentError(f"{name} must be a whole number of {unit} >= 0 (or one per layer), got {value!r}")
    return tuple(values) if isinstance(value, (list, tuple)) else value


def _listed(value):
    """Tuples as JSON lists (nested), everything else as is."""
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


def _from_dict(cls, data, label: str, required: tuple[str, ...], example: str):
    """cls(**data), with the dict's type, unknown and missing keys named after `label` (the keyword, "evict=")."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{label} takes a dict such as {example}, got {data!r}")
    known = [f.name for f in fields(cls)]
    if set(data) - set(known) or set(required) - set(data):
        optional = [k for k in known if k not in required]
        raise InvalidArgumentError(
            f"{label} takes {' and '.join(required)} and optionally {', '.join(optional)}; got {sorted(data)}"
        )
    return cls(**data)


@dataclass(frozen=True)
class ImportantTokens:
    """Token-adaptive dims (runtime.tiers.policy): of every `pool` tokens leaving the window, the share `share` with
    the highest `score` ("attention" or "denominator") keep `rate`'s ranks; the rest drop to the policy's rate."""

    rate: float
    share: float | tuple[float, ...]  # one g for every layer, or one per layer
    score: str = "attention"
    pool: int = 64

    def __post_init__(self) -> None:
        if not _is_number(self.rate):
            raise InvalidArgumentError(f"important= rate must be a number, got {self.rate!r}")
        object.__setattr__(self, "share", _shares(self.share, "important= share"))
        if self.score not in IMPORTANCE_SCORES:
            raise InvalidArgumentError(
                f"important= score must be one of {', '.join(IMPORTANCE_SCORES)}, got {self.score!r}"
            )
        if not _is_whole(self.pool) or self.pool < 1:
            raise InvalidArgumentError(f"important= pool must be a whole number of tokens >= 1, got {self.pool!r}")

    @classmethod
    def from_dict(cls, data) -> ImportantTokens:
        if isinstance(data, dict) and "evict_rest" in data:
            # One eviction: the frozen-score one (each pool's unimportant tokens dropped) measured worse at both
            # budgets of the frontier (results/frontier.md) than re-scored eviction, which replaced it.
            raise InvalidArgumentError(
                "important= evict_rest was replaced by re-scored eviction: pass evict={'keep': share} (and "
                "kv_codec='none') instead of important={..., 'evict_rest': True}; see docs/tiers.md"
            )
        return _from_dict(cls, data, "important=", ("rate", "share"), "{'rate': 0.3, 'share': 0.25}")

    def to_dict(self) -> dict:
        return {f.name: _listed(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class Floor:
    """What an evicted token keeps instead of leaving (runtime.tiers.floor): each head's first `key` / `value` latent
    dims (one width, or one per layer; value defaults to key's) at `bits` (None: float16)."""

    key: int | tuple[int, ...]
    value: int | tuple[int, ...] | None = None
    bits: int | None = DEFAULT_FLOOR_BITS

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", _widths(self.key, "evict= floor key"))
        value = self.key if self.value is None else self.value
        object.__setattr__(self, "value", _widths(value, "evict= floor value"))
        if self.bits is not None and not (_is_whole(self.bits) and self.bits in SUPPORTED_BITS):
            raise InvalidArgumentError(
                f"evict= floor bits must be None (float16) or one of {SUPPORTED_BITS}, got {self.bits!r}"
            )

    @classmethod
    def from_dict(cls, data) -> Floor:
        return _from_dict(cls, data, "evict= floor", ("key",), "{'key': 8, 'value': 8, 'bits': 4}")

    def to_dict(self) -> dict:
        return {f.name: _listed(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class Eviction:
    """Re-scored eviction (runtime.tiers.eviction): beyond the window only the share `keep` of the tokens seen stays
    (one share, or one per layer), re-scored after every forward, at the policy's rate's ranks and `bits` (None:
    float16; a (key, value) pair for two widths). `floor`: what an evicted token keeps; `prefill_score` and
    `reconstruction_share` (one share, or one per layer): how a prompt's kept tokens are chosen
    (runtime.tiers.reconstruction); `pool_repeats`:
    with the reconstruction, the n-gram length over which repeated context pools its scores into one copy
    (runtime.tiers.repeated_evidence; 0: off); `sinks` (one count, or one per layer): the first cache
    positions, kept whatever the scores say (in a left-padded row, its pads first)."""

    keep: float | tuple[float, ...]
    bits: int | tuple[int | None, int | None] | None = None
    group_size: int = DEFAULT_GROUP_SIZE
    observed_queries: int = DEFAULT_OBSERVED_QUERIES
    floor: Floor | None = None
    prefill_score: str = "newest"
    reconstruction_share: float | tuple[float, ...] = 1.0
    pool_repeats: int = 0
    sinks: int | tuple[int, ...] = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", _shares(self.keep, "evict= keep"))
        object.__setattr__(
            self, "reconstruction_share", _shares(self.reconstruction_share, "evict= reconstruction_share")
        )
        bits = tuple(self.bits) if isinstance(self.bits, (list, tuple)) else self.bits
        sides = list(bits) if isinstance(bits, tuple) else [bits]
        if len(sides) not in (1, 2) or not all(b is None or (_is_whole(b) and b in SUPPORTED_BITS) for b in sides):
            raise InvalidArgumentError(
                f"evict= bits must be None (float16) or one of {SUPPORTED_BITS}, or a (key, value) pair of them, "
                f"got {self.bits!r}"
            )
        object.__setattr__(self, "bits", tuple(bits) if isinstance(bits, tuple) and len(bits) == 2 else sides[0])
        for name in ("group_size", "observed_queries"):
            value = getattr(self, name)
            if not _is_whole(value) or value < 1:
                raise InvalidArgumentError(f"evict= {name} must be a whole number >= 1, got {value!r}")
        if self.floor is not None:
            object.__setattr__(self, "floor", Floor.from_dict(self.floor))
        if self.prefill_score not in PREFILL_SCORES:
            raise InvalidArgumentError(
                f"evict= prefill_score must be one of {', '.join(map(repr, PREFILL_SCORES))}, "
                f"got {self.prefill_score!r}"
            )
        if not _is_whole(self.pool_repeats) or self.pool_repeats < 0:
            raise InvalidArgumentError(f"evict= pool_repeats must be a whole number >= 0, got {self.pool_repeats!r}")
        if self.pool_repeats and self.prefill_score != "reconstruction":
            raise InvalidArgumentError(
                "evict= pool_repeats pools the reconstruction's scores: it needs prefill_score='reconstruction'"
            )
        object.__setattr__(self, "sinks", _widths(self.sinks, "evict= sinks", "tokens"))

    @classmethod
    def from_dict(cls, data) -> Eviction:
        return _from_dict(cls, data, "evict=", ("keep",), "{'keep': 0.25, 'bits': 4}")

    def to_dict(self) -> dict:
        out = {f.name: _listed(getattr(self, f.name)) for f in fields(self)}
        out["floor"] = None if self.floor is None else self.floor.to_dict()
        return out


@dataclass(frozen=True)
class CachePolicy:
    """How load() builds a checkpoint's cache. Every field is optional:

    rate: a point of the checkpoint's rate table (None: the rate it was compiled for); with a recent window, the
        rate of the tokens beyond it.
    recent_window: tokens each query reads at full rank (runtime.tiers); None: every token at `rate`'s ranks.
    kv_codec: "compiled" (the checkpoint's own codec, if any), "none", or a codec such as "int4" (docs/codecs.md).
    important: token-adaptive dims (`ImportantTokens`, or its dict); needs recent_window.
    evict: re-scored eviction (`Eviction`, or its dict); needs recent_window.
    """

    rate: float | None = None
    recent_window: int | None = None
    kv_codec: str | CodecConfig = COMPILED
    important: ImportantTokens | None = None
    evict: Eviction | None = None

    def __post_init__(self) -> None:
        from kvrewrite.spec import validate_rate

        if self.rate is not None:
            if not _is_number(self.rate):
                raise InvalidArgumentError(f"rate= must be a number in [0, 1), got {self.rate!r}")
            object.__setattr__(self, "rate", validate_rate(self.rate, "rate="))
        if self.recent_window is not None and (not _is_whole(self.recent_window) or self.recent_window < 0):
            raise InvalidArgumentError(
                f"recent window (recent_window=) must be a whole number of tokens >= 0, got {self.recent_window!r}"
            )
        codec = NO_CODEC if self.kv_codec is None else self.kv_codec
        if not isinstance(codec, (str, CodecConfig)):
            raise InvalidArgumentError(
                f"kv_codec= takes a codec name such as 'int4', 'none' or 'compiled', got {self.kv_codec!r}"
            )
        if isinstance(codec, str) and codec != COMPILED:
            parse_codec(codec, "kv_codec=")  # an unknown codec or parameter is named now, not at load
        object.__setattr__(self, "kv_codec", codec)
        if self.important is not None:
            object.__setattr__(self, "important", ImportantTokens.from_dict(self.important))
        if self.evict is not None:
            object.__setattr__(self, "evict", Eviction.from_dict(self.evict))
        if (self.important is not None or self.evict is not None) and self.recent_window is None:
            what = "important= (token-adaptive dims)" if self.important is not None else "evict= (re-scored eviction)"
            raise InvalidArgumentError(f"{what} needs recent_window= (kvrewrite.runtime.tiers)")
        if self.important is not None and self.evict is not None:
            raise InvalidArgumentError("evict= and important= are two token policies; choose one")
        codec = self.codec(None)
        if codec is not None:  # an explicit codec: the one form every checkpoint shares
            from kvrewrite.runtime.cache_forms import codec_form

            codec_form(codec).check(self, "the cache")

    @property
    def tiered(self) -> bool:
        """Whether the cache is a TieredCache (runtime.tiers): a recent window, maybe with a token policy."""
        return self.recent_window is not None

    def codec(self, compiled: CodecConfig | None) -> CodecConfig | None:
        """The codec this policy caches with, given the checkpoint's compiled one."""
        if self.kv_codec == COMPILED:
            return compiled
        return self.kv_codec if isinstance(self.kv_codec, CodecConfig) else parse_codec(self.kv_codec, "kv_codec=")

    def requested(self) -> tuple[str, ...]:
        """The fields set away from their defaults, in field order (what a cache form must honour)."""
        default = CachePolicy()
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name))

    def to_dict(self) -> dict:
        """JSON-ready: the load() keywords that rebuild this policy."""
        codec = self.kv_codec.describe() if isinstance(self.kv_codec, CodecConfig) else self.kv_codec
        return {
            "rate": self.rate,
            "recent_window": self.recent_window,
            "kv_codec": codec,
            "important": None if self.important is None else self.important.to_dict(),
            "evict": None if self.evict is None else self.evict.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> CachePolicy:
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"a cache policy is a dict of load() keywords, got {data!r}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidArgumentError(
                f"{', '.join(f'{k}=' for k in sorted(unknown))}: not a cache policy field; "
                f"the fields are {', '.join(f.name for f in fields(cls))}"
            )
        return cls(**data)


def requested_policy(policy: CachePolicy | None = None, **keywords) -> CachePolicy | None:
    """The policy load() is asked for: `policy`, or the one its cache keywords build; None when neither asks for
    anything (then a policy recorded by `kvrewrite budget`, or the checkpoint's compiled rate and codec, apply)."""
    asked = CachePolicy(**keywords)
    if policy is None:
        return None if asked == CachePolicy() else asked
    if not isinstance(policy, CachePolicy):
        raise InvalidArgumentError(f"policy= takes a kvrewrite.CachePolicy, got {policy!r}")
    if asked != CachePolicy():
        named = ", ".join(f"{name}=" for name in asked.requested())
        raise InvalidArgumentError(
            f"{named}: policy= already holds the cache policy; set these fields in it, or pass keywords alone"
        )
    return policy
