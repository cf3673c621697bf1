"""Bytes held by a cache, read off its real tensors.

Same counting as kvrewrite.runtime.cache_bytes.cache_tensor_bytes (byte ranges per storage merged so views are counted once),
re-implemented here because kvrewrite does not import in the benchmark env (transformers 5.2), and extended to
look inside tensor subclasses (quanto's packed QTensors keep their data, scales and shifts as inner tensors).

The model runs in float32 on CPU (faster and exact there); floating cache tensors are counted at 2 bytes per
element, what they hold when the model runs in fp16/bf16. Integer, packed and float8 tensors count as they are.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

FP16_BYTES = 2


def fp16_bytes_per_token(config: Any) -> int:
    """The original's fp16 cache per token: 2 bytes x (K and V) x layers x kv heads x head dim."""
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)
    return FP16_BYTES * 2 * int(config.num_hidden_layers) * n_kv * head_dim


def _leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Plain tensors behind ``t``: itself, or the inner tensors of a wrapper subclass, recursively."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _leaves(getattr(t, name))
    else:
        yield t


def _tensors_in(obj: Any, depth: int = 2) -> Iterator[torch.Tensor]:
    """Tensors in ``obj``'s attributes, looking ``depth`` container/object levels down."""
    if isinstance(obj, torch.Tensor):
        yield from _leaves(obj)
        return
    if depth < 0:
        return
    if isinstance(obj, (list, tuple)):
        values = list(obj)
    elif isinstance(obj, dict):
        values = list(obj.values())
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        values = list(vars(obj).values())
    else:
        return
    for value in values:
        yield from _tensors_in(value, depth - 1)


def _span_bytes(tensors: list[torch.Tensor]) -> int:
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for t in tensors:
        # 0-dim tensors are bookkeeping (lengths, positions), not cached keys/values.
        if t.dim() == 0 or t.numel() == 0 or t.device.type == "meta":
            continue
        es = t.element_size()
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        begin = t.storage_offset() * es
        spans.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append((begin, begin + extent * es))
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


def cache_bytes(cache: Any) -> int:
    """Bytes held by ``cache`` (float32/float64 tensors counted at 2 bytes per element, see the module doc)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"cannot measure a cache of type {type(cache).__name__}; expected a transformers Cache")
    tensors = [t for layer in layers for t in _tensors_in(layer)] + list(_tensors_in(cache, depth=1))
    total = 0
    for dtype in {t.dtype for t in tensors}:
        group = [t for t in tensors if t.dtype == dtype]
        held = _span_bytes(group)
        # Merged spans of one dtype are whole elements, so rescaling the sum keeps view de-duplication.
        total += held // dtype.itemsize * FP16_BYTES if dtype in (torch.float32, torch.float64) else held
    return total
