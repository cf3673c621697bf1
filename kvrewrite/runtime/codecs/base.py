"""The codec interface: one class per codec owns its parameters, their checks, its coding and its fitting.

A codec class declares `name` and `defaults` (every parameter with its default; an int default makes an integer
parameter) and registers itself with `registry.register_codec`. An instance codes one layer's packed latents, G
tokens at a time: encode takes x [B, n, G, C] (n blocks of G tokens, C = the layer's packed channels, the sum of
its KV heads' ranks) and returns a dict of tensors whose first two dims are [B, n]; decode inverts it. Everything
in that dict is what the cache stores, so the cache's size is read off those tensors.

Fitting (tables trained on calibration latents at compile time, e.g. CSR dictionaries) is a classmethod in plain
torch, so the runtime stays importable without the compile extra.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from itertools import accumulate
from typing import ClassVar

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.readout import QuantizedBlocks

SIDES = ("key", "value")

Latents = list[dict[str, torch.Tensor]]  # per layer: side -> [T, C] float32 calibration latents


class LayerCodec(ABC):
    name: ClassVar[str]
    # Every codec has `group_size` (G: tokens per coded block) and `residual` (recent tokens kept in float16).
    defaults: ClassVar[dict[str, int | float]]
    takes_bits_budget: ClassVar[bool] = False  # fit_tables searches bit widths under a budget (--kv-bits-budget)
    fit_description: ClassVar[str | None] = None  # a progress-bar label when fit_tables trains per layer

    def __init__(self, config: CodecConfig, key_ranks: list[int], value_ranks: list[int]):
        self.config = config
        self.ranks = {"key": list(key_ranks), "value": list(value_ranks)}
        self.channels = {side: sum(r) for side, r in self.ranks.items()}
        self.offsets = {side: [0, *accumulate(r)] for side, r in self.ranks.items()}
        self.block_tokens = config.block_tokens

    # ---- parameters --------------------------------------------------------------------------------------

    @classmethod
    def parse_params(cls, overrides: Mapping[str, object]) -> dict[str, int | float]:
        """The defaults with `overrides` applied, each converted to its parameter's type."""
        params = dict(cls.defaults)
        for key, value in overrides.items():
            if key not in params:
                raise InvalidArgumentError(f"codec {cls.name} has no parameter {key!r}; it has {', '.join(params)}")
            try:
                params[key] = int(value) if isinstance(cls.defaults[key], int) else float(value)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"codec parameter {key} must be a number, got {value!r}") from exc
        return params

    @classmethod
    def validate(cls, params: dict) -> None:
        """Raise InvalidArgumentError naming the parameter that is out of range. Subclasses add their own checks."""
        if params["group_size"] < 1:
            raise InvalidArgumentError(f"codec {cls.name}: group_size must be >= 1, got {params['group_size']}")
        if params["residual"] < 0:
            raise InvalidArgumentError(f"codec {cls.name}: residual must be >= 0, got {params['residual']}")

    # ---- fitting (compile time) ----------------------------------------------------------------------------

    @classmethod
    def fit_tables(
        cls,
        config: CodecConfig,
        latents: Latents,
        key_ranks: list[list[int]],
        value_ranks: list[list[int]],
        *,
        budget_bits: float | None = None,
        weights: dict | None = None,
        progress: Callable[[], None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """Tables for kv_codec.safetensors fitted on calibration latents, and what to add to the compile report.

        weights: (layer, side) -> multiplier on that side's error (the sensitivity pass's KL weights), if any.
        progress: called once per layer by codecs with a `fit_description`. Untrained codecs fit nothing.
        """
        return {}, {}

    # ---- run time ----------------------------------------------------------------------------------------

    @classmethod
    def for_layer(
        cls,
        config: CodecConfig,
        layer_idx: int,
        key_ranks: list[int],
        value_ranks: list[int],
        tables: dict[str, torch.Tensor],
    ) -> "LayerCodec":
        """The codec of one layer; codecs with trained tables read theirs from `tables`."""
        return cls(config, key_ranks, value_ranks)

    @abstractmethod
    def encode(self, x: torch.Tensor, side: str) -> dict[str, torch.Tensor]: ...

    def encode_next(self, x: torch.Tensor, side: str, store: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """encode(x) for blocks that follow `store` (this sequence's blocks coded so far, or None). Codecs whose
        coding depends on the sequence's earlier blocks (CSR's online dictionary) override it."""
        return self.encode(x, side)

    @abstractmethod
    def decode(self, coded: dict[str, torch.Tensor], side: str) -> torch.Tensor:
        """-> float32 [B, n, G, C]."""

    @abstractmethod
    def block_bytes(self, side: str) -> int:
        """Bytes one coded block of G tokens occupies (one batch row): the formula the stored tensors must match."""

    def fused_layout(self) -> QuantizedBlocks | None:
        """The layout of the coded blocks if attention can read them in place (codecs.readout), else None: the
        cache then decodes the whole store for attention on every forward."""
        return None


def as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[T, C] -> [1, n, G, C] (whole blocks only)."""
    n = x.shape[0] // block
    return x[: n * block].reshape(1, n, block, x.shape[1])


def relative_error(codec: LayerCodec, x: torch.Tensor, side: str) -> float:
    """Relative squared error of decode(encode(x)) on calibration latents x [T, C]."""
    blocks = as_blocks(x, codec.block_tokens)
    decoded = codec.decode(codec.encode(blocks, side), side)
    return float((decoded - blocks).pow(2).sum() / blocks.pow(2).sum().clamp_min(1e-30))
