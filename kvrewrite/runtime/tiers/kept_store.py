"""Per-token stores of an evicting cache (the kept tier, the floor) held in buffers and written in place.

A store is a flat dict of batch-first tensors [B, S, ...] (codes, scales, minimums, cache indices), one row per
token, in no particular order: every token carries its cache index, and attention masks and rotates by it. So a
token that enters the kept tier takes the row an evicted token frees, and only the rows that change are written;
nothing copies or re-orders the whole store per step.

Each tensor the layer reads is a prefix view of a buffer along the token dim (1):

- with a capacity (the longest sequence the cache will see, as generate() knows it), the buffer is allocated once
  with the most rows the store can ever hold, like a StaticCache;
- without one (a cache built by hand, or the frontier's `make_kv_cache()`), it holds exactly the rows in use, so the
  bytes held are what they were when every step concatenated: a store that grows reallocates, one that only
  replaces evicted tokens writes in place. A capacity that turns out too small grows by `grown_capacity`.

The buffers are tensor attributes of the layer (kvrewrite.runtime.cache_bytes counts them once with their views).
"""

from __future__ import annotations

import torch

from kvrewrite.runtime.inplace_cache import reserve_in_place

TOKEN_DIM = 1


def reserve_rows(
    buffers: dict[str, torch.Tensor], held: dict[str, torch.Tensor], rows: int, capacity: int | None
) -> dict[str, torch.Tensor]:
    """Views of `rows` rows for every tensor of `held`, its rows first (inplace_cache.reserve_in_place: exactly
    `rows` without a capacity). `buffers` is updated; rows beyond `held`'s are left for the caller to write."""
    views = {}
    for name, tensor in held.items():
        buffers[name], views[name] = reserve_in_place(buffers.get(name), tensor, rows, TOKEN_DIM, capacity, grow=False)
    return views


def write_rows(
    store: dict[str, torch.Tensor],
    slots: torch.Tensor,
    new: dict[str, torch.Tensor],
    chosen: torch.Tensor | None = None,
) -> None:
    """store[name][b, slots[b, j]] = new[name][b, j] for the new tokens j chosen [B, n] (None: all of them)."""
    if chosen is None:
        for name, tensor in store.items():
            rows = new[name]
            index = slots.view(*slots.shape, *([1] * (rows.dim() - 2))).expand_as(rows)
            tensor.scatter_(TOKEN_DIM, index, rows)
        return
    batch_index, token_index = chosen.nonzero(as_tuple=True)  # rows differ in how many new tokens stay
    target = slots[batch_index, token_index]
    for name, tensor in store.items():
        tensor[batch_index, target] = new[name][batch_index, token_index]


def take_rows(store: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows `index` [B, n] of every [B, S, ...] tensor (a copy of those rows only)."""
    out = {}
    for name, tensor in store.items():
        expanded = index.view(*index.shape, *([1] * (tensor.dim() - 2))).expand(-1, -1, *tensor.shape[2:])
        out[name] = tensor.gather(TOKEN_DIM, expanded)
    return out


def joined_rows(
    store: dict[str, torch.Tensor], new: dict[str, torch.Tensor], index: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Rows `index` [B, n] of the store followed by the new tokens (index >= the store's length reads `new`),
    without joining them."""
    length = next(iter(store.values())).shape[TOKEN_DIM]
    n_new = next(iter(new.values())).shape[TOKEN_DIM]
    from_store = index < length
    old = take_rows(store, index.clamp(max=max(length - 1, 0))) if length else None
    fresh = take_rows(new, (index - length).clamp(0, max(n_new - 1, 0))) if n_new else None
    out = {}
    for name in store:
        if old is None or fresh is None:
            out[name] = (old or fresh)[name]
            continue
        mask = from_store.view(*from_store.shape, *([1] * (old[name].dim() - 2)))
        out[name] = torch.where(mask, old[name], fresh[name])
    return out


def capacity_rows(capacity: int | None, window: int, keep: float, sinks: int = 0) -> tuple[int | None, int | None]:
    """(kept rows, floor rows) the stores of a sequence of at most `capacity` tokens can need: the budget
    round(keep x tokens beyond the window), never under the sinks that have left it, and the rest grow with the
    tokens seen, so their largest values bound them."""
    if capacity is None:
        return None, None
    beyond = max(capacity - window, 0)
    kept = round(keep * beyond)
    return max(kept, min(sinks, beyond), 1), max(beyond - kept, 1)
