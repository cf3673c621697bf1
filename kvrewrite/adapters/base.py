"""What an architecture adapter declares: where q/k/v/o, norms, RoPE, biases and GQA live in one model family.

One adapter file per family. The compressed model reuses the family's stock transformers classes with
`CompressedAttention` swapped in (kvrewrite.runtime.modeling.families), so an adapter only describes the
attention block; everything else (embeddings, MLPs, masks, caches) stays the stock code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kvrewrite.errors import UnsupportedModelError


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


@dataclass(frozen=True)
class AttentionFeatures:
    """The parts of a family's attention the compressed attention must reproduce exactly."""

    q_bias: bool = False
    k_bias: bool = False
    v_bias: bool = False
    o_bias: bool = False
    has_rope: bool = True
    # Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma3): nothing can be folded into W_Q/W_K.
    qk_norm: bool = False
    # Score scale; None means head_dim ** -0.5.
    scaling: float | None = None
    # Some layers attend over a sliding window (the stock mask and cache handle it).
    sliding_layers: bool = False


@dataclass
class Projections:
    """One layer's attention weights in nn.Linear layout ([out, in]), q/k/v split even when stored fused."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    v_weight: torch.Tensor
    o_weight: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# An activation tap: a module whose forward output (after the function) gives some of q/k/v pre-RoPE.
Tap = tuple[nn.Module, Callable[[torch.Tensor], dict[str, torch.Tensor]]]


class ArchitectureAdapter:
    """Base class: subclasses name the model types they handle and locate the attention parts.

    The defaults describe the common Llama-like layout (`model.model.layers[i].self_attn` with separate
    q_proj/k_proj/v_proj/o_proj linears, HF rotate_half RoPE, `model.model.rotary_emb`).
    """

    model_types: tuple[str, ...] = ()
    family: str = ""  # class-name stem of the compressed model, e.g. "Qwen2" -> KVRewriteQwen2ForCausalLM
    compressed_model_type: str = ""
    config_class: type | None = None  # the stock transformers config / model classes the compressed model extends
    model_class: type | None = None
    attention_attr: str = "self_attn"

    # ---- validation -----------------------------------------------------------------------
    def check_config(self, config) -> None:
        """Raise UnsupportedModelError if this config uses a variant the adapter cannot rewrite."""
        missing = [
            name for name in ("hidden_size", "num_attention_heads", "num_hidden_layers") if not hasattr(config, name)
        ]
        if missing:
            raise UnsupportedModelError(f"{config.model_type} config lacks {', '.join(missing)}")
        geometry = self.geometry(config)
        if self.features(config).has_rope and geometry.head_dim % 2:
            raise UnsupportedModelError(f"head_dim {geometry.head_dim} must be even for RoPE")

    # ---- where things live ------------------------------------------------------------------
    def geometry(self, config) -> AttentionGeometry:
        heads = config.num_attention_heads
        return AttentionGeometry(
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            hidden_size=config.hidden_size,
        )

    def features(self, config) -> AttentionFeatures:
        return AttentionFeatures()

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)

    def attention(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.attention_attr)

    def rotary_embedding(self, model: nn.Module) -> nn.Module | None:
        return model.model.rotary_emb

    def rope_tables(
        self, model: nn.Module, probe: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per decoder layer, the (cos, sin) the stock model rotates that layer with; None without RoPE."""
        rotary = self.rotary_embedding(model)
        if rotary is None:
            return None
        table = rotary(probe, positions)
        return [table] * self.geometry(model.config).num_layers

    def final_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules between the last decoder layer and the LM head, in order (the layer-streaming runner
        applies them; everything before the first layer it takes from the stock forward)."""
        return [model.model.norm]

    def finish_logits(self, config, logits: torch.Tensor) -> torch.Tensor:
        """What the stock ForCausalLM does to the LM head's output (e.g. soft-capping); nothing by default."""
        return logits

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [B, heads, T, d] with HF's cos/sin [B, T, d] (rotate_half convention)."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return x * cos + rotate_half(x) * sin

    def make_qk_norms(self, config) -> tuple[nn.Module, nn.Module] | None:
        """Fresh per-head q/k norm modules for the compressed attention (loaded from the checkpoint)."""
        return None

    # ---- reading the original model ----------------------------------------------------------
    def projections(self, attn: nn.Module) -> Projections:
        """The layer's q/k/v/o weights and biases (detached, as stored)."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), nn.Linear):
                raise UnsupportedModelError(f"attention module {type(attn).__name__} has no linear {name}")

        def bias(linear: nn.Linear) -> torch.Tensor | None:
            return None if linear.bias is None else linear.bias.detach()

        return Projections(
            attn.q_proj.weight.detach(),
            attn.k_proj.weight.detach(),
            attn.v_proj.weight.detach(),
            attn.o_proj.weight.detach(),
            bias(attn.q_proj),
            bias(attn.k_proj),
            bias(attn.v_proj),
            bias(attn.o_proj),
        )

    def activation_taps(self, attn: nn.Module) -> list[Tap]:
        """Where pre-RoPE q, k (after any q/k norm) and v can be read as [B, T, heads * d] tensors."""
        return [
            (attn.q_proj, lambda out: {"q": out}),
            (attn.k_proj, lambda out: {"k": out}),
            (attn.v_proj, lambda out: {"v": out}),
        ]

    def output_projection(self, attn: nn.Module) -> nn.Module:
        """The module whose input is the attention output of all heads (o_proj's input layout)."""
        return attn.o_proj

    def kept_attention_state(self, attn: nn.Module) -> dict[str, torch.Tensor]:
        """Tensors of the original attention module that the compressed one keeps unchanged (e.g. q/k norms)."""
        return {}
