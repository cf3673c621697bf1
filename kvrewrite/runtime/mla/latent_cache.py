"""What an MLA layer caches, inside transformers' stock cache classes.

Per layer and token ONE row `[c | k_pe]` of width `kv_lora_rank + qk_rope_head_dim`: the latent c after
kv_a_layernorm (exactly what stock DeepseekV3 feeds kv_b_proj) and the shared RoPE key k_pe already rotated
at its position. The row is the layer's "keys" tensor `[B, 1, S, r + d_r]`; "values" is a zero-width
`[B, 1, S, 0]` tensor, because the values are a view of the same row (its first r columns).

One row rather than stock DeepseekV3's two tensors (c as keys, k_pe as values) so that decode scores every
query head against the whole row with one GEMM. Everything transformers does with a cache layer (append along
dim -2, select batch rows for beam search, crop) works on both tensors unchanged.

Appending: stock DynamicLayer appends with torch.cat, which copies the layer's whole cache on every decode step
(at 8K tokens and batch 8, more time than the absorbed attention itself). The layer this module fills is a
runtime.inplace_cache.InPlaceLayer instead: the rows live in a buffer with room, and a step writes its row in place
(generate() sizes the buffer for its max_length; a hand-built cache grows it in large steps). The room is counted as
held memory (runtime/cache_bytes.py counts the buffer).
"""

from __future__ import annotations

import torch

from kvrewrite.runtime.inplace_cache import in_place_layer


def cache_latent_rows(cache, layer_idx: int, rows: torch.Tensor) -> torch.Tensor:
    """Append the new tokens' rows [B, 1, T, r + d_r] to the layer's cache; return all its rows [B, 1, S, r + d_r]."""
    in_place_layer(cache, layer_idx)
    no_values = rows.new_empty(*rows.shape[:-1], 0)
    stored, _ = cache.update(rows, no_values, layer_idx)
    return stored


def latent_cache_bytes(
    batch: int, tokens: int, layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype
) -> int:
    """Bytes an MLA cache holds after one prefill of `tokens`: (r + d_r) values per token, layer and sequence (decode
    appends then hold the buffer's room too, runtime.inplace_cache)."""
    element = torch.empty((), dtype=dtype).element_size()
    return (kv_lora_rank + rope_dim) * tokens * batch * layers * element
