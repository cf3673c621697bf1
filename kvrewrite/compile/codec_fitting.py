"""Compile-time fitting of the codecs that need calibration data: TaDA bit widths, CSR dictionaries.

Both run on the latents the compiled model itself caches for calibration text (after the ranks are fixed),
so they see exactly what the codec will code at run time: pre-RoPE latents in latent key mode.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvrewrite.runtime.codecs.base import SIDES
from kvrewrite.runtime.codecs.config import CodecConfig
from kvrewrite.runtime.codecs.csr import dictionary_name, matching_pursuit
from kvrewrite.runtime.codecs.tada import BITS_TABLE, TadaCodec
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.kernels.cache_layout import packed_view

TADA_WIDTHS = (2, 4, 8)

Latents = list[dict[str, torch.Tensor]]  # per layer: side -> [T, C] float32


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


def collect_latents_streamed(streamed, layer_ranks: list[tuple[list[int], list[int]]], tokens: torch.Tensor,
                             batch_size: int = 4, progress: bool = False) -> Latents:
    """collect_latents for a layer-streamed rewrite (a StreamedModel at full rank): each layer is sliced to
    its (key ranks, value ranks) and run on every batch while it holds its weights, so only one layer's
    weights are resident however big the model is."""
    from kvrewrite.progress import progress_bar

    latents: Latents = []
    with torch.inference_mode(), progress_bar("collecting codec latents", len(layer_ranks), enabled=progress) as bar:
        batches = list(torch.split(tokens, batch_size))
        hidden = streamed.embed_batches(batches)
        inputs = [streamed.layer_inputs(h) for h in hidden]
        for idx, (key_ranks, value_ranks) in enumerate(layer_ranks):
            recorder = _LatentRecorder()
            with streamed.layer(idx) as layer:
                streamed.adapter.attention(layer).set_ranks(key_ranks, value_ranks)
                for b in range(len(hidden)):
                    hidden[b] = streamed.run_layer(layer, hidden[b], inputs[b], past_key_values=recorder, use_cache=True)
            latents.append({"key": torch.cat(recorder.keys), "value": torch.cat(recorder.values)})
            bar.advance()
    return latents


def as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[T, C] -> [1, n, G, C] (whole blocks only)."""
    n = x.shape[0] // block
    return x[: n * block].reshape(1, n, block, x.shape[1])


def relative_error(codec, x: torch.Tensor, side: str) -> float:
    blocks = as_blocks(x, codec.block_tokens)
    decoded = codec.decode(codec.encode(blocks, side), side)
    return float((decoded - blocks).pow(2).sum() / blocks.pow(2).sum().clamp_min(1e-30))


# ---- TaDA: per-layer, per-side deviation bit widths under a byte budget ---------------------------------


def search_tada_bits(config: CodecConfig, latents: Latents, key_ranks, value_ranks, budget_bits: float,
                     weights=None) -> tuple[torch.Tensor, dict]:
    """Greedy marginal search: start every (layer, side) at 2 bits and repeatedly raise the one with the largest
    drop in weighted calibration error per added byte (2 -> 4 -> 8) while the whole cache stays within
    `budget_bits` stored bits per latent element (codes, means, scales and zero points all counted).

    weights: (layer, side) -> multiplier on that side's relative error (the sensitivity pass's KL weights).
    The paper runs a random search on task accuracy; this is its cheaper deterministic counterpart.
    """
    n_layers = len(latents)
    block = config.block_tokens
    elements = sum(sum(k) + sum(v) for k, v in zip(key_ranks, value_ranks)) * block
    errors, costs = {}, {}
    for i in range(n_layers):
        for bits in TADA_WIDTHS:
            codec = TadaCodec(config, key_ranks[i], value_ranks[i], (bits, bits))
            for side in SIDES:
                if codec.channels[side] == 0:
                    errors[(i, side, bits)], costs[(i, side, bits)] = 0.0, 0
                    continue
                weight = weights[(i, side)] if weights else 1.0
                errors[(i, side, bits)] = weight * relative_error(codec, latents[i][side], side)
                costs[(i, side, bits)] = codec.block_bytes(side)
    choice = {(i, side): TADA_WIDTHS[0] for i in range(n_layers) for side in SIDES}

    def total_bits() -> float:
        return 8 * sum(costs[(i, side, b)] for (i, side), b in choice.items()) / elements

    if total_bits() > budget_bits + 1e-9:
        raise InvalidArgumentError(
            f"`kv_bits_budget={budget_bits}` is below what tada needs at 2 bits everywhere ({total_bits():.2f} bits per "
            "cached element, metadata included)"
        )
    while True:
        best, best_gain = None, 0.0
        for key, bits in choice.items():
            if bits == TADA_WIDTHS[-1]:
                continue
            nxt = TADA_WIDTHS[TADA_WIDTHS.index(bits) + 1]
            extra = costs[(*key, nxt)] - costs[(*key, bits)]
            trial = total_bits() + 8 * extra / elements
            if trial > budget_bits + 1e-9:
                continue
            gain = (errors[(*key, bits)] - errors[(*key, nxt)]) / max(extra, 1)
            if gain > best_gain:
                best, best_gain = key, gain
        if best is None:
            break
        choice[best] = TADA_WIDTHS[TADA_WIDTHS.index(choice[best]) + 1]
    table = torch.tensor([[choice[(i, "key")], choice[(i, "value")]] for i in range(n_layers)], dtype=torch.int32)
    return table, {"bits_per_element": round(total_bits(), 4), "budget_bits": budget_bits}


# ---- CSR: dictionaries by k-means initialisation and least-squares refits ----------------------------------


def kmeans(x: torch.Tensor, k: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """Plain Lloyd iterations; empty clusters are re-seeded with random points."""
    pick = torch.randint(0, x.shape[0], (k,), generator=generator)
    centers = x[pick].clone()
    for _ in range(iterations):
        dist = x.pow(2).sum(1, keepdim=True) - 2 * x @ centers.T + centers.pow(2).sum(1)
        assign = dist.argmin(1)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).float()
        empty = counts == 0
        centers = sums / counts.clamp_min(1).unsqueeze(1)
        if empty.any():
            centers[empty] = x[torch.randint(0, x.shape[0], (int(empty.sum()),), generator=generator)]
    return centers


def normalise_rows(atoms: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    norms = atoms.norm(dim=1, keepdim=True)
    good = norms.squeeze(1) > 1e-8
    out = fallback.clone()
    out[good] = atoms[good] / norms[good]
    return out


def fit_dictionary(x: torch.Tensor, atoms: int, sparsity: int, kmeans_iterations: int, fit_iterations: int,
                   seed: int = 0) -> torch.Tensor:
    """A unit-norm dictionary [atoms, r] for the rows of x [T, r]: k-means centroids, then alternating matching
    pursuit codes and a least-squares refit of the atoms (the fixed point of a gradient loop on ||X - C D||^2)."""
    generator = torch.Generator().manual_seed(seed)
    x = x.float()
    if x.shape[0] < atoms:  # too few calibration vectors: repeat them (k-means re-seeds duplicates anyway)
        x = x.repeat(-(-atoms // x.shape[0]), 1)
    rand = torch.randn(atoms, x.shape[1], generator=generator)
    dictionary = normalise_rows(kmeans(x, atoms, kmeans_iterations, generator), rand / rand.norm(dim=1, keepdim=True))
    ridge = 1e-6 * x.pow(2).mean()
    for _ in range(fit_iterations):
        idx, coef = matching_pursuit(x, dictionary, sparsity)
        codes = torch.zeros(x.shape[0], atoms).scatter_add_(1, idx, coef.float())
        gram = codes.T @ codes + ridge * torch.eye(atoms)
        refit = torch.linalg.solve(gram, codes.T @ x)
        dictionary = normalise_rows(refit, dictionary)  # unused atoms keep their previous direction
    return dictionary


def fit_csr_dictionaries(config: CodecConfig, latents: Latents, key_ranks, value_ranks, progress=None) -> dict[str, torch.Tensor]:
    p = config.params
    tables = {}
    for i, layer in enumerate(latents):
        for side, ranks in (("key", key_ranks[i]), ("value", value_ranks[i])):
            start = 0
            for h, r in enumerate(ranks):
                if r > 0:
                    x = layer[side][:, start : start + r]
                    tables[dictionary_name(i, side, h)] = fit_dictionary(
                        x, int(p["atoms"]), int(p["sparsity"]), int(p["kmeans_iterations"]), int(p["fit_iterations"]), seed=i)
                start += r
        if progress is not None:
            progress()
    return tables


def codec_calibration_errors(codecs, latents: Latents) -> dict[str, list[float]]:
    """Relative squared error of decode(encode(x)) per layer and side on the calibration latents."""
    return {side: [round(relative_error(c, layer[side], side), 6) if c.channels[side] else 0.0
                   for c, layer in zip(codecs, latents)] for side in SIDES}


def fit_codec_tables(codec: CodecConfig, model, tokens: torch.Tensor, *, budget_bits: float | None = None,
                     sensitivity: dict | None = None, batch_size: int = 4, progress: bool = False) -> tuple[dict, dict]:
    """Fit what `codec` needs on the latents `model` (a compressed model at its final ranks) caches for `tokens`.

    Returns (tables, report): tables for kv_codec.safetensors (empty for untrained codecs), and the calibration
    error / bytes summary that goes into compress_report.json.
    """
    key_ranks, value_ranks = model._layer_ranks()
    latents = collect_latents(model, tokens, batch_size)
    return fit_codec_tables_on_latents(codec, latents, key_ranks, value_ranks, budget_bits=budget_bits,
                                       sensitivity=sensitivity, progress=progress)


def fit_codec_tables_on_latents(codec: CodecConfig, latents: Latents, key_ranks, value_ranks, *,
                                budget_bits: float | None = None, sensitivity: dict | None = None,
                                progress: bool = False) -> tuple[dict, dict]:
    """fit_codec_tables on latents already collected (the compile pass collects them layer-streamed)."""
    from kvrewrite.runtime.codecs import build_layer_codecs
    from kvrewrite.progress import progress_bar

    tables: dict[str, torch.Tensor] = {}
    report: dict = {"codec": codec.describe(), "fit_tokens": int(latents[0]["key"].shape[0])}
    if codec.name == "tada" and budget_bits is not None:
        table, info = search_tada_bits(codec, latents, key_ranks, value_ranks, budget_bits, sensitivity)
        tables[BITS_TABLE] = table
        report.update(info, bits=table.tolist())
    if codec.name == "csr":
        with progress_bar("fitting CSR dictionaries", len(latents), enabled=progress) as bar:
            tables.update(fit_csr_dictionaries(codec, latents, key_ranks, value_ranks, bar.advance))
    codecs = build_layer_codecs(codec, key_ranks, value_ranks, tables)
    report["calibration_relative_sq_error"] = codec_calibration_errors(codecs, latents)
    # Per token, excluding the float16 residual window (a fixed number of tokens per sequence).
    report["coded_bytes_per_token"] = sum(c.block_bytes(side) for c in codecs for side in SIDES) / codec.block_tokens
    return tables, report
