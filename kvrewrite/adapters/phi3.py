"""Phi-3: one fused qkv_proj ([q; k; v] rows), o_proj, no biases, RoPE (default or longrope) on the full head.

The fused projection is split when the statistics are read and when the weights are folded; the
compressed checkpoint stores separate q_proj/k_proj/v_proj (their ranks differ per head anyway).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Phi3Config, Phi3ForCausalLM

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionFeatures, Projections, Tap
from kvrewrite.errors import UnsupportedModelError


class Phi3Adapter(ArchitectureAdapter):
    model_types = ("phi3",)
    family = "Phi3"
    compressed_model_type = "kvrewrite_phi3"
    config_class = Phi3Config
    model_class = Phi3ForCausalLM

    def check_config(self, config) -> None:
        super().check_config(config)
        partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise UnsupportedModelError(
                f"phi3 with partial_rotary_factor={partial} (RoPE on part of each head) is not supported yet"
            )

    def features(self, config) -> AttentionFeatures:
        return AttentionFeatures(sliding_layers=getattr(config, "sliding_window", None) is not None)

    def _split_sizes(self, attn: nn.Module) -> tuple[int, int, int]:
        config = attn.config
        d = self.geometry(config).head_dim
        kv = self.geometry(config).num_key_value_heads * d
        return config.num_attention_heads * d, kv, kv

    def projections(self, attn: nn.Module) -> Projections:
        if not isinstance(getattr(attn, "qkv_proj", None), nn.Linear):
            raise UnsupportedModelError(f"attention module {type(attn).__name__} has no fused linear qkv_proj")
        q, k, v = torch.split(attn.qkv_proj.weight.detach(), self._split_sizes(attn), dim=0)
        return Projections(q, k, v, attn.o_proj.weight.detach())

    def activation_taps(self, attn: nn.Module) -> list[Tap]:
        sizes = self._split_sizes(attn)

        def split(out: torch.Tensor) -> dict[str, torch.Tensor]:
            q, k, v = torch.split(out, sizes, dim=-1)
            return {"q": q, "k": k, "v": v}

        return [(attn.qkv_proj, split)]
