"""KV-cache codecs on top of the reduced latents: KIVI-style int4/int2, TaDA, GEAR / GEAR-L, CSR.

`make_codec_cache(config, key_ranks, value_ranks, tables)` builds the transformers cache a compressed model
uses; `kvrewrite.compile.codec_fitting` trains the tables some codecs need (TaDA bit widths, CSR dictionaries).
"""

from __future__ import annotations

import torch

from kvrewrite.runtime.codecs.base import KiviCodec, LayerCodec
from kvrewrite.runtime.codecs.cache import CodecCache, CodecLayer
from kvrewrite.runtime.codecs.config import CODEC_DEFAULTS, CODEC_NAMES, CodecConfig, make_codec_config, parse_codec
from kvrewrite.runtime.codecs.csr import CsrCodec
from kvrewrite.runtime.codecs.gear import GearCodec
from kvrewrite.runtime.codecs.tada import TadaCodec

CODEC_CLASSES: dict[str, type[LayerCodec]] = {
    "int4": KiviCodec,
    "int2": KiviCodec,
    "tada": TadaCodec,
    "gear": GearCodec,
    "gear-l": GearCodec,
    "csr": CsrCodec,
}
TRAINED_CODECS = ("tada", "csr")  # codecs that carry tables fitted at compile time


def build_layer_codecs(config: CodecConfig, key_ranks: list[list[int]], value_ranks: list[list[int]],
                       tables: dict[str, torch.Tensor] | None = None) -> list[LayerCodec]:
    cls = CODEC_CLASSES[config.name]
    return [cls.for_layer(config, i, k, v, tables or {}) for i, (k, v) in enumerate(zip(key_ranks, value_ranks))]


def make_codec_cache(config: CodecConfig, key_ranks: list[list[int]], value_ranks: list[list[int]],
                     tables: dict[str, torch.Tensor] | None = None) -> CodecCache:
    return CodecCache(build_layer_codecs(config, key_ranks, value_ranks, tables), config.residual)


__all__ = ["CODEC_CLASSES", "CODEC_DEFAULTS", "CODEC_NAMES", "CodecCache", "CodecConfig", "CodecLayer", "LayerCodec",
           "TRAINED_CODECS", "build_layer_codecs", "make_codec_cache", "make_codec_config", "parse_codec"]
