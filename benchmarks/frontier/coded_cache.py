"""A quantized KV cache whose codes survive eviction: per-token int8/int4 codes (or FP8) that a kvpress press can
prune by token without re-quantizing what it keeps.

transformers' QuantizedCache does not stack with a press: kvpress dequantizes it, gathers the kept floats and
quantizes them again (codes drift, and quanto's KIVI axes refuse lengths that are not a multiple of their group).
Here every stored tensor has the token on dim -2 and nothing is shared across tokens: codes are per token and per
KV head, scales and zeros per (token, head, group along head_dim). Keeping a subset of tokens is then a gather of
the stored codes, bit for bit (``CodedLayer.keep``).

- No float residual: every token, the current chunk's too, is stored as codes and attention reads their
  dequantized values (as ``fp8_cache.FP8Cache`` does), so what attention reads is exactly what the cache holds and
  the bytes are codes + scales + zeros, nothing else.
- ``keys`` / ``values`` are the dequantized held tokens, computed on read (kvpress's hooks read them to score).
  Assigning them back is accepted only when the tensor is what the layer serves (the press kept tokens through
  ``keep`` first); any other float tensor would need re-quantizing, so it is refused rather than drifting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

FP8 = torch.float8_e4m3fn
Parts = dict[str, torch.Tensor]


def _fp16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` rounded to float16 toward +inf (``up``) or -inf, so the stored range still covers the data."""
    h = x.half()
    off = h.float() < x if up else h.float() > x
    return torch.where(off, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h)


@dataclass(frozen=True)
class IntCodec:
    """Asymmetric ``bits``-bit codes per token, per head, per group of ``group`` channels (None: all of head_dim),
    with a float16 scale and zero per group: x ~= code * scale + zero, |error| <= scale / 2.

    int4 codes are packed two per byte along head_dim (even channel in the low nibble)."""

    bits: int
    group: int | None = None

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group or x.shape[-1]
        if x.shape[-1] % group:
            raise ValueError(f"group {group} does not divide head_dim {x.shape[-1]}")
        return x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)

    def encode(self, x: torch.Tensor) -> Parts:
        qmax = 2**self.bits - 1
        g = self._groups(x)
        # Zero rounded down and scale up in float16, so [zero, zero + qmax * scale] covers the group.
        zero = _fp16_toward(g.amin(-1), up=False)
        # A constant group would get scale 0; the smallest float16 (2^-24, subnormal) keeps the division finite.
        scale = _fp16_toward((g.amax(-1) - zero.float()) / qmax, up=True).clamp_min(2.0**-24)
        codes = ((g - zero.float()[..., None]) / scale.float()[..., None]).round().clamp(0, qmax).to(torch.uint8)
        codes = codes.reshape(x.shape)
        if self.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return {"codes": codes.contiguous(), "scale": scale.contiguous(), "zero": zero.contiguous()}

    def decode(self, parts: Parts) -> torch.Tensor:
        codes = parts["codes"]
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)
        scale, zero = parts["scale"].float(), parts["zero"].float()
        g = codes.float().reshape(*scale.shape, -1)
        return (g * scale[..., None] + zero[..., None]).reshape(codes.shape)


@dataclass(frozen=True)
class FP8Codec:
    """float8 e4m3 storage, no scale: the same codes as ``fp8_cache.FP8Cache`` (vLLM's fp8 cache at scale 1.0)."""

    name: str = "fp8"

    def encode(self, x: torch.Tensor) -> Parts:
        return {"codes": x.to(FP8)}

    def decode(self, parts: Parts) -> torch.Tensor:
        return parts["codes"].float()


Codec = IntCodec | FP8Codec
CODECS: dict[str, Codec] = {"int8": IntCodec(8), "int4": IntCodec(4), "fp8": FP8Codec()}


def _cat(a: Parts | None, b: Parts) -> Parts:
    return b if a is None else {k: torch.cat([a[k], b[k]], dim=-2) for k in b}


class CodedLayer(DynamicLayer):
    """One layer's keys and values as codec parts, each [batch, kv heads, tokens, *]."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.key_parts: Parts | None = None
        self.value_parts: Parts | None = None
        super().__init__()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.key_parts = _cat(self.key_parts, self.codec.encode(key_states))
        self.value_parts = _cat(self.value_parts, self.codec.encode(value_states))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.key_parts is None else self.key_parts["codes"].shape[-2]

    def keep(self, indices: torch.Tensor) -> None:
        """Keep the tokens ``indices`` [batch, kv heads, n] (per head, in that order): a gather of the stored codes,
        scales and zeros, never re-quantized."""
        for parts in (self.key_parts, self.value_parts):
            for name, t in parts.items():
                # Gathered as raw bytes: torch has no gather for float8 on CPU, and bytes are what must not change.
                raw = t.view(torch.uint8) if t.dtype == FP8 else t
                kept = raw.gather(2, indices.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])).contiguous()
                parts[name] = kept.view(t.dtype)

    def _decoded(self, parts: Parts | None) -> torch.Tensor | None:
        return None if parts is None else self.codec.decode(parts).to(self.dtype)

    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        if value is None or value.numel() == 0:  # transformers' reset / initialisation
            setattr(self, name, None)
            return
        if not torch.equal(value, getattr(self, name[: -len("_parts")] + "s")):
            raise ValueError(
                "CodedLayer holds codes: keep tokens with keep(indices); assigning other floats would re-quantize"
            )

    # kvpress reads `layer.keys` / `layer.values` to score and assigns the pressed ones back.
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._decoded(self.key_parts)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign("key_parts", value)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._decoded(self.value_parts)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign("value_parts", value)


class CodedCache(Cache):
    def __init__(self, config: Any, codec: str | Codec) -> None:
        config = config.get_text_config(decoder=True)
        codec = CODECS[codec] if isinstance(codec, str) else codec
        super().__init__(layers=[CodedLayer(codec) for _ in range(config.num_hidden_layers)])
