"""Method names the driver accepts: the original, every peer, and kvrewrite checkpoints or methods from a module."""

from __future__ import annotations

import importlib
from typing import Any

from .methods import Method, original


def kvrewrite_checkpoint(directory: str, rate: float, new_cache: Any = None, name: str | None = None) -> Method:
    """A kvrewrite checkpoint at one rate, with its own cache (``new_kv_cache``) unless ``new_cache`` is given."""

    def load(_original_path: str) -> Any:
        import kvrewrite

        return kvrewrite.load(directory, rate=rate).eval()

    def default_cache(model: Any) -> Any:
        from kvrewrite.publish.evaluation import new_kv_cache

        return new_kv_cache(model)

    return Method(
        name or f"kvrewrite-p{rate:g}",
        "kvrewrite",
        new_cache=new_cache or default_cache,
        load=load,
        settings={"checkpoint": directory, "rate": rate},
    )


def from_module(spec: str) -> list[Method]:
    """``package.module:ATTR`` naming a list of Methods (or a function returning one)."""
    module_name, _, attr = spec.partition(":")
    value = getattr(importlib.import_module(module_name), attr or "METHODS")
    return list(value() if callable(value) else value)


def peers(interval: int) -> dict[str, Method]:
    from .peers import all_peers, variants

    return {m.name: m for m in all_peers(interval) + variants(interval)}


def resolve(names: list[str], interval: int, kvrewrite_specs: list[str], modules: list[str]) -> list[Method]:
    """Methods by name; ``peers`` expands to every peer. ``original`` always comes first (the reference)."""
    chosen: list[Method] = [original()]
    available: dict[str, Method] | None = None
    for name in names:
        if name == "original":
            continue
        if available is None:
            available = peers(interval)
        if name == "peers":
            chosen += list(available.values())
        elif name in available:
            chosen.append(available[name])
        else:
            raise SystemExit(f"unknown method {name!r}; known: original, peers, {', '.join(available)}")
    for spec in kvrewrite_specs:  # DIR:RATE
        directory, _, rate = spec.rpartition(":")
        chosen.append(kvrewrite_checkpoint(directory, float(rate)))
    for spec in modules:
        chosen += from_module(spec)
    seen: set[str] = set()
    return [m for m in chosen if not (m.name in seen or seen.add(m.name))]
