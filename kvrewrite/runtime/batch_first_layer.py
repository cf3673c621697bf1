"""Batch bookkeeping shared by kvrewrite's cache layers (codec and tiered), whose every stored tensor is batch-first.

A subclass names its stored tensors in `stored_tensor_names` (plain tensors) and `stored_dict_names` (dicts of
tensors, e.g. a codec's packed codes and scales); beam search, batch expansion and selection, and offloading then
act on all of them, so no stored tensor is left with a stale batch.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from kvrewrite.errors import InvalidArgumentError


class BatchFirstLayer(DynamicLayer):
    stored_tensor_names: tuple[str, ...] = ("keys", "values")
    stored_dict_names: tuple[str, ...] = ()
    # What keys/values hold, for crop's message (only they can be cropped: older tokens were coded or cut).
    window_description = "full-precision window"
    is_croppable = True

    def crop(self, max_length: int) -> None:
        """Keep the first max_length tokens (transformers' semantics; a negative value removes that many)."""
        remove = -max_length if max_length < 0 else self.get_seq_length() - max_length
        if remove <= 0 or not self.is_initialized:
            return
        if remove > self.keys.shape[-2]:
            raise InvalidArgumentError(
                f"cannot crop {remove} tokens from a {type(self).__name__} whose {self.window_description} holds "
                f"{self.keys.shape[-2]}"
            )
        self.keys, self.values = self.keys[..., :-remove, :], self.values[..., :-remove, :]
        self.cumulative_length -= remove

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for name in self.stored_tensor_names:
            value = getattr(self, name, None)
            if value is not None:
                setattr(self, name, fn(value))
        for name in self.stored_dict_names:
            store = getattr(self, name, None)
            if store is not None:
                setattr(self, name, {k: fn(v) for k, v in store.items()})

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def offload(self):
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.keys.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))
