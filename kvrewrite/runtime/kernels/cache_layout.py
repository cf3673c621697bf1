"""How a layer's packed latents sit in memory inside the (stock) transformers cache.

Logically every rewritten layer caches keys `[B, 1, S, sum rk]` and values `[B, 1, S, sum rv]` (the packed
layout of kernels.reference). Two memory orders hold that tensor; both are 4-D with the sequence on dim -2,
which is all transformers' cache classes need (they concatenate / index_copy along dim -2 and select
along dim 0):

- ROWS: the cache tensor is `[B, 1, S, C]` itself, token-major (one contiguous row of all heads' columns
  per token). The Triton kernels, the codec cache and the latent/crosshead modes use it.
- COLUMNS: the cache tensor is `[B, C, S, 1]`, column-major: each latent dimension is one contiguous run
  of S values, so KV head g's keys are the contiguous `[rk_g, S]` block K_g^T. The torch runner on CPU
  uses it: a decode step is then one plain GEMM per head on contiguous memory (`q_g @ K_g^T`), where on
  the token-major rows every torch kernel that reads one head's columns runs at a fraction of memory
  speed (docs/runtime.md has the measurements). `packed_view` turns it back into the logical
  `[B, 1, S, C]` as a view, no copy.
"""

from __future__ import annotations

import torch

ROWS = "rows"
COLUMNS = "columns"


def to_storage(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """New tokens' packed latents [B, T, C] -> the 4-D tensor handed to the cache's update()."""
    if layout == COLUMNS:
        return packed.transpose(1, 2).unsqueeze(-1)  # [B, C, T, 1]
    return packed.unsqueeze(1)  # [B, 1, T, C]


def packed_view(stored: torch.Tensor) -> torch.Tensor:
    """A cache tensor in either memory order -> the logical packed [B, 1, S, C] (a view, never a copy).

    The order is read off the shape: COLUMNS tensors are [B, C, S, 1]. With C = 1 both orders are the
    same tensor, and [B, 1, S, 1] is returned as is.
    """
    if stored.shape[1] != 1 and stored.shape[-1] == 1:
        return stored.permute(0, 3, 2, 1)
    return stored


def is_column_major(packed: torch.Tensor) -> bool:
    """True when a logical [B, 1, S, C] tensor is a view of COLUMNS storage (each column contiguous over S)."""
    return packed.shape[-1] > 1 and packed.shape[-2] > 1 and packed.stride(-2) == 1
