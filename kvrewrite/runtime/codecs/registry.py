"""The KV codecs by name. A codec is one class (see base.LayerCodec) that registers itself with `register_codec`;
parsing `--kv-codec NAME[:key=value,...]`, the cache and the compile-time fitting all look codecs up here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrewrite.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvrewrite.runtime.codecs.base import LayerCodec

NONE = "none"  # the reduced cache without a codec: a reserved name, never a class
REQUIRED_PARAMS = ("group_size", "residual")  # every codec codes blocks of G tokens behind a float16 window

_CODECS: dict[str, type[LayerCodec]] = {}


def register_codec(cls: type[LayerCodec]) -> type[LayerCodec]:
    """Make `cls` available under `cls.name` (usable as a class decorator)."""
    name = getattr(cls, "name", None)
    if not name or name == NONE or ":" in name or "," in name:
        raise ValueError(f"{cls.__qualname__}.name must be a plain codec name other than {NONE!r}, got {name!r}")
    missing = [p for p in REQUIRED_PARAMS if p not in getattr(cls, "defaults", {})]
    if missing:
        raise ValueError(f"codec {name}: defaults lack {', '.join(missing)} (every codec has them)")
    existing = _CODECS.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(
            f"a codec named {name!r} is already registered ({existing.__module__}.{existing.__qualname__})"
        )
    _CODECS[name] = cls
    return cls


def unregister_codec(name: str) -> None:
    """Forget a codec (for plug-ins and tests that register one only for a while)."""
    _CODECS.pop(name, None)


def codec_names() -> tuple[str, ...]:
    """`none` and every registered codec, in registration order."""
    return (NONE, *_CODECS)


def codec_class(name: str, option: str = "`kv_codec`") -> type[LayerCodec]:
    """The class registered as `name`; `option` is what the error calls the setting that named it."""
    try:
        return _CODECS[name]
    except KeyError:
        raise InvalidArgumentError(f"{option} must be one of {', '.join(codec_names())}; got {name!r}") from None


def bits_budget_codecs() -> tuple[str, ...]:
    """The codecs whose fitting searches bit widths under a bits-per-element budget."""
    return tuple(name for name, cls in _CODECS.items() if cls.takes_bits_budget)
