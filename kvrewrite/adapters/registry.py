"""The model-type registry: which architectures kvrewrite can rewrite, and how (the only global state)."""

from __future__ import annotations

from kvrewrite.adapters.base import ArchitectureAdapter
from kvrewrite.errors import UnsupportedModelError

_ADAPTERS: dict[str, ArchitectureAdapter] = {}


def register_adapter(adapter: ArchitectureAdapter) -> None:
    for model_type in adapter.model_types:
        _ADAPTERS[model_type] = adapter


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def all_adapters() -> list[ArchitectureAdapter]:
    """Every registered adapter once, in registration order."""
    seen: dict[int, ArchitectureAdapter] = {}
    for adapter in _ADAPTERS.values():
        seen.setdefault(id(adapter), adapter)
    return list(seen.values())


def adapter_for(config) -> ArchitectureAdapter:
    """The adapter for a transformers config; raises before any work if the architecture is unsupported."""
    model_type = getattr(config, "model_type", None)
    adapter = _ADAPTERS.get(model_type)
    if adapter is None:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported by kvrewrite; supported model types: "
            f"{', '.join(supported_model_types())}"
        )
    adapter.check_config(config)
    return adapter
