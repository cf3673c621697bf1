"""How far each query head looks, as the rotation its dropped RoPE components would have seen (MLA form only).

The MLA form keeps the rotation of one mixed component per rotary frequency (the shared k_pe); the others are
scored position-free (method/mla.py). A component of frequency j at distance delta = n - m really scores
q^T R(-theta_j delta) k. The best fixed stand-in for that rotation, in least squares over the distances a head
attends to, is its expectation under the head's attention: E[R(theta_j delta)] applied to the query, which is the
complex number E[exp(i theta_j delta)] per head and frequency (method/mla.position_free_query_maps folds it into
q_proj: nothing changes at run time).

Measured here on calibration windows with the source model's own (eager) attention: every query's attention
probabilities summed by distance, per layer and head, then the expected rotation of every rotary frequency. The mass
on each window's first token, the attention sink, is left out by default: every query reads it at its own distance,
so its mass lands at every distance up to the window's length, whatever the head reads by content; with it left
out the form is better at 512 tokens and at long context, on wiki and news (docs/serving.md).
"""

from __future__ import annotations

import torch
from torch import nn

from kvrewrite.adapters import adapter_for
from kvrewrite.errors import InvalidArgumentError

# Calibration tokens whose attention is read: as many calibration windows (at their own length, --seq-len) as hold
# this many tokens, at least one. Each layer's probabilities are summed by distance as soon as that layer has run, so
# only one layer's [heads, length, length] is held at a time.
RESPONSE_TOKENS = 4096


def attention_by_distance(model: nn.Module, windows: torch.Tensor, skip_first_key: bool = False) -> torch.Tensor:
    """[layers, heads, window length] float64: attention probability mass at each distance, summed over queries and
    windows, from the model's own eager attention (one window at a time). skip_first_key leaves out the mass on each
    window's first token (the attention sink, which every query reads at its own distance)."""
    if windows.shape[0] == 0:
        raise InvalidArgumentError("no calibration windows to measure attention distances on")
    adapter = adapter_for(model.config)
    attentions = [adapter.attention(layer) for layer in adapter.decoder_layers(model)]
    device = next(model.parameters()).device  # the sums stay where the probabilities are, until the end
    positions = torch.arange(windows.shape[1], device=device)
    distance = positions[:, None] - positions[None, :]  # [queries, keys]: query n looks delta = n - m back at key m
    counted = (distance >= 0) & (positions[None, :] > 0) if skip_first_key else distance >= 0
    # The counted (query, key) pairs as flat indices, found once: a boolean mask would wait for the device per layer.
    pairs = counted.flatten().nonzero().squeeze(1)
    counted_distance = distance.flatten()[pairs]
    heads = adapter.geometry(model.config).num_attention_heads
    mass = torch.zeros(len(attentions), heads, windows.shape[1], dtype=torch.float64, device=device)

    def accumulate(index: int):
        def hook(module: nn.Module, args, output) -> None:
            probs = output[1]  # eager attention returns (output, probabilities [1, heads, queries, keys])
            if probs is None:
                raise InvalidArgumentError(f"attention layer {index} returned no probabilities under eager attention")
            mass[index].index_add_(1, counted_distance, probs[0].flatten(1).index_select(1, pairs).double())

        return hook

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only implementation that returns the probabilities
    handles = [attention.register_forward_hook(accumulate(i)) for i, attention in enumerate(attentions)]
    try:
        with torch.no_grad():
            for window in windows.to(device).split(1):
                model(input_ids=window, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
    return mass.cpu()


def rotary_frequencies(model: nn.Module) -> torch.Tensor:
    """[head_dim / 2] the source's rotary angle per position of each frequency (its rotary embedding's inv_freq)."""
    rotary = adapter_for(model.config).rotary_embedding(model)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise InvalidArgumentError("the model has no rotary embedding (inv_freq) to measure the expected rotation of")
    return inv_freq.double().cpu()


def expected_rotation(mass: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """[layers, heads, half] complex128: E[exp(i theta_j delta)] under each head's attention distance distribution."""
    weights = mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)
    angles = torch.arange(mass.shape[-1], dtype=torch.float64)[:, None] * frequencies[None, :]
    return torch.complex(weights @ angles.cos(), weights @ angles.sin())


def measure_rope_response(
    model: nn.Module, calibration_windows: torch.Tensor, n_tokens: int = RESPONSE_TOKENS, skip_first_key: bool = True
) -> torch.Tensor:
    """Every layer's and head's expected rotation, measured on the first calibration windows (whole, at their own
    length) that hold n_tokens tokens, at least one window; skip_first_key leaves the attention sink out."""
    n_windows = max(1, n_tokens // calibration_windows.shape[1])
    mass = attention_by_distance(model, calibration_windows[:n_windows], skip_first_key=skip_first_key)
    return expected_rotation(mass, rotary_frequencies(model))
