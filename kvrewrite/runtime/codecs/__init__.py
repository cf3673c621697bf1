"""KV-cache codecs on top of the reduced latents: KIVI-style int4/int2, TaDA, GEAR / GEAR-L, CSR.

A codec is one class (base.LayerCodec: its parameters and their checks, encode/decode, and any compile-time
fitting in plain torch) registered by name with `register_codec`. The built-in ones register on import below;
a new codec is one more module here and one more line in that import.

`make_codec_cache(config, key_ranks, value_ranks, tables)` builds the transformers cache a compressed model
uses; `kvrewrite.compile.codec_fitting` runs the codecs' fitting on calibration latents at compile time.
"""

from __future__ import annotations

import torch

# The built-in codecs register themselves on import, in this order (the order `codec_names()` lists them in).
from kvrewrite.runtime.codecs import kivi  # noqa: F401  int4, int2
from kvrewrite.runtime.codecs import tada  # noqa: F401
from kvrewrite.runtime.codecs import gear  # noqa: F401  gear, gear-l
from kvrewrite.runtime.codecs import csr  # noqa: F401
from kvrewrite.runtime.codecs.base import LayerCodec
from kvrewrite.runtime.codecs.cache import CodecCache, CodecLayer
from kvrewrite.runtime.codecs.config import CodecConfig, make_codec_config, parse_codec
from kvrewrite.runtime.codecs.registry import (
    bits_budget_codecs,
    codec_class,
    codec_names,
    register_codec,
    unregister_codec,
)


def build_layer_codecs(
    config: CodecConfig,
    key_ranks: list[list[int]],
    value_ranks: list[list[int]],
    tables: dict[str, torch.Tensor] | None = None,
) -> list[LayerCodec]:
    cls = config.codec_class
    return [cls.for_layer(config, i, k, v, tables or {}) for i, (k, v) in enumerate(zip(key_ranks, value_ranks))]


def make_codec_cache(
    config: CodecConfig,
    key_ranks: list[list[int]],
    value_ranks: list[list[int]],
    tables: dict[str, torch.Tensor] | None = None,
    read_mode: str | None = None,
) -> CodecCache:
    """read_mode: "fused" (attention reads int4/int2 blocks in place), "decode", or None (KVREWRITE_CODEC_READ)."""
    return CodecCache(build_layer_codecs(config, key_ranks, value_ranks, tables), config.residual, read_mode)


__all__ = [
    "CodecCache",
    "CodecConfig",
    "CodecLayer",
    "LayerCodec",
    "bits_budget_codecs",
    "build_layer_codecs",
    "codec_class",
    "codec_names",
    "make_codec_cache",
    "make_codec_config",
    "parse_codec",
    "register_codec",
    "unregister_codec",
]
