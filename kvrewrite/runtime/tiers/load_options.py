"""The types of load()'s cache keywords (kv_codec=, recent_window=, important=, evict=), checked before any weight is
read, and the same checks on a token_policy.json's recorded options: a wrong type is one message naming the keyword,
not an AttributeError or a TypeError in the first forward."""

from __future__ import annotations

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.packing import SUPPORTED_BITS


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shares(value, name: str) -> None:
    """A share in [0, 1], or one per layer."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or not all(_is_number(v) and 0 <= v <= 1 for v in values):
        raise InvalidArgumentError(
            f"{name} must be a number in [0, 1] (or a list of them, one per layer), got {value!r}"
        )


def check_cache_keywords(kv_codec, recent_window, important, evict) -> None:
    """Refuse a keyword of the wrong type or range, naming it (rates are checked against the rate table later)."""
    from kvrewrite.runtime.codecs.config import CodecConfig

    if kv_codec is not None and not isinstance(kv_codec, (str, CodecConfig)):
        raise InvalidArgumentError(
            f"kv_codec= takes a codec name such as 'int4', 'none' or 'compiled', got {kv_codec!r}"
        )
    if recent_window is not None and (not _is_whole(recent_window) or recent_window < 0):
        raise InvalidArgumentError(
            f"recent window (recent_window=) must be a whole number of tokens >= 0, got {recent_window!r}"
        )
    if important is not None:
        if not isinstance(important, dict):
            raise InvalidArgumentError(
                f"important= takes a dict such as {{'rate': 0.7, 'share': 0.2}}, got {important!r}"
            )
        if "rate" in important and not _is_number(important["rate"]):
            raise InvalidArgumentError(f"important= rate must be a number, got {important['rate']!r}")
        if "share" in important:
            _shares(important["share"], "important= share")
        if "pool" in important and (not _is_whole(important["pool"]) or important["pool"] < 1):
            raise InvalidArgumentError(
                f"important= pool must be a whole number of tokens >= 1, got {important['pool']!r}"
            )
    if evict is not None:
        if not isinstance(evict, dict):
            raise InvalidArgumentError(f"evict= takes a dict such as {{'keep': 0.25, 'bits': 4}}, got {evict!r}")
        if "keep" in evict:
            _shares(evict["keep"], "evict= keep")
        bits = evict.get("bits")
        sides = list(bits) if isinstance(bits, (list, tuple)) else [bits]
        if len(sides) not in (1, 2) or not all(b is None or (_is_whole(b) and b in SUPPORTED_BITS) for b in sides):
            raise InvalidArgumentError(
                f"evict= bits must be None (float16) or one of {SUPPORTED_BITS}, or a "
                f"(key, value) pair of them, got {bits!r}"
            )
        if evict.get("prefill_score", "newest") not in ("newest", "reconstruction"):
            raise InvalidArgumentError(
                f"evict= prefill_score must be 'newest' or 'reconstruction', got {evict['prefill_score']!r}"
            )
        share = evict.get("reconstruction_share", 1.0)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise InvalidArgumentError(f"evict= reconstruction_share must be a number in [0, 1], got {share!r}")
        floor = evict.get("floor")
        if floor is not None:
            _check_floor(floor)
        for name in ("group_size", "observed_queries"):
            if name in evict and (not _is_whole(evict[name]) or evict[name] < 1):
                raise InvalidArgumentError(f"evict= {name} must be a whole number >= 1, got {evict[name]!r}")


def _check_floor(floor) -> None:
    """evict= floor: {"key": dims, "value": dims, "bits": bits}, widths whole numbers (or one per layer)."""
    if not isinstance(floor, dict):
        raise InvalidArgumentError(
            f"evict= floor takes a dict such as {{'key': 8, 'value': 8, 'bits': 4}}, got {floor!r}"
        )
    for name in ("key", "value"):
        if name not in floor:
            continue
        widths = floor[name] if isinstance(floor[name], (list, tuple)) else [floor[name]]
        if not widths or not all(_is_whole(w) and w >= 0 for w in widths):
            raise InvalidArgumentError(
                f"evict= floor {name} must be a whole number of dims >= 0 (or one per layer), got {floor[name]!r}"
            )
    bits = floor.get("bits", 4)
    if bits is not None and not (_is_whole(bits) and bits in SUPPORTED_BITS):
        raise InvalidArgumentError(f"evict= floor bits must be None (float16) or one of {SUPPORTED_BITS}, got {bits!r}")
