"""Llama family (Llama 2/3, Mistral without sliding window, SmolLM2): q/k/v/o in `self_attn`, RoPE via rotate_half."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionFeatures
from kvrewrite.errors import UnsupportedModelError


class LlamaAdapter(ArchitectureAdapter):
    model_types = ("llama", "mistral")
    family = "Llama"
    compressed_model_type = "kvrewrite_llama"
    config_class = LlamaConfig
    model_class = LlamaForCausalLM

    def check_config(self, config) -> None:
        super().check_config(config)
        if getattr(config, "sliding_window", None):
            raise UnsupportedModelError(
                f"{config.model_type} with sliding_window={config.sliding_window} is not supported yet "
                "(the compressed checkpoint is a Llama, which has no sliding-window layers)"
            )

    def features(self, config) -> AttentionFeatures:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionFeatures(q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias)
