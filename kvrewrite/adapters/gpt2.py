"""GPT-2: no RoPE (learned positions), one fused Conv1D `c_attn` ([in, 3·hidden]: q | k | v) with biases, Conv1D `c_proj`, MHA.

Conv1D stores weights as [in, out], the transpose of nn.Linear: projections() transposes and splits,
so the compressed checkpoint holds plain q_proj/k_proj/v_proj/o_proj linears. Without RoPE the
key-side maps fold exactly into W_Q/W_K and their biases (ZACK Fig. 8): key mode `folded`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionFeatures, Projections, Tap
from kvrewrite.errors import UnsupportedModelError


class GPT2Adapter(ArchitectureAdapter):
    model_types = ("gpt2",)
    family = "GPT2"
    compressed_model_type = "kvrewrite_gpt2"
    config_class = GPT2Config
    model_class = GPT2LMHeadModel
    attention_attr = "attn"

    def check_config(self, config) -> None:
        super().check_config(config)
        if getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError("gpt2 with cross-attention is not supported")
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            raise UnsupportedModelError("gpt2 with scale_attn_by_inverse_layer_idx is not supported yet")

    def features(self, config) -> AttentionFeatures:
        d = self.geometry(config).head_dim
        scaling = d**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        return AttentionFeatures(q_bias=True, k_bias=True, v_bias=True, o_bias=True, has_rope=False, scaling=scaling)

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.transformer.h)

    def rotary_embedding(self, model: nn.Module) -> None:
        return None

    def final_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model.transformer.ln_f]

    def projections(self, attn: nn.Module) -> Projections:
        if not hasattr(attn, "c_attn"):
            raise UnsupportedModelError(f"attention module {type(attn).__name__} has no fused c_attn")
        hidden = attn.c_proj.weight.shape[1]
        q, k, v = torch.split(attn.c_attn.weight.detach().T, hidden, dim=0)
        b_q, b_k, b_v = torch.split(attn.c_attn.bias.detach(), hidden)
        return Projections(q, k, v, attn.c_proj.weight.detach().T, b_q, b_k, b_v, attn.c_proj.bias.detach())

    def activation_taps(self, attn: nn.Module) -> list[Tap]:
        hidden = attn.c_proj.weight.shape[1]

        def split(out: torch.Tensor) -> dict[str, torch.Tensor]:
            q, k, v = torch.split(out, hidden, dim=-1)
            return {"q": q, "k": k, "v": v}

        return [(attn.c_attn, split)]

    def output_projection(self, attn: nn.Module) -> nn.Module:
        # The original GPT-2 attention has c_proj; the compressed one always has o_proj.
        return attn.c_proj if hasattr(attn, "c_proj") else attn.o_proj
