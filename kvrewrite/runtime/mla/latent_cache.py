"""What an MLA layer caches, inside transformers' stock cache classes.

Per layer and token ONE row `[c | k_pe]` of width `kv_lora_rank + qk_rope_head_dim`: the latent c after
kv_a_layernorm (exactly what stock DeepseekV3 feeds kv_b_proj) and the shared RoPE key k_pe already rotated
at its position. The row is the layer's "keys" tensor `[B, 1, S, r + d_r]`; "values" is a zero-width
`[B, 1, S, 0]` tensor, because the values are a view of the same row (its first r columns).

One row rather than stock DeepseekV3's two tensors (c as keys, k_pe as values) so that decode scores every
query head against the whole row with one GEMM. Everything transformers does with a cache layer (append along
dim -2, select batch rows for beam search, crop) works on both tensors unchanged.
"""

from __future__ import annotations

import torch


def cache_latent_rows(cache, layer_idx: int, rows: torch.Tensor) -> torch.Tensor:
    """Append the new tokens' rows [B, 1, T, r + d_r] to the layer's cache; return all its rows [B, 1, S, r + d_r]."""
    no_values = rows.new_empty(*rows.shape[:-1], 0)
    stored, _ = cache.update(rows, no_values, layer_idx)
    return stored


def latent_cache_bytes(batch: int, tokens: int, layers: int, kv_lora_rank: int, rope_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes an MLA cache holds: (r + d_r) values per token, layer and sequence."""
    element = torch.empty((), dtype=dtype).element_size()
    return (kv_lora_rank + rope_dim) * tokens * batch * layers * element
