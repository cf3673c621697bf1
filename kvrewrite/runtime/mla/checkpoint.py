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
from kvrewrite.spec import rate_key

MLA_MARKER = "kvrewrite_mla"
MLA_FORMAT_VERSION = 1
# Per-layer latent widths (an allocated export): the config's kv_lora_rank is the widest, the others zero-padded.
LATENT_RANKS_KEY = "kv_lora_ranks"
# Narrower per-layer widths the same file serves (rate key -> widths, each a prefix of the exported ones).
RATE_TABLE_KEY = "rate_table"


def is_mla_checkpoint(config: dict[str, Any]) -> bool:
    """True for a config.json written by kvrewrite's MLA export (a deepseek_v3 model with the marker)."""
    return config.get("model_type") == "deepseek_v3" and isinstance(config.get(MLA_MARKER), dict)


def missing_spec_message(config_path: Any, config: dict[str, Any], command: str) -> str:
    """Why `command` (card, push, inspect) cannot read a config without a per-head spec: an MLA export is named as
    such, with what to use instead, rather than reported as a config with no spec."""
    if is_mla_checkpoint(config):
        return (
            f"{config_path} is an MLA export (export-mla, a stock DeepSeek-V3 checkpoint); `kvrewrite {command}` "
            "reads per-head checkpoints (kvrewrite compress) only. Its widths and rate table are in config.json's "
            f"`{MLA_MARKER}` marker; `kvrewrite eval` and `kvrewrite.load` run it (docs/serving.md)."
        )
    return f"{config_path} has no kvrewrite compression spec (model_type {config.get('model_type')!r})"


def check_mla_marker(config: dict[str, Any], where: str) -> None:
    version = config[MLA_MARKER].get("format_version")
    if version != MLA_FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: MLA format_version {version!r}; this kvrewrite reads version {MLA_FORMAT_VERSION}. "
            "Upgrade kvrewrite or re-export"
        )


def _checked_widths(ranks, config, where: str, within: list[int] | None = None) -> list[int]:
    limits = within or [config.kv_lora_rank] * config.num_hidden_layers
    if (
        not isinstance(ranks, list)
        or len(ranks) != config.num_hidden_layers
        or not all(isinstance(r, int) and 1 <= r <= limit for r, limit in zip(ranks, limits))
    ):
        raise CorruptCheckpointError(
            f"{MLA_MARKER}.{where} must list {config.num_hidden_layers} widths within 1..{config.kv_lora_rank} "
            f"(kv_lora_rank){' and within the exported widths' if within else ''}, got {ranks!r}"
        )
    return ranks


def latent_ranks(config) -> list[int] | None:
    """The marker's per-layer latent widths, checked against the config; None for a uniform export."""
    marker = getattr(config, MLA_MARKER, None) or {}
    ranks = marker.get(LATENT_RANKS_KEY) if isinstance(marker, dict) else None
    return None if ranks is None else _checked_widths(ranks, config, LATENT_RANKS_KEY)


def rate_table(config) -> dict[str, list[int]]:
    """Rate key -> per-layer widths this file also serves (empty without a table)."""
    marker = getattr(config, MLA_MARKER, None) or {}
    table = marker.get(RATE_TABLE_KEY) if isinstance(marker, dict) else None
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise CorruptCheckpointError(f"{MLA_MARKER}.{RATE_TABLE_KEY} must map rates to widths, got {table!r}")
    exported = latent_ranks(config) or [config.kv_lora_rank] * config.num_hidden_layers
    return {key: _checked_widths(widths, config, f"{RATE_TABLE_KEY}.{key}", exported) for key, widths in table.items()}


def widths_at_rate(config, rate: float, where: str) -> list[int]:
    """The per-layer widths the rate table gives `rate`; a clear error naming the rates it has."""
    table = rate_table(config)
    if rate_key(rate) not in table:
        have = ", ".join(table) if table else "none"
        raise CorruptCheckpointError(
            f"{where} is an MLA export with no rate {rate_key(rate)} in its rate table (rates: {have}); "
            "load it without rate, or export with --layer-widths sensitivity at a larger --kv-share, or with --refit-rates"
        )
    return table[rate_key(rate)]


def absorb_attention(model: nn.Module, widths: list[int] | None = None) -> nn.Module:
    """Swap every DeepseekV3Attention of `model` (in place) for the absorbed one; weights are shared, not copied,
    except where a layer runs narrower than the padded width (its latent weights are sliced).

    widths: per-layer latent widths to run at (a rate of the table, widths_at_rate); default: the exported ones."""
    exported = latent_ranks(model.config)
    ranks = widths if widths is not None else exported
    swapped = 0
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            continue
        for layer in layers:
            attention = getattr(layer, "self_attn", None)
            if attention is not None and type(attention).__name__ == "DeepseekV3Attention":
                idx = attention.layer_idx
                layer.self_attn = AbsorbedMLAAttention(
                    attention, None if ranks is None else ranks[idx], None if exported is None else exported[idx]
                )
                swapped += 1
    if not swapped:
        raise CorruptCheckpointError(f"{type(model).__name__} has no DeepseekV3Attention layers to absorb")
    return model
