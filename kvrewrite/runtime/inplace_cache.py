"""A cache layer that writes each step's tokens in place: no copy of the whole cache per decode step.

transformers' DynamicLayer appends with `torch.cat`, which copies a layer's whole cache on every decode step (at 8K
tokens this costs more than the attention that reads it). An InPlaceLayer keeps keys and values as views of buffers
with room along the sequence dim (-2, in every memory order of kernels.cache_layout), and a step writes its rows into
that room:

- with a capacity (generate() knows its max_length), the first write allocates exactly that many rows and nothing is
  ever reallocated: the held bytes are those of a StaticCache of that length;
- without one (a cache a user builds by hand), a prefill allocates exactly its rows, and an append that does not fit
  reallocates in large steps (`grown_capacity`: an eighth of the length, 256 to 4096 rows), so the copy happens once
  per hundreds of steps instead of every step; below 256 rows it holds exactly its rows (a copy that small costs
  nothing worth the room).

Beam search (`reorder_cache`), `crop` and batch selection keep working: they write into or re-view the same buffers,
or replace them, after which the next append starts a new buffer from what the layer holds.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

GROW_FROM = 256  # below this many rows a layer without a capacity holds exactly its rows (copies are cheap there)
GROW_MIN = 256  # then it adds at least this many rows when it outgrows its buffer ...
GROW_SHARE = 8  # ... or an eighth of its length ...
GROW_MAX = 4096  # ... and never more than this many rows at once


def grown_capacity(needed: int) -> int:
    """Rows a buffer without a set capacity gets when `needed` rows no longer fit."""
    if needed < GROW_FROM:
        return needed
    return needed + min(max(needed // GROW_SHARE, GROW_MIN), GROW_MAX)


class InPlaceLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of preallocated buffers; appending writes in place."""

    def __init__(self, capacity: int | None = None):
        super().__init__()
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be a positive number of tokens, got {capacity}")
        self.capacity = capacity
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append("keys", self.keys, key_states)
        self.values = self._append("values", self.values, value_states)
        return self.keys, self.values

    def _append(self, name: str, held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        length = held.shape[-2] if held.dim() == new.dim() else 0
        needed = length + new.shape[-2]
        buffer = self._buffers.get(name)
        ours = held is self._views.get(name)
        if not ours or buffer is None or buffer.shape[-2] < needed or buffer.shape[:-2] != new.shape[:-2] \
                or buffer.shape[-1] != new.shape[-1] or buffer.dtype != new.dtype or buffer.device != new.device:
            if self.capacity is not None and needed <= self.capacity:
                rows = self.capacity
            else:
                rows = grown_capacity(needed) if length else needed  # a first write holds exactly its rows
            buffer = new.new_empty(*new.shape[:-2], rows, new.shape[-1])
            if length:
                buffer[..., :length, :] = held
            self._buffers[name] = buffer
        buffer[..., length:needed, :] = new
        view = buffer[..., :needed, :]
        self._views[name] = view
        return view

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # stock checks and views; re-view them as ours so the room is kept
        if self.is_initialized and self.keys is not None:
            for name in ("keys", "values"):
                held, buffer = getattr(self, name), self._buffers.get(name)
                if buffer is not None and held.dim() == buffer.dim() and held.data_ptr() == buffer.data_ptr():
                    view = buffer[..., : held.shape[-2], :]
                    setattr(self, name, view)
                    self._views[name] = view

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the selected rows are gathered, then written back into the same buffers."""
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return
        for name in ("keys", "values"):
            held = getattr(self, name)
            chosen = held.index_select(0, beam_idx.to(held.device))
            if held is self._views.get(name) and chosen.shape == held.shape:
                held.copy_(chosen)
            else:
                setattr(self, name, chosen)

    def reset(self) -> None:
        self._buffers, self._views = {}, {}
        super().reset()


def in_place_layer(cache, layer_idx: int) -> None:
    """Make layer `layer_idx` of a stock cache an InPlaceLayer if it is a plain DynamicLayer holding nothing yet.

    A DynamicCache a caller built (or generate()'s default) then appends in place too. Sliding-window, static,
    quantized and kvrewrite's own layers are left as they are."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        while len(layers) <= layer_idx:  # a lazily built DynamicCache: create the layers it would create
            layers.append(DynamicLayer())
    if layer_idx < len(layers) and type(layers[layer_idx]) is DynamicLayer and not layers[layer_idx].is_initialized:
        layers[layer_idx] = InPlaceLayer()


def in_place_cache(config, capacity: int | None = None) -> Cache:
    """A DynamicCache for `config` whose full-attention layers are InPlaceLayers holding `capacity` tokens
    (None: grow in large steps). Sliding-window layers stay transformers' own (they hold a bounded window)."""
    cache = DynamicCache(config=config)
    if not cache.layers:  # a config that did not say its layers: they are created lazily as InPlaceLayers
        return Cache(layer_class_to_replicate=lambda: InPlaceLayer(capacity))
    cache.layers = [InPlaceLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
