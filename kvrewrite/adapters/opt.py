"""OPT: no RoPE (learned absolute positions), separate q/k/v/out projections, all with biases, MHA.

Without RoPE the key-side transform folds exactly into W_Q/W_K and their biases (ZACK Fig. 8): key
mode `folded`, zero runtime cost on either side. OPT scales q by head_dim^-0.5 before the scores;
the compressed attention applies the same factor to the scores instead.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import OPTConfig, OPTForCausalLM

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionFeatures, AttentionGeometry, Projections
from kvrewrite.errors import UnsupportedModelError


class OPTAdapter(ArchitectureAdapter):
    model_types = ("opt",)
    family = "OPT"
    compressed_model_type = "kvrewrite_opt"
    config_class = OPTConfig
    model_class = OPTForCausalLM

    def check_config(self, config) -> None:
        super().check_config(config)
        if config.hidden_size % config.num_attention_heads:
            raise UnsupportedModelError("OPT hidden_size must be a multiple of num_attention_heads")

    def geometry(self, config) -> AttentionGeometry:
        heads = config.num_attention_heads
        return AttentionGeometry(
            config.num_hidden_layers, heads, heads, config.hidden_size // heads, config.hidden_size
        )

    def features(self, config) -> AttentionFeatures:
        bias = bool(getattr(config, "enable_bias", True))
        return AttentionFeatures(q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias, has_rope=False)

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.decoder.layers)

    def rotary_embedding(self, model: nn.Module) -> None:
        return None

    def final_modules(self, model: nn.Module) -> list[nn.Module]:
        decoder = model.model.decoder
        return [m for m in (decoder.final_layer_norm, decoder.project_out) if m is not None]

    def projections(self, attn: nn.Module) -> Projections:
        if not hasattr(attn, "out_proj"):
            return super().projections(attn)

        def bias(linear: nn.Linear) -> torch.Tensor | None:
            return None if linear.bias is None else linear.bias.detach()

        return Projections(
            attn.q_proj.weight.detach(),
            attn.k_proj.weight.detach(),
            attn.v_proj.weight.detach(),
            attn.out_proj.weight.detach(),
            bias(attn.q_proj),
            bias(attn.k_proj),
            bias(attn.v_proj),
            bias(attn.out_proj),
        )

    def output_projection(self, attn: nn.Module) -> nn.Module:
        # The original OPT attention has out_proj; the compressed one always has o_proj.
        return attn.out_proj if hasattr(attn, "out_proj") else attn.o_proj
