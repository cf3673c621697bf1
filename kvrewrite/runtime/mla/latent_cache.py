"""What an MLA layer caches, inside transformers' stock cache classes.

Per layer and token ONE row `[c | k_pe]` of width `kv_lora_rank + qk_rope_head_dim`: the latent c after
kv_a_layernorm (exactly what stock DeepseekV3 feeds kv_b_proj) and the shared RoPE key k_pe already rotated
at its position. The row is the layer's "keys" tensor `[B, 1, S, r + d_r]`; "values" is a zero-width
`[B, 1, S, 0]` tensor, because the values are a view of the same row (its first r columns).

One row rather than stock DeepseekV3's two tensors (c as keys, k_pe as values) so that decode scores every
query head against the whole row with one GEMM. Everything transformers does with a cache layer (append along
dim -2, select batch rows for beam search, crop) works on both tensors unchanged.

Appending: stock DynamicLayer appends with torch.cat, which copies the layer's whole cache on every decode step
(at 8K tokens and batch 8, more time than the absorbed attention itself). A layer this module fills is a
GrowingRowsLayer instead: the rows live in a buffer with spare room, and a step writes its row in place. The first
write (a prefill) allocates exactly its rows; an append that does not fit reallocates with spare rows: none below
256 tokens, then 1/16 of the length, at most 64. The spare room is counted as held memory (runtime/cache_bytes.py
counts the buffer).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

SPARE_FROM = 256  # below this many tokens a layer holds exactly its rows
SPARE_SHARE = 16  # then 1/16 of its length spare ...
SPARE_MAX = 64  # ... and never more than this many rows (0.8% at 8K tokens; one reallocation per 64 steps)


def spare_rows(needed: int) -> int:
    return 0 if needed < SPARE_FROM else min(needed // SPARE_SHARE, SPARE_MAX)


class GrowingRowsLayer(DynamicLayer):
    """A DynamicLayer whose keys are a view of a buffer with spare rows: appending writes in place.

    Anything else that replaces `keys` (crop, beam search's batch selection, batch repeat) assigns a new tensor; the
    next append sees that its view is gone and starts a new buffer from what `keys` holds then."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys
        length = held.shape[-2] if held.dim() == key_states.dim() else 0
        needed = length + key_states.shape[-2]
        buffer = getattr(self, "_buffer", None)
        ours = held is getattr(self, "_view", None)
        if not ours or buffer is None or buffer.shape[-2] < needed or buffer.shape[:-2] != key_states.shape[:-2]:
            # Spare rows only when appending: a prefill into an empty layer holds exactly its rows.
            spare = spare_rows(needed) if length else 0
            buffer = key_states.new_empty(*key_states.shape[:-2], needed + spare, key_states.shape[-1])
            if length:
                buffer[..., :length, :] = held
        buffer[..., length:needed, :] = key_states
        self._buffer = buffer
        self.keys = self._view = buffer[..., :needed, :]
        self.values = value_states.new_empty(*key_states.shape[:-2], needed, 0)
        return self.keys, self.values

    def reset(self) -> None:
        self._buffer = self._view = None
        super().reset()


def _growing_layer(cache, layer_idx: int) -> None:
    """Make the cache's layer layer_idx a GrowingRowsLayer if it is a stock DynamicLayer that holds nothing yet."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        while len(layers) <= layer_idx:  # a lazily built DynamicCache: create the layers it would create
            layers.append(DynamicLayer())
    if layer_idx < len(layers) and type(layers[layer_idx]) is DynamicLayer and not layers[layer_idx].is_initialized:
        layers[layer_idx] = GrowingRowsLayer()


def cache_latent_rows(cache, layer_idx: int, rows: torch.Tensor) -> torch.Tensor:
    """Append the new tokens' rows [B, 1, T, r + d_r] to the layer's cache; return all its rows [B, 1, S, r + d_r]."""
    _growing_layer(cache, layer_idx)
    no_values = rows.new_empty(*rows.shape[:-1], 0)
    stored, _ = cache.update(rows, no_values, layer_idx)
    return stored


def latent_cache_bytes(batch: int, tokens: int, layers: int, kv_lora_rank: int, rope_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes an MLA cache holds after one prefill of `tokens`: (r + d_r) values per token, layer and sequence (decode
    appends then add at most SPARE_MAX spare rows per layer)."""
    element = torch.empty((), dtype=dtype).element_size()
    return (kv_lora_rank + rope_dim) * tokens * batch * layers * element
