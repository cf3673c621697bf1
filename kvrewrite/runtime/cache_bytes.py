"""Bytes a transformers Cache really holds: every tensor its layers (and the cache itself) keep, shared storage once.

Every cache form of kvrewrite (codec, tiered, evicting) keeps its stored tensors as attributes, so this one count
measures what each of them holds; evaluation and the tests compare it with each form's bytes formula.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from kvrewrite.errors import KVRewriteError


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors held directly by `obj`'s attributes, or one container level down (lists/tuples/dicts)."""
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def _held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes spanned by the tensors, counting memory shared between views once.

    Each tensor covers the byte range [offset, offset + span) of its storage (span = numel * element_size for a
    dense tensor); ranges on the same storage are merged, so keys/values that are views of one buffer, or an
    expanded tensor, are not double counted.
    """
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for t in tensors:
        # 0-dim tensors are bookkeeping (lengths, window sizes), not cached keys/values.
        if t.dim() == 0 or t.numel() == 0 or t.device.type == "meta":
            continue
        es = t.element_size()
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        begin = t.storage_offset() * es
        key = (str(t.device), t.untyped_storage().data_ptr())
        spans.setdefault(key, []).append((begin, begin + extent * es))
    total = 0
    for ranges in spans.values():
        ranges.sort()
        cur_start, cur_end = ranges[0]
        for start, end in ranges[1:]:
            if start > cur_end:
                total += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        total += cur_end - cur_start
    return total


def cache_tensor_bytes(cache: Any, float_bytes: int | None = None) -> int:
    """Total bytes of the tensors held by a transformers Cache (its layers and any tensors it holds itself).

    float_bytes: count floating-point tensors at this many bytes per number (2: as if a float32 cache were held in
    float16, the frontier's counting); None counts every tensor as it is."""
    tensors: list[torch.Tensor] = []
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            tensors.extend(_tensors_in(layer))
        tensors.extend(_tensors_in(cache))
    elif isinstance(cache, (list, tuple)):
        # Legacy tuple-of-(key, value, ...) format from custom models.
        for entry in cache:
            items = entry if isinstance(entry, (list, tuple)) else (entry,)
            tensors.extend(v for v in items if isinstance(v, torch.Tensor))
    else:
        raise KVRewriteError(f"cannot measure a cache of type {type(cache).__name__}; expected a transformers Cache")
    if float_bytes is None:
        return _held_bytes(tensors)
    total = 0
    for dtype in {t.dtype for t in tensors}:
        held = _held_bytes([t for t in tensors if t.dtype == dtype])
        # Merged spans of one dtype are whole numbers of elements, so rescaling keeps views counted once.
        total += held // dtype.itemsize * float_bytes if dtype.is_floating_point else held
    return total
