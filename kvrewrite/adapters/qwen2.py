"""Qwen2 / Qwen2.5: Llama layout plus biases on q/k/v (none on o); optional sliding-window layers.

Biases fold with their weights: a bias row is transformed exactly like the weight row it belongs to
(value bias -> down^T b_v, latent key bias -> down^T b_k, freq mode permutes it). The value bias could
also move into o_proj's bias (softmax rows sum to 1); keeping it in v_proj is just as exact.
"""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2ForCausalLM

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionFeatures


class Qwen2Adapter(ArchitectureAdapter):
    model_types = ("qwen2",)
    family = "Qwen2"
    compressed_model_type = "kvrewrite_qwen2"
    config_class = Qwen2Config
    model_class = Qwen2ForCausalLM

    def features(self, config) -> AttentionFeatures:
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
        return AttentionFeatures(q_bias=True, k_bias=True, v_bias=True, o_bias=False, sliding_layers=sliding)
