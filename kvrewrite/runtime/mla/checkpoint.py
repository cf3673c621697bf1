"""Recognising an exported MLA checkpoint and giving a stock DeepseekV3 model our absorbed attention.

The export (`--export deepseek-v3`) writes a stock DeepSeek-V3 checkpoint; its config.json carries one extra key,
`"kvrewrite_mla": {"format_version": 1, ...}`, which stock transformers keeps as a plain config attribute and
ignores. A separate key, not `"kvrewrite"`: that one holds the per-head forms' CompressionSpec, which other
commands parse.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.runtime.mla.attention import AbsorbedMLAAttention

MLA_MARKER = "kvrewrite_mla"
MLA_FORMAT_VERSION = 1
# Per-layer latent widths (an allocated export): the config's kv_lora_rank is the widest, the others zero-padded.
LATENT_RANKS_KEY = "kv_lora_ranks"


def is_mla_checkpoint(config: dict[str, Any]) -> bool:
    """True for a config.json written by kvrewrite's MLA export (a deepseek_v3 model with the marker)."""
    return config.get("model_type") == "deepseek_v3" and isinstance(config.get(MLA_MARKER), dict)


def check_mla_marker(config: dict[str, Any], where: str) -> None:
    version = config[MLA_MARKER].get("format_version")
    if version != MLA_FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: MLA format_version {version!r}; this kvrewrite reads version {MLA_FORMAT_VERSION}. "
            "Upgrade kvrewrite or re-export"
        )


def latent_ranks(config) -> list[int] | None:
    """The marker's per-layer latent widths, checked against the config; None for a uniform export."""
    marker = getattr(config, MLA_MARKER, None) or {}
    ranks = marker.get(LATENT_RANKS_KEY) if isinstance(marker, dict) else None
    if ranks is None:
        return None
    padded = config.kv_lora_rank
    if (not isinstance(ranks, list) or len(ranks) != config.num_hidden_layers
            or not all(isinstance(r, int) and 1 <= r <= padded for r in ranks)):
        raise CorruptCheckpointError(
            f"{MLA_MARKER}.{LATENT_RANKS_KEY} must list {config.num_hidden_layers} widths within 1..{padded} "
            f"(kv_lora_rank), got {ranks!r}")
    return ranks


def absorb_attention(model: nn.Module) -> nn.Module:
    """Swap every DeepseekV3Attention of `model` (in place) for the absorbed one; weights are shared, not copied,
    except where an allocated export's layer is narrower than the padded width (its latent weights are sliced)."""
    ranks = latent_ranks(model.config)
    swapped = 0
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            continue
        for layer in layers:
            attention = getattr(layer, "self_attn", None)
            if attention is not None and type(attention).__name__ == "DeepseekV3Attention":
                layer.self_attn = AbsorbedMLAAttention(attention, None if ranks is None else ranks[attention.layer_idx])
                swapped += 1
    if not swapped:
        raise CorruptCheckpointError(f"{type(model).__name__} has no DeepseekV3Attention layers to absorb")
    return model
