"""Per-layer latent widths for the MLA form, from measured sensitivity (the per-head forms' allocation, reused).

A uniform width spends the same number of cached values on every layer, while layers differ in sensitivity by orders
of magnitude (the per-head forms' allocation keeps 16-78% of a layer at p = 0.5 on SmolLM2). Here:

1. every layer is computed once at its full latent width; a narrower width is a prefix of it
   (method/mla.truncate_latent), so one computation serves every probe and every share;
2. probes: layer l alone truncated to each probe width, every other layer at full width, and the next-token KL to
   the original measured on calibration windows, less the KL of the all-full form (the cost of dropping RoPE from the
   weaker components, which every probe shares);
3. each probe is a point (relative error the latent spectrum predicts at that width, measured KL), and
   curve_allocation's greedy removes latent dims where the measured curves say they cost least. One removal order
   serves every share (each keeps a prefix of it), as the per-head forms' rate table does.

The cached RoPE key keeps its width in every layer: only the latent moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kvrewrite.adapters import adapter_for
from kvrewrite.compile.mla.form import MLAReferenceAttention, mla_reference_model
from kvrewrite.compile.passes.measure_sensitivity import PROBE_TOKENS
from kvrewrite.compile.probes import log_probs
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.method.curve_allocation import curve_removal_order
from kvrewrite.method.mla import MLALayer, truncate_latent
from kvrewrite.method.rank_allocation import RankItem, allocate_greedy
from kvrewrite.spec import rate_key

# Probe widths as shares of the full latent width: the allocations users ask for (30-70% of K+V) keep 15-65% of it.
PROBE_SHARES = (0.1, 0.25, 0.5, 0.75)
# Latent widths move in steps of 8 dims (whole SIMD lanes for the absorbed GEMMs), and no layer keeps fewer.
RANK_MULTIPLE = 8


@dataclass(frozen=True)
class LatentProbe:
    layer: int
    rank: int
    predicted_relative_error: float  # the latent objective's removed share of squared singular values
    kl: float  # measured next-token KL to the original, less the all-full form's


@dataclass(frozen=True)
class LatentSensitivity:
    full_width_kl: float  # the all-full form against the original: what no latent width can remove
    probes: tuple[LatentProbe, ...]
    probe_tokens: int

    def curves(self) -> dict[tuple[int, str], list[tuple[float, float]]]:
        """(layer, "latent") -> [(predicted error, KL)], the shape curve_allocation reads."""
        curves: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for probe in self.probes:
            curves.setdefault((probe.layer, "latent"), []).append((probe.predicted_relative_error, probe.kl))
        return curves


def tail_share(spectrum: torch.Tensor, rank: int) -> float:
    s2 = spectrum.double() ** 2
    return float(s2[rank:].sum() / s2.sum().clamp_min(1e-300))


def probe_ranks(full_rank: int) -> list[int]:
    return sorted(
        {max(RANK_MULTIPLE, RANK_MULTIPLE * round(share * full_rank / RANK_MULTIPLE)) for share in PROBE_SHARES}
    )


@contextlib.contextmanager
def _layer_swapped(model: nn.Module, idx: int, layer: MLALayer) -> Iterator[None]:
    """Inside the block, decoder layer idx of an mla_reference_model computes with `layer`'s weights."""
    adapter = adapter_for(model.config)
    decoder_layer = adapter.decoder_layers(model)[idx]
    kept = getattr(decoder_layer, adapter.attention_attr)
    swapped = MLAReferenceAttention(
        layer, model.config.num_attention_heads, kept.q_proj.dtype, device=kept.q_proj.device
    )
    setattr(decoder_layer, adapter.attention_attr, swapped)
    try:
        yield
    finally:
        setattr(decoder_layer, adapter.attention_attr, kept)


def _mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    probe = log_probs(logits)
    return float((reference.exp() * (reference - probe)).sum(-1).mean())


def measure_latent_sensitivity(
    original: nn.Module, full_layers: list[MLALayer], tokens: torch.Tensor, progress: Callable[[], None] | None = None
) -> LatentSensitivity:
    """Every (layer, probe width): KL to the original with that layer alone truncated. tokens [windows, length]."""
    with torch.no_grad():
        reference = log_probs(original(tokens).logits)
        model = mla_reference_model(original, full_layers)
        base = _mean_kl(reference, model(tokens).logits)
        probes = []
        for idx, layer in enumerate(full_layers):
            for rank in probe_ranks(layer.kv_lora_rank):
                if rank >= layer.kv_lora_rank:
                    continue
                with _layer_swapped(model, idx, truncate_latent(layer, rank)):
                    kl = _mean_kl(reference, model(tokens).logits)
                probes.append(LatentProbe(idx, rank, tail_share(layer.latent_spectrum, rank), kl - base))
            if progress is not None:
                progress()
    return LatentSensitivity(base, tuple(probes), int(tokens.numel()))


@dataclass(frozen=True)
class LatentAllocation:
    ranks: tuple[int, ...]  # latent width per layer
    target_rank: int  # the uniform width of the same share; sum(ranks) <= target_rank * layers
    removal_order: tuple[tuple[int, int], ...]  # (layer, dims) tail chunks, cheapest first: every share is a prefix


def allocate_latent_ranks(
    full_layers: list[MLALayer], sensitivity: LatentSensitivity, target_rank: int
) -> LatentAllocation:
    """Per-layer widths keeping target_rank * layers latent dims in all, placed by the measured KL curves."""
    full = full_layers[0].kv_lora_rank
    if any(layer.kv_lora_rank != full for layer in full_layers):
        raise InvalidArgumentError("the allocation starts from every layer at the same full latent width")
    if not RANK_MULTIPLE <= target_rank <= full:
        raise InvalidArgumentError(f"a latent width of {target_rank} per layer is outside {RANK_MULTIPLE}..{full}")
    items = [
        RankItem(layer=idx, head=0, side="latent", spectrum=layer.latent_spectrum[:full].double().numpy())
        for idx, layer in enumerate(full_layers)
    ]
    order = curve_removal_order(items, sensitivity.curves(), min_rank=RANK_MULTIPLE, rank_multiple=RANK_MULTIPLE)
    allocation = allocate_greedy(
        items, 1.0 - target_rank / full, min_rank=RANK_MULTIPLE, rank_multiple=RANK_MULTIPLE, order=order
    )
    ranks = tuple(allocation.ranks[(idx, 0, "latent")] for idx in range(len(full_layers)))
    return LatentAllocation(ranks, target_rank, tuple((key[0], dims) for key, dims, _ in order))


def latent_width_at_rate(rate: float, values_per_token: int, rope_dim: int) -> int:
    """The mean latent width per layer that leaves a share `rate` of the source's K+V values uncached, beside the
    shared RoPE key: (1 - rate) * values_per_token - rope_dim."""
    return round((1 - rate) * values_per_token) - rope_dim


def check_rate_latents(rates: tuple[float, ...], values_per_token: int, rope_dim: int, option: str) -> None:
    """Before any work: every rate keeps a mean latent the rate table serves (at least RANK_MULTIPLE per layer)."""
    for rate in rates:
        width = latent_width_at_rate(rate, values_per_token, rope_dim)
        if width < RANK_MULTIPLE:
            raise InvalidArgumentError(
                f"{option} {rate:g} leaves a mean latent of {width} per layer; the rate table "
                f"keeps at least {RANK_MULTIPLE}: choose smaller rates"
            )


def latent_rate_table(
    full_layers: list[MLALayer],
    sensitivity: LatentSensitivity,
    values_per_token: int,
    rope_dim: int,
    largest_rank: int,
    rates: tuple[float, ...],
) -> dict[str, list[int]]:
    """Per-layer widths at every rate p of the grid that an export of mean latent width `largest_rank` can serve: the
    same removal order cut at (1 - p) * values_per_token - rope_dim dims per layer, so each rate's widths are a prefix
    of the export's and `kvrewrite.load(dir, rate=p)` serves it from the same file. Keys as the per-head rate tables'."""
    table = {}
    for rate in rates:
        target = latent_width_at_rate(rate, values_per_token, rope_dim)
        if RANK_MULTIPLE <= target <= largest_rank:
            table[rate_key(rate)] = list(allocate_latent_ranks(full_layers, sensitivity, target).ranks)
    return table


def allocation_report(sensitivity: LatentSensitivity, allocation: LatentAllocation) -> dict:
    return {
        "method": "sensitivity",
        "probe_tokens": sensitivity.probe_tokens,
        "full_width_kl": sensitivity.full_width_kl,
        "probes": [
            {"layer": p.layer, "rank": p.rank, "predicted_relative_error": p.predicted_relative_error, "kl": p.kl}
            for p in sensitivity.probes
        ],
        "target_rank": allocation.target_rank,
        "kv_lora_ranks": list(allocation.ranks),
    }


def check_latent_widths(ranks: list[int] | tuple[int, ...], layers: int) -> None:
    if len(ranks) != layers or any(int(r) < 1 for r in ranks):
        raise InvalidArgumentError(f"expected {layers} positive latent widths, got {list(ranks)}")


def sensitivity_tokens(calibration_tokens: torch.Tensor, windows: int) -> torch.Tensor:
    """The probes' text: the per-head forms' (the first calibration windows, PROBE_TOKENS long)."""
    return calibration_tokens[:windows, :PROBE_TOKENS]
