"""A transformers cache whose layers hold two tiers of one latent: a full-rank recent window, and aged tokens.

Every token enters the recent tier with all its latent dims. After each forward, tokens that no later query
reads at full rank (older than the last `window` tokens) move to the aged tier, keeping only each head's
prefix of `aged` ranks: the other dims are dropped, so the cache really holds fewer numbers. With a codec,
aged tokens are coded in blocks (a float16 staging run holds the tokens of an incomplete block). Every
stored tensor is an attribute of the layer, so kvrewrite.evaluation.cache_tensor_bytes measures what is held.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvrewrite.errors import InvalidArgumentError

STORAGE_DTYPE = torch.float16


def prefix_columns(block_width: int, ranks: tuple[int, ...]) -> list[int]:
    """Packed column indices that keep the first ranks[g] columns of every head's block of `block_width`."""
    return [g * block_width + i for g, r in enumerate(ranks) for i in range(r)]


class TieredLayer(DynamicLayer):
    """keys/values (the DynamicLayer fields) are the recent tier [B, 1, S_recent, n_kv * d] at full rank."""

    is_croppable = True

    def __init__(self, window: int, head_dim: int, aged_key_ranks: tuple[int, ...], aged_value_ranks: tuple[int, ...],
                 codec=None, storage_dtype: torch.dtype = STORAGE_DTYPE):
        super().__init__()
        self.window = window
        self.head_dim = head_dim
        self.aged_key_ranks, self.aged_value_ranks = tuple(aged_key_ranks), tuple(aged_value_ranks)
        self.codec = codec
        self.storage_dtype = storage_dtype
        self.cumulative_length = 0
        self.coded_length = 0  # aged tokens held as codec blocks (the rest of the aged tier is the staging run)
        self.aged_keys: torch.Tensor | None = None
        self.aged_values: torch.Tensor | None = None
        self.coded_keys: dict[str, torch.Tensor] | None = None
        self.coded_values: dict[str, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch = key_states.shape[0]
        self.keys = key_states.new_empty((batch, 1, 0, key_states.shape[-1]), dtype=self.storage_dtype)
        self.values = value_states.new_empty((batch, 1, 0, value_states.shape[-1]), dtype=self.storage_dtype)
        self.aged_keys = key_states.new_empty((batch, 1, 0, sum(self.aged_key_ranks)), dtype=self.storage_dtype)
        self.aged_values = value_states.new_empty((batch, 1, 0, sum(self.aged_value_ranks)), dtype=self.storage_dtype)
        self.is_initialized = True

    # ---- writes --------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens' full-rank packed latents [B, 1, T, n_kv * d] to the recent tier."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states.to(self.storage_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.storage_dtype)], dim=-2)
        return self.keys, self.values

    def settle(self) -> None:
        """Move every token older than the window to the aged tier, truncated to the aged ranks (then coded)."""
        moving = self.keys.shape[-2] - self.window
        if moving <= 0:
            return
        device = self.keys.device
        key_cols = torch.tensor(prefix_columns(self.head_dim, self.aged_key_ranks), dtype=torch.long, device=device)
        value_cols = torch.tensor(prefix_columns(self.head_dim, self.aged_value_ranks), dtype=torch.long, device=device)
        self.aged_keys = torch.cat([self.aged_keys, self.keys[..., :moving, :].index_select(-1, key_cols)], dim=-2)
        self.aged_values = torch.cat([self.aged_values, self.values[..., :moving, :].index_select(-1, value_cols)], dim=-2)
        self.keys = self.keys[..., moving:, :].contiguous()
        self.values = self.values[..., moving:, :].contiguous()
        if self.codec is not None:
            self._code_full_blocks()

    def _code_full_blocks(self) -> None:
        g = self.codec.block_tokens
        n_blocks = self.aged_keys.shape[-2] // g
        if not n_blocks:
            return
        self.coded_keys = self._encode_append(self.coded_keys, self.aged_keys, n_blocks, "key")
        self.coded_values = self._encode_append(self.coded_values, self.aged_values, n_blocks, "value")
        self.aged_keys = self.aged_keys[..., n_blocks * g :, :].contiguous()
        self.aged_values = self.aged_values[..., n_blocks * g :, :].contiguous()
        self.coded_length += n_blocks * g

    def _encode_append(self, store, staged: torch.Tensor, n_blocks: int, side: str):
        batch, _, _, c = staged.shape
        g = self.codec.block_tokens
        blocks = staged[:, 0, : n_blocks * g].float().reshape(batch, n_blocks, g, c)
        coded = self.codec.encode(blocks, side)
        if store is None:
            return coded
        return {name: torch.cat([store[name], coded[name]], dim=1) for name in store}

    # ---- reads ---------------------------------------------------------------------------------------------
    def aged_latents(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The aged tier as packed [B, 1, S_aged, sum ranks] keys and values (coded blocks decoded, then staging)."""
        keys, values = self.aged_keys.to(dtype), self.aged_values.to(dtype)
        if self.coded_keys is None:
            return keys, values
        decoded = []
        for store, staged in ((self.coded_keys, keys), (self.coded_values, values)):
            blocks = self.codec.decode(store, "key" if store is self.coded_keys else "value")  # [B, n, G, C]
            batch, n, g, c = blocks.shape
            decoded.append(torch.cat([blocks.reshape(batch, 1, n * g, c).to(dtype), staged], dim=-2))
        return decoded[0], decoded[1]

    def aged_length(self) -> int:
        return self.coded_length + (self.aged_keys.shape[-2] if self.aged_keys is not None else 0)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = self.coded_length = 0
        self.aged_keys = self.aged_values = None
        self.coded_keys = self.coded_values = None

    # ---- batch bookkeeping: every stored tensor is batch-first -------------------------------------------------
    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.aged_keys, self.aged_values = fn(self.aged_keys), fn(self.aged_values)
        for name in ("coded_keys", "coded_values"):
            store = getattr(self, name)
            if store is not None:
                setattr(self, name, {k: fn(v) for k, v in store.items()})

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        remove = -tokens_to_remove
        if remove == 0 or not self.is_initialized:
            return
        if remove > self.keys.shape[-2]:
            # Aged tokens lost their trailing dims: cropping back into them could not restore full rank.
            raise InvalidArgumentError(
                f"cannot crop {remove} tokens from a tiered cache whose full-rank window holds {self.keys.shape[-2]}"
            )
        self.keys, self.values = self.keys[..., :-remove, :], self.values[..., :-remove, :]
        self.cumulative_length -= remove

    def offload(self):
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.keys.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))


class TieredCache(Cache):
    """One TieredLayer per decoder layer. CompressedAttention recognises it (`is_tiered`) and attends tier by tier."""

    is_tiered = True

    def __init__(self, policy, head_dim: int, layer_codecs: list | None = None, storage_dtype: torch.dtype = STORAGE_DTYPE):
        codecs = layer_codecs if layer_codecs is not None else [None] * policy.num_layers
        super().__init__(layers=[
            TieredLayer(policy.window, head_dim, policy.aged_key_ranks[i], policy.aged_value_ranks[i], codecs[i], storage_dtype)
            for i in range(policy.num_layers)
        ])
        self.policy = policy

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask) -> torch.Tensor:
        """Store the new tokens, attend over both tiers, then age what left the window. Returns o_proj's input."""
        from kvrewrite.tiers.attention import tiered_attention

        layer = self.layers[module.layer_idx]
        layer.update(key.unsqueeze(1), value.unsqueeze(1))
        output = tiered_attention(module, query, layer, attention_mask)
        layer.settle()
        return output

    def stored_bytes(self) -> int:
        from kvrewrite.evaluation import cache_tensor_bytes

        return cache_tensor_bytes(self)
