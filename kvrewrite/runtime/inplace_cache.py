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


def grown_capacity(needed: int, tokens_per_row: int = 1) -> int:
    """Rows a buffer without a set capacity gets when `needed` rows no longer fit (the thresholds are in tokens: a
    codec's coded store has one row per block of `tokens_per_row` tokens)."""
    tokens = needed * tokens_per_row
    if tokens < GROW_FROM:
        return needed
    return needed + -(-min(max(tokens // GROW_SHARE, GROW_MIN), GROW_MAX) // tokens_per_row)


def is_prefix_view(held: torch.Tensor, buffer: torch.Tensor, dim: int) -> bool:
    """Whether `held` is buffer.narrow(dim, 0, n) for some n: same start, same strides, same other sizes.

    The start is compared as storage and offset: a view of no rows reports data_ptr() 0, yet it is the start of its
    buffer (a tier emptied in place, then written again)."""
    return (
        held.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and held.storage_offset() == buffer.storage_offset()
        and held.stride() == buffer.stride()
        and held.dtype == buffer.dtype
        and held.shape[:dim] + held.shape[dim + 1 :] == buffer.shape[:dim] + buffer.shape[dim + 1 :]
    )


def reserve_in_place(
    buffer: torch.Tensor | None,
    held: torch.Tensor,
    rows: int,
    dim: int,
    capacity: int | None = None,
    tokens_per_row: int = 1,
    grow: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): a prefix view of `rows` rows along `dim` whose first rows are `held`'s; the rows after them
    are left for the caller to write.

    In place when `held` is a prefix view of `buffer` (what this returned, or a crop of it) and the rows fit;
    otherwise a new buffer of `capacity` rows (when they fit) or of grown_capacity rows is allocated and `held`
    copied in once (after beam or batch selection replaced it, say). With grow=False and no capacity, the new buffer
    has exactly `rows`: the bytes held are those of a concatenation (a cache whose held bytes are measured as they
    were, the frontier's), and the copy happens at every append that does not fit.
    """
    dim = dim % held.dim()
    length = held.shape[dim]
    fits = (
        buffer is not None
        and buffer.shape[dim] >= rows
        and buffer.device == held.device
        and is_prefix_view(held, buffer, dim)
    )
    if not fits:
        if capacity is not None and rows <= capacity:
            size = capacity
        else:
            grows = length > 0 and (grow or capacity is not None)  # else a first write or exact rows: just its rows
            size = grown_capacity(rows, tokens_per_row) if grows else rows
        buffer = held.new_empty(*held.shape[:dim], size, *held.shape[dim + 1 :])
        if length:
            buffer.narrow(dim, 0, length).copy_(held)
    return buffer, buffer.narrow(dim, 0, rows)


def append_in_place(
    buffer: torch.Tensor | None,
    held: torch.Tensor | None,
    new: torch.Tensor,
    dim: int,
    capacity: int | None = None,
    tokens_per_row: int = 1,
    grow: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): `held` followed by `new` along `dim`, as a prefix view of a buffer with room
    (reserve_in_place, then `new` written after `held`'s rows)."""
    dim = dim % new.dim()
    if held is None:
        held = new.narrow(dim, 0, 0)
    length = held.shape[dim]
    buffer, view = reserve_in_place(buffer, held, length + new.shape[dim], dim, capacity, tokens_per_row, grow)
    view.narrow(dim, length, new.shape[dim]).copy_(new)
    return buffer, view


class InPlaceLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of preallocated buffers; appending writes in place."""

    def __init__(self, capacity: int | None = None):
        super().__init__()
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be a positive number of tokens, got {capacity}")
        self.capacity = capacity
        self._buffers: dict[str, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append("keys", self.keys, key_states)
        self.values = self._append("values", self.values, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # From the token axis whatever the width: at a high rate a layer may cache zero key dims ([B, 1, S, 0]), which
        # DynamicLayer would count as 0 tokens, and a chunked prefill would then mask a cache of the wrong length.
        return self.keys.shape[-2] if self.is_initialized and self.keys is not None and self.keys.dim() >= 2 else 0

    def _append(self, name: str, held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        held = held if held.dim() == new.dim() else None  # DynamicLayer starts from an empty 1-D tensor
        # A crop leaves a prefix view of the buffer: the next append writes over the cropped rows in place.
        self._buffers[name], view = append_in_place(self._buffers.get(name), held, new, -2, self.capacity)
        return view

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the selected rows are gathered, then written back into the same buffers."""
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return
        for name in ("keys", "values"):
            held = getattr(self, name)
            chosen = held.index_select(0, beam_idx.to(held.device))
            buffer = self._buffers.get(name)
            if buffer is not None and is_prefix_view(held, buffer, -2 % held.dim()) and chosen.shape == held.shape:
                held.copy_(chosen)
            else:
                setattr(self, name, chosen)

    def reset(self) -> None:
        self._buffers = {}
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
