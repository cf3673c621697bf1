"""A transformers cache whose layers store codec-coded K/V latents plus a short float16 residual window.

`update()` appends the new tokens to the residual window; whenever the window holds more than `residual`
tokens, its oldest whole blocks of G tokens are encoded and appended to the coded store. Attention gets
decode(coded store) followed by the residual window as it was before that encoding: tokens coded by earlier
updates are read back decoded, the current update's own tokens at float16 (as KIVI's prefill attends at full
precision and quantizes afterwards), so the attention code needs no change. Everything kept per token is a tensor attribute of the layer (packed codes, scales, sparse
parts, the residual window), so the cache size is measured on what is really stored.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvrewrite.runtime.batch_first_layer import BatchFirstLayer
from kvrewrite.runtime.codecs.base import LayerCodec

RESIDUAL_DTYPE = torch.float16


def encode_append(codec: LayerCodec, store: dict | None, staged: torch.Tensor, n_blocks: int, side: str) -> dict:
    """Code the first n_blocks whole blocks of G tokens of `staged` [B, 1, S, C] and append them to `store`."""
    batch, _, _, c = staged.shape
    g = codec.block_tokens
    coded = codec.encode(staged[:, 0, : n_blocks * g].float().reshape(batch, n_blocks, g, c), side)
    if store is None:
        return coded
    return {name: torch.cat([store[name], coded[name]], dim=1) for name in store}


class CodecLayer(BatchFirstLayer):
    stored_dict_names = ("coded_keys", "coded_values")

    def __init__(self, codec: LayerCodec, residual: int):
        super().__init__()
        self.codec = codec
        self.residual_length = residual
        self.cumulative_length = 0
        self.coded_keys: dict[str, torch.Tensor] | None = None
        self.coded_values: dict[str, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty((key_states.shape[0], 1, 0, key_states.shape[-1]), dtype=RESIDUAL_DTYPE)
        self.values = value_states.new_empty((value_states.shape[0], 1, 0, value_states.shape[-1]), dtype=RESIDUAL_DTYPE)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states.to(RESIDUAL_DTYPE)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(RESIDUAL_DTYPE)], dim=-2)
        # Attention reads what was coded by *earlier* updates, then the window including this update's tokens at
        # float16: like KIVI's prefill, the tokens of the current forward attend to each other at full precision
        # and are coded for storage afterwards. (Coding first made every chunk of a chunked prefill read its own
        # oldest tokens back quantized, the attention sink of the first chunk included.)
        out = self._read("key", key_states.dtype), self._read("value", value_states.dtype)
        g = self.codec.block_tokens
        n_blocks = max(0, self.keys.shape[-2] - self.residual_length) // g
        if n_blocks:
            self.coded_keys = encode_append(self.codec, self.coded_keys, self.keys, n_blocks, "key")
            self.coded_values = encode_append(self.codec, self.coded_values, self.values, n_blocks, "value")
            self.keys = self.keys[..., n_blocks * g :, :].contiguous()
            self.values = self.values[..., n_blocks * g :, :].contiguous()
        return out

    def _read(self, side: str, dtype: torch.dtype) -> torch.Tensor:
        """What attention sees: the decoded blocks, then the residual window."""
        store, residual = (self.coded_keys, self.keys) if side == "key" else (self.coded_values, self.values)
        if store is None:
            return residual.to(dtype)
        decoded = self.codec.decode(store, side)  # [B, n, G, C]
        batch, n, g, c = decoded.shape
        return torch.cat([decoded.reshape(batch, 1, n * g, c).to(dtype), residual.to(dtype)], dim=-2)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.coded_keys = self.coded_values = None


class CodecCache(Cache):
    """One CodecLayer per decoder layer; pass it as `past_key_values` or let the model's generate() make it."""

    def __init__(self, layer_codecs: list[LayerCodec], residual: int):
        super().__init__(layers=[CodecLayer(codec, residual) for codec in layer_codecs])

    def stored_bytes(self) -> int:
        from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

        return cache_tensor_bytes(self)
