"""Gemma 3 (text): per-head q/k RMSNorm before RoPE, its own score scale, and sliding-window layers with their own RoPE.

- The q/k norms make `post-rope` the only key mode (nothing can be folded into W_Q/W_K through them).
- Scores are scaled by query_pre_attn_scalar^-0.5, not head_dim^-0.5.
- Sliding-window and full-attention layers use different RoPE tables: the rotary module takes the
  layer type, and the statistics rotate each layer with its own table. The stock model builds the
  sliding masks and caches; the compressed attention only sees the mask it is given.
- Attention logit soft-capping (Gemma 2 style) is not reproduced: such configs are refused.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionFeatures
from kvrewrite.errors import UnsupportedModelError


class Gemma3Adapter(ArchitectureAdapter):
    model_types = ("gemma3_text",)
    family = "Gemma3"
    compressed_model_type = "kvrewrite_gemma3"
    config_class = Gemma3TextConfig
    model_class = Gemma3ForCausalLM

    def check_config(self, config) -> None:
        super().check_config(config)
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError("gemma3_text with attn_logit_softcapping is not supported yet")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(
                "gemma3_text with bidirectional attention is not a causal LM kvrewrite can rewrite"
            )

    def features(self, config) -> AttentionFeatures:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionFeatures(
            q_bias=bias,
            k_bias=bias,
            v_bias=bias,
            o_bias=bias,
            qk_norm=True,
            scaling=config.query_pre_attn_scalar**-0.5,
            sliding_layers="sliding_attention" in (config.layer_types or []),
        )

    def rope_tables(
        self, model: nn.Module, probe: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rotary, layer_types = model.model.rotary_emb, model.config.layer_types
        tables = {kind: rotary(probe, positions, kind) for kind in set(layer_types)}
        return [tables[kind] for kind in layer_types]

    def finish_logits(self, config, logits: torch.Tensor) -> torch.Tensor:
        cap = getattr(config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def make_qk_norms(self, config) -> tuple[nn.Module, nn.Module]:
        d = self.geometry(config).head_dim
        return Gemma3RMSNorm(d, eps=config.rms_norm_eps), Gemma3RMSNorm(d, eps=config.rms_norm_eps)

    def activation_taps(self, attn: nn.Module):
        # Gemma3 normalises [B, heads, T, d] (after the transpose): back to [B, T, heads * d].
        return [
            (attn.q_norm, lambda out: {"q": out.transpose(1, 2).flatten(2)}),
            (attn.k_norm, lambda out: {"k": out.transpose(1, 2).flatten(2)}),
            (attn.v_proj, lambda out: {"v": out}),
        ]

    def kept_attention_state(self, attn: nn.Module) -> dict[str, torch.Tensor]:
        return {"q_norm.weight": attn.q_norm.weight.detach(), "k_norm.weight": attn.k_norm.weight.detach()}
