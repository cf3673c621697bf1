"""A transformers cache whose layers store codec-coded K/V latents plus a short float16 residual window.

`update()` appends the new tokens to the residual window; whenever the window holds more than `residual`
tokens, its oldest whole blocks of G tokens are encoded and appended to the coded store. Attention reads the
blocks coded by earlier updates, then the residual window as it was before that encoding (this update's own
tokens at float16, as KIVI's prefill attends at full precision and quantizes afterwards). How it reads them:

- fused (codecs with a `fused_layout()`, int4/int2, unless switched off): `update_coded()` returns a
  `CodedReadout` (the packed blocks and the window) and the attention dequantises block by block as it attends
  (kernels.coded_attention); nothing decodes the whole store;
- decode (every other codec, and the reference for the fused path): `update()` returns decode(coded store)
  followed by the window, so the attention code needs no change; this decodes the whole store every forward.

Everything kept per token is a tensor attribute of the layer (packed codes, scales, sparse parts, the residual
window), so the cache size is measured on what is really stored.
"""

from __future__ import annotations

import os

import torch
from transformers.cache_utils import Cache

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.batch_first_layer import BatchFirstLayer
from kvrewrite.runtime.codecs.base import LayerCodec
from kvrewrite.runtime.codecs.readout import CodedReadout, QuantizedBlocks
from kvrewrite.runtime.inplace_cache import append_in_place

RESIDUAL_DTYPE = torch.float16
READ_MODES = ("fused", "decode")


def default_read_mode() -> str:
    """`KVREWRITE_CODEC_READ`: `fused` (default: attention reads coded blocks in place where the codec allows)
    or `decode` (always hand attention the decoded store, the reference path)."""
    mode = os.environ.get("KVREWRITE_CODEC_READ", "fused").strip().lower() or "fused"
    if mode not in READ_MODES:
        raise InvalidArgumentError(f"KVREWRITE_CODEC_READ={mode!r}; choose one of {', '.join(READ_MODES)}")
    return mode


def encode_append(
    codec: LayerCodec,
    store: dict | None,
    staged: torch.Tensor,
    n_blocks: int,
    side: str,
    buffers: dict | None = None,
    capacity: int | None = None,
    grow: bool = True,
) -> dict:
    """Code the first n_blocks whole blocks of G tokens of `staged` [B, 1, S, C] and append them to `store`.

    With `buffers` (a dict the caller keeps, so the room is counted as held memory) every coded tensor is a prefix
    view of a buffer with room along the block dim: appending writes in place, and the store is copied only when it
    outgrows its buffer (runtime.inplace_cache.append_in_place), not on every block. `capacity` (in blocks) and
    `grow` are append_in_place's: the most blocks the store will hold where known, and whether a store without one
    grows in large steps (True) or holds exactly its blocks (False)."""
    batch, _, _, c = staged.shape
    g = codec.block_tokens
    blocks = staged[:, 0, : n_blocks * g].float().reshape(batch, n_blocks, g, c)
    coded = codec.encode_next(blocks, side, store)
    if buffers is None:
        return coded if store is None else {name: torch.cat([store[name], coded[name]], dim=1) for name in store}
    appended = {}
    for name, new in coded.items():
        buffers[name], appended[name] = append_in_place(
            buffers.get(name), None if store is None else store[name], new, 1, capacity, g, grow
        )
    return appended


class CodecLayer(BatchFirstLayer):
    stored_dict_names = ("coded_keys", "coded_values")

    def __init__(self, codec: LayerCodec, residual: int):
        super().__init__()
        self.codec = codec
        self.residual_length = residual
        self.cumulative_length = 0
        self.coded_keys: dict[str, torch.Tensor] | None = None
        self.coded_values: dict[str, torch.Tensor] | None = None
        # The buffers the coded stores are views of (encode_append): held memory, counted by cache_tensor_bytes.
        self.coded_key_buffers: dict[str, torch.Tensor] = {}
        self.coded_value_buffers: dict[str, torch.Tensor] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty((key_states.shape[0], 1, 0, key_states.shape[-1]), dtype=RESIDUAL_DTYPE)
        self.values = value_states.new_empty(
            (value_states.shape[0], 1, 0, value_states.shape[-1]), dtype=RESIDUAL_DTYPE
        )
        self.is_initialized = True

    @property
    def fused_layout(self) -> QuantizedBlocks | None:
        """The codec's in-place layout (codecs.readout), or None when attention needs decoded tensors."""
        layout = getattr(self.codec, "fused_layout", None)  # stand-in codecs (tests) may lack the method
        return layout() if layout is not None else None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode path: append, then return decode(store) + window (every stored token, decoded)."""
        self._stage(key_states, value_states)
        # Attention reads what was coded by *earlier* updates, then the window including this update's tokens at
        # float16: like KIVI's prefill, the tokens of the current forward attend to each other at full precision
        # and are coded for storage afterwards. (Coding first made every chunk of a chunked prefill read its own
        # oldest tokens back quantized, the attention sink of the first chunk included.)
        out = self._read("key", key_states.dtype), self._read("value", value_states.dtype)
        self._code_overflow()
        return out

    def update_coded(self, key_states: torch.Tensor, value_states: torch.Tensor) -> CodedReadout:
        """The fused path: append, then return the coded blocks and the window as they are (nothing decoded).

        Same reading order as update(): coding the overflow afterwards builds new tensors, so the readout keeps
        what attention must see.
        """
        layout = self.fused_layout
        if layout is None:
            raise InvalidArgumentError(f"codec {type(self.codec).__name__} cannot be read in place; use update()")
        self._stage(key_states, value_states)
        readout = CodedReadout(layout, self.coded_keys, self.coded_values, self.keys, self.values)
        self._code_overflow()
        return readout

    def _stage(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states.to(RESIDUAL_DTYPE)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(RESIDUAL_DTYPE)], dim=-2)

    def _code_overflow(self) -> None:
        """Code the window's oldest whole blocks beyond `residual` tokens into the store."""
        g = self.codec.block_tokens
        n_blocks = max(0, self.keys.shape[-2] - self.residual_length) // g
        if n_blocks:
            self.coded_keys = encode_append(
                self.codec, self.coded_keys, self.keys, n_blocks, "key", self.coded_key_buffers
            )
            self.coded_values = encode_append(
                self.codec, self.coded_values, self.values, n_blocks, "value", self.coded_value_buffers
            )
            self.keys = self.keys[..., n_blocks * g :, :].contiguous()
            self.values = self.values[..., n_blocks * g :, :].contiguous()

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
        self.coded_key_buffers, self.coded_value_buffers = {}, {}


class CodecCache(Cache):
    """One CodecLayer per decoder layer; pass it as `past_key_values` or let the model's generate() make it."""

    def __init__(self, layer_codecs: list[LayerCodec], residual: int, read_mode: str | None = None):
        super().__init__(layers=[CodecLayer(codec, residual) for codec in layer_codecs])
        self.read_mode = read_mode or default_read_mode()
        if self.read_mode not in READ_MODES:
            raise InvalidArgumentError(f"read_mode must be one of {', '.join(READ_MODES)}, got {self.read_mode!r}")

    def reads_coded(self, layer_idx: int) -> bool:
        """Whether attention should call update_coded() for this layer (fused reads on, the codec allows them)."""
        return self.read_mode == "fused" and self.layers[layer_idx].fused_layout is not None

    def update_coded(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> CodedReadout:
        """Cache.update's fused counterpart (token-major [B, 1, T, C] states): see CodecLayer.update_coded."""
        return self.layers[layer_idx].update_coded(key_states, value_states)

    def stored_bytes(self) -> int:
        from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

        return cache_tensor_bytes(self)
