"""How far each query head looks, as the rotation its dropped RoPE components would have seen (MLA form only).

The MLA form keeps the rotation of one mixed component per rotary frequency (the shared k_pe); the others are
scored position-free (method/mla.py). A component of frequency j at distance delta = n - m really scores
q^T R(-theta_j delta) k. The best fixed stand-in for that rotation, in least squares over the distances a head
attends to, is its expectation under the head's attention: E[R(theta_j delta)] applied to the query, which is the
complex number E[exp(i theta_j delta)] per head and frequency (method/mla.position_free_query_maps folds it into
q_proj: nothing changes at run time).

Measured here on calibration windows with the source model's own (eager) attention: every query's attention
probabilities summed by distance, per layer and head, then the expected rotation of every rotary frequency.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrewrite.errors import InvalidArgumentError

# Calibration windows whose attention is read, and how many of their tokens: every layer's probabilities are held at
# once (layers x heads x length^2 floats: 1 GiB for a Llama-3-8B shape at 512).
RESPONSE_WINDOWS = 8
RESPONSE_LENGTH = 512


def attention_by_distance(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """[layers, heads, window length] float64: attention probability mass at each distance, summed over queries and
    windows, from the model's own eager attention (one window at a time)."""
    positions = torch.arange(windows.shape[1])
    distance = positions[:, None] - positions[None, :]  # [queries, keys]: query n looks delta = n - m back at key m
    causal = distance >= 0
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only implementation that returns the probabilities
    mass = None
    try:
        with torch.no_grad():
            for window in windows.split(1):
                attentions = model(input_ids=window, output_attentions=True, use_cache=False).attentions
                if mass is None:
                    mass = torch.zeros(len(attentions), attentions[0].shape[1], window.shape[1], dtype=torch.float64)
                for layer, probs in enumerate(attentions):  # probs [1, heads, queries, keys]
                    mass[layer].index_add_(1, distance[causal], probs[0][:, causal].double())
    finally:
        model.set_attn_implementation(previous)
    if mass is None:
        raise InvalidArgumentError("no calibration windows to measure attention distances on")
    return mass


def rotary_frequencies(model: nn.Module) -> torch.Tensor:
    """[head_dim / 2] the source's rotary angle per position of each frequency (its rotary embedding's inv_freq)."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            return inv_freq.double().cpu()
    raise InvalidArgumentError("the model has no rotary embedding (inv_freq) to measure the expected rotation of")


def expected_rotation(mass: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """[layers, heads, half] complex128: E[exp(i theta_j delta)] under each head's attention distance distribution."""
    weights = mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)
    angles = torch.arange(mass.shape[-1], dtype=torch.float64)[:, None] * frequencies[None, :]
    return torch.complex(weights @ angles.cos(), weights @ angles.sin())


def measure_rope_response(model: nn.Module, calibration_windows: torch.Tensor,
                          n_windows: int = RESPONSE_WINDOWS) -> torch.Tensor:
    """Every layer's and head's expected rotation, measured on the first RESPONSE_LENGTH tokens of the first n_windows
    calibration windows."""
    windows = calibration_windows[:n_windows, :RESPONSE_LENGTH]
    return expected_rotation(attention_by_distance(model, windows), rotary_frequencies(model))
