"""Llama family (Llama 2/3, Mistral without sliding window, SmolLM2): q/k/v/o in `self_attn`, RoPE via rotate_half."""

from __future__ import annotations

import torch
from torch import nn

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionGeometry
from kvrewrite.errors import UnsupportedModelError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAdapter(ArchitectureAdapter):
    model_types = ("llama", "mistral")
    compressed_model_type = "kvrewrite_llama"
    has_rope = True

    def check_config(self, config) -> None:
        missing = [name for name in ("hidden_size", "num_attention_heads", "num_hidden_layers") if not hasattr(config, name)]
        if missing:
            raise UnsupportedModelError(f"{config.model_type} config lacks {', '.join(missing)}")
        if getattr(config, "sliding_window", None):
            raise UnsupportedModelError(
                f"{config.model_type} with sliding_window={config.sliding_window} is not supported yet "
                "(the compressed attention has no sliding-window mask)"
            )
        if getattr(config, "attention_bias", False):
            raise UnsupportedModelError("Llama-family models with attention biases are not supported yet")
        geometry = self.geometry(config)
        if geometry.head_dim % 2:
            raise UnsupportedModelError(f"head_dim {geometry.head_dim} must be even for RoPE")

    def geometry(self, config) -> AttentionGeometry:
        heads = config.num_attention_heads
        return AttentionGeometry(
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            hidden_size=config.hidden_size,
        )

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)

    def attention(self, layer: nn.Module) -> nn.Module:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), nn.Linear):
                raise UnsupportedModelError(f"attention module {type(attn).__name__} has no linear {name}")
        return attn

    def rotary_embedding(self, model: nn.Module) -> nn.Module:
        return model.model.rotary_emb

    def final_norm(self, model: nn.Module) -> nn.Module:
        return model.model.norm

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + rotate_half(x) * sin
