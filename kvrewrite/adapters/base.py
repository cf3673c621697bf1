"""What an architecture adapter declares: where q/k/v/o, the input norm, RoPE and GQA live."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionGeometry:
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def query_heads_of(self, kv_head: int) -> range:
        """Query heads sharing KV head `kv_head` (HF's repeat_kv puts them contiguously)."""
        return range(kv_head * self.group_size, (kv_head + 1) * self.group_size)


class ArchitectureAdapter:
    """Base class: subclasses name the model types they handle and locate the attention parts."""

    model_types: tuple[str, ...] = ()
    compressed_model_type: str = ""
    has_rope: bool = True

    def check_config(self, config) -> None:
        """Raise UnsupportedModelError if this config uses a variant the adapter cannot rewrite."""

    def geometry(self, config) -> AttentionGeometry:
        raise NotImplementedError

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def attention(self, layer: nn.Module) -> nn.Module:
        raise NotImplementedError

    def rotary_embedding(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The norm between the last decoder layer and the LM head (the layer-streaming runner needs it)."""
        raise NotImplementedError

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [B, heads, T, d] with HF's cos/sin [B, T, d]."""
        raise NotImplementedError
