"""Compile-time fitting of the codecs that need calibration data (TaDA bit widths, CSR dictionaries, ...).

This module collects the latents the compiled model itself caches for calibration text (after the ranks are
fixed), so the codec sees exactly what it will code at run time: pre-RoPE latents in latent key mode. The
fitting maths is each codec class's own `fit_tables` (kvrewrite.runtime.codecs).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from kvrewrite.runtime.codecs.base import SIDES, Latents, relative_error
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.kernels.cache_layout import packed_view


def collect_latents(model, tokens: torch.Tensor, batch_size: int = 4) -> Latents:
    """Every layer's cached key/value latents for the calibration windows, flattened to [tokens, channels]."""
    per_layer: list[dict[str, list[torch.Tensor]]] = []
    with torch.inference_mode():
        for start in range(0, tokens.shape[0], batch_size):
            cache = DynamicCache(config=model.config)
            model(input_ids=tokens[start : start + batch_size], past_key_values=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                if len(per_layer) <= i:
                    per_layer.append({"key": [], "value": []})
                keys, values = packed_view(layer.keys), packed_view(layer.values)  # either memory order
                per_layer[i]["key"].append(keys[:, 0].reshape(-1, keys.shape[-1]).float())
                per_layer[i]["value"].append(values[:, 0].reshape(-1, values.shape[-1]).float())
    return [{side: torch.cat(parts[side]) for side in SIDES} for parts in per_layer]


class _LatentRecorder:
    """Stands in for the cache of one layer-streamed forward: keeps what the attention would cache."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # every window is a fresh prefill

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        # flatten, not reshape(-1, C): a layer whose ranks are all 0 caches [B, 1, T, 0], which -1 cannot infer.
        self.keys.append(keys[:, 0].flatten(0, 1).float())
        self.values.append(values[:, 0].flatten(0, 1).float())
        return keys, values


def collect_latents_streamed(
    streamed,
    layer_ranks: list[tuple[list[int], list[int]]],
    tokens: torch.Tensor,
    batch_size: int = 4,
    progress: bool = False,
) -> Latents:
    """collect_latents for a layer-streamed rewrite (a StreamedModel at full rank): each layer is sliced to
    its (key ranks, value ranks) and run on every batch while it holds its weights, so only one layer's
    weights are resident however big the model is."""
    from kvrewrite.progress import progress_bar

    latents: Latents = []

    @contextlib.contextmanager
    def sliced_and_recorded(idx: int, layer):
        streamed.adapter.attention(layer).set_ranks(*layer_ranks[idx])
        recorder = _LatentRecorder()
        yield {"past_key_values": recorder, "use_cache": True}
        latents.append({"key": torch.cat(recorder.keys), "value": torch.cat(recorder.values)})

    with torch.inference_mode(), progress_bar("collecting codec latents", len(layer_ranks), enabled=progress) as bar:
        streamed.forward(list(torch.split(tokens, batch_size)), on_layer=sliced_and_recorded, progress=bar.advance)
    return latents


def codec_calibration_errors(codecs, latents: Latents) -> dict[str, list[float]]:
    """Relative squared error of decode(encode(x)) per layer and side on the calibration latents."""
    return {
        side: [
            round(relative_error(c, layer[side], side), 6) if c.channels[side] else 0.0
            for c, layer in zip(codecs, latents)
        ]
        for side in SIDES
    }


def fit_codec_tables(
    codec: CodecConfig,
    model,
    tokens: torch.Tensor,
    *,
    budget_bits: float | None = None,
    sensitivity: dict | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> tuple[dict, dict]:
    """Fit what `codec` needs on the latents `model` (a compressed model at its final ranks) caches for `tokens`.

    Returns (tables, report): tables for kv_codec.safetensors (empty for untrained codecs), and the calibration
    error / bytes summary that goes into compress_report.json.
    """
    key_ranks, value_ranks = model._layer_ranks()
    latents = collect_latents(model, tokens, batch_size)
    return fit_codec_tables_on_latents(
        codec, latents, key_ranks, value_ranks, budget_bits=budget_bits, sensitivity=sensitivity, progress=progress
    )


def fit_codec_tables_on_latents(
    codec: CodecConfig,
    latents: Latents,
    key_ranks,
    value_ranks,
    *,
    budget_bits: float | None = None,
    sensitivity: dict | None = None,
    progress: bool = False,
) -> tuple[dict, dict]:
    """fit_codec_tables on latents already collected (the compile pass collects them layer-streamed)."""
    from kvrewrite.progress import progress_bar
    from kvrewrite.runtime.codecs import build_layer_codecs

    report: dict = {"codec": codec.describe(), "fit_tokens": int(latents[0]["key"].shape[0])}
    cls = codec.codec_class
    label = cls.fit_description
    with progress_bar(label or "", len(latents), enabled=progress and label is not None) as bar:
        tables, fitted = cls.fit_tables(
            codec, latents, key_ranks, value_ranks, budget_bits=budget_bits, weights=sensitivity, progress=bar.advance
        )
    report.update(fitted)
    codecs = build_layer_codecs(codec, key_ranks, value_ranks, tables)
    report["calibration_relative_sq_error"] = codec_calibration_errors(codecs, latents)
    # Per token, excluding the float16 residual window (a fixed number of tokens per sequence).
    report["coded_bytes_per_token"] = sum(c.block_bytes(side) for c in codecs for side in SIDES) / codec.block_tokens
    return tables, report
