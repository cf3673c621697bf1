"""Qwen3: Llama layout plus a per-head RMSNorm on q and k between the projections and RoPE.

The norm is nonlinear, so no key-side transform can be folded into W_Q/W_K: only `post-rope` (project
the normed, rotated q and k online) is possible. The value side folds as usual.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionFeatures, Tap


class Qwen3Adapter(ArchitectureAdapter):
    model_types = ("qwen3",)
    family = "Qwen3"
    compressed_model_type = "kvrewrite_qwen3"
    config_class = Qwen3Config
    model_class = Qwen3ForCausalLM

    def features(self, config) -> AttentionFeatures:
        bias = bool(getattr(config, "attention_bias", False))
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
        return AttentionFeatures(
            q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias, qk_norm=True, sliding_layers=sliding
        )

    def make_qk_norms(self, config) -> tuple[nn.Module, nn.Module]:
        d = self.geometry(config).head_dim
        return Qwen3RMSNorm(d, eps=config.rms_norm_eps), Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def activation_taps(self, attn: nn.Module) -> list[Tap]:
        # q_norm/k_norm outputs are [B, T, heads, d]: the pre-RoPE q/k the attention really rotates.
        return [
            (attn.q_norm, lambda out: {"q": out.flatten(2)}),
            (attn.k_norm, lambda out: {"k": out.flatten(2)}),
            (attn.v_proj, lambda out: {"v": out}),
        ]

    def kept_attention_state(self, attn: nn.Module) -> dict[str, torch.Tensor]:
        return {"q_norm.weight": attn.q_norm.weight.detach(), "k_norm.weight": attn.k_norm.weight.detach()}
