"""The MLA form of a model, computed from our calibration statistics (kvrewrite/method/mla.py has the maths).

Steps: check the family fits before any work; run the shared statistics passes (load, calibration, Grams), with one
extra per-layer statistic read in the same streaming pass: the Gram of the attention input x (and its largest
per-token squared norm), which gives the joint second moments of every KV head's keys and values that one shared
latent needs; then compute every layer's MLA weights at a uniform width.

`mla_reference_model` swaps a stock model's attention for the MLA form computed in our own code (causal, no padding):
the maths' logits, which the verify step and the tests compare with the original and with the exported checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvrewrite.adapters import adapter_for
from kvrewrite.compile.passes.base import run_pass
from kvrewrite.errors import InvalidArgumentError, UnsupportedModelError
from kvrewrite.method.mla import DEFAULT_KEY_WEIGHT, MLALayer, full_latent_rank, mla_layer
from kvrewrite.progress import progress_bar

# Families whose layers map one to one onto DeepseekV3's dense layers (RMSNorm, gated SiLU MLP, q/k/v/o linears).
EXPORTABLE_MODEL_TYPES = ("llama", "mistral")


def check_exportable(config) -> None:
    """Raise UnsupportedModelError naming every part of this model that the DeepSeek-V3 MLA form cannot express."""
    model_type = getattr(config, "model_type", None)
    problems = []
    try:
        adapter = adapter_for(config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"cannot export {model_type!r} as DeepSeek-V3 MLA: {exc}") from None
    features = adapter.features(config)
    if not features.has_rope:
        problems.append("it has no RoPE (MLA's shared k_pe needs rotary keys)")
    if features.qk_norm:
        problems.append("it normalises q/k per head (DeepSeek-V3 attention has no q/k norm)")
    biases = [name for name in ("q", "k", "v", "o") if getattr(features, f"{name}_bias")]
    if biases:
        problems.append(
            f"its {'/'.join(biases)} projections have biases (DeepSeek-V3's attention has none in this form)"
        )
    if getattr(config, "mlp_bias", False):
        problems.append("its MLP has biases (DeepSeek-V3's dense MLP has none)")
    if features.sliding_layers or getattr(config, "sliding_window", None):
        problems.append("it has sliding-window layers (DeepSeek-V3 attends to the whole context)")
    if not problems and model_type not in EXPORTABLE_MODEL_TYPES:
        problems.append(
            f"its layers (norms, MLP) are not mapped onto DeepSeek-V3's; exportable: {', '.join(EXPORTABLE_MODEL_TYPES)}"
        )
    if problems:
        raise UnsupportedModelError(f"cannot export {model_type!r} as DeepSeek-V3 MLA: " + "; ".join(problems))


@dataclass(frozen=True)
class MLAWidths:
    rope_components: int  # complex components kept per kept rotary frequency
    qk_rope_head_dim: int  # d_r = rope_components * head_dim / rope_frequency_stride
    kv_lora_rank: int
    share: float  # (r + d_r) / (2 n_kv d): cached values per token against the source's K+V
    rope_frequency_stride: int = 1  # every stride-th rotary frequency keeps its rotation (method/mla.py)


def widths_for_share(geometry, kv_share: float, rope_components: int = 1, rope_frequency_stride: int = 1) -> MLAWidths:
    """Uniform widths for a target share of the source's K+V values per token and layer (d_r = rope_components *
    head_dim / rope_frequency_stride)."""
    total = 2 * geometry.num_key_value_heads * geometry.head_dim
    d_r = rope_components * geometry.head_dim // rope_frequency_stride
    r = min(round(kv_share * total) - d_r, full_latent_rank(geometry, rope_components, rope_frequency_stride))
    if r < 1:
        raise InvalidArgumentError(
            f"`kv_share={kv_share}` keeps {round(kv_share * total)} values per token, not more than the {d_r} of the "
            f"shared RoPE key; choose a share above {(d_r + 1) / total:.3f}"
        )
    return MLAWidths(rope_components, d_r, r, (r + d_r) / total, rope_frequency_stride)


def widths_for_ranks(geometry, kv_lora_rank: int, qk_rope_head_dim: int | None = None) -> MLAWidths:
    """Exact widths, for engines whose kernels take fixed cached widths (vLLM's MLA: r + d_r = 512 + 64 or 256 + 64).

    qk_rope_head_dim defaults to head_dim; a narrower one must be head_dim / s, s dividing head_dim / 2 (every s-th
    rotary frequency keeps its rotation, so DeepSeek's schedule still gives the source's frequencies)."""
    d = geometry.head_dim
    d_r = d if qk_rope_head_dim is None else qk_rope_head_dim
    if d_r < 2 or d_r > d or d % d_r or (d // 2) % (d // d_r):
        raise InvalidArgumentError(
            f"`qk_rope_head_dim` must be head_dim ({d}) divided by a divisor of head_dim / 2 ({d // 2}), got {d_r}"
        )
    stride = d // d_r
    full = full_latent_rank(geometry, 1, stride)
    if not 1 <= kv_lora_rank <= full:
        raise InvalidArgumentError(
            f"`kv_lora_rank` must be within 1..{full} at qk_rope_head_dim {d_r}, got {kv_lora_rank}"
        )
    total = 2 * geometry.num_key_value_heads * d
    return MLAWidths(1, d_r, kv_lora_rank, (kv_lora_rank + d_r) / total, stride)


@dataclass
class AttentionInputStatistics:
    grams: list[torch.Tensor]  # per layer [hidden, hidden] float64 sum of x x^T over calibration tokens
    max_square_norms: list[float]  # per layer, the largest per-token ||x||^2


def run_statistics_with_attention_inputs(ctx, passes: list) -> tuple[Any, AttentionInputStatistics]:
    """Run the statistics passes from ctx (returning the context they produce); while the Grams are collected, also
    sum the attention inputs' Gram.

    The hooks sit on the source skeleton's k_proj (whose input is the normalised hidden state every projection
    reads); the streamed forward reuses those module objects, so one pass over the calibration windows serves both.
    """
    inputs: AttentionInputStatistics | None = None
    collector: _AttentionInputSums | None = None
    handles = []
    try:
        for step in passes:
            if step.name == "collect_statistics":
                collector = _AttentionInputSums(ctx.geometry.hidden_size, ctx.geometry.num_layers)
                handles = collector.hook(ctx.adapter, ctx.source.skeleton)
            ctx = run_pass(ctx, step)
    finally:
        for handle in handles:
            handle.remove()
    if collector is None:
        raise InvalidArgumentError("the statistics passes have no collect_statistics step")
    inputs = collector.finish()
    return ctx, inputs


class _AttentionInputSums:
    """Each layer's Gram and largest squared norm of its attention inputs, summed on the device the inputs are on.

    The statistics stream the windows layer by layer, so one layer's sums stay on the device while its batches pass
    and go to the host once, when another layer's first batch arrives (or at the end): one [hidden, hidden] copy per
    layer, not one per batch, and no host wait per batch for the norm."""

    def __init__(self, hidden: int, num_layers: int):
        self.hidden = hidden
        self.stats = AttentionInputStatistics(
            [torch.zeros(hidden, hidden, dtype=torch.float64) for _ in range(num_layers)], [0.0] * num_layers
        )
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (Gram, max squared norm)

    def hook(self, adapter, skeleton) -> list:
        def accumulate(idx: int):
            def pre_hook(_module, args):
                x = args[0].detach().reshape(-1, self.hidden).double()  # on the compile device: its product runs there
                for other in [i for i in self.pending if i != idx]:
                    self._flush(other)
                gram, norm = self.pending.get(idx) or (x.new_zeros(self.hidden, self.hidden), x.new_zeros(()))
                gram += x.T @ x
                self.pending[idx] = (gram, torch.maximum(norm, x.square().sum(-1).max()))

            return pre_hook

        return [
            adapter.attention(layer).k_proj.register_forward_pre_hook(accumulate(idx))
            for idx, layer in enumerate(adapter.decoder_layers(skeleton))
        ]

    def _flush(self, idx: int) -> None:
        gram, norm = self.pending.pop(idx)
        self.stats.grams[idx] += gram.cpu()
        self.stats.max_square_norms[idx] = max(self.stats.max_square_norms[idx], float(norm))

    def finish(self) -> AttentionInputStatistics:
        for idx in list(self.pending):
            self._flush(idx)
        return self.stats


def source_scaling(adapter, config, geometry) -> float:
    scaling = adapter.features(config).scaling
    return scaling if scaling is not None else geometry.head_dim**-0.5


def compute_mla_layers(
    ctx,
    inputs: AttentionInputStatistics,
    widths: MLAWidths,
    key_weight: float = DEFAULT_KEY_WEIGHT,
    progress=None,
    rope_response: torch.Tensor | None = None,
) -> list[MLALayer]:
    """Every layer's MLA weights at the given uniform widths (float64).

    rope_response: [layers, heads, head_dim / 2] expected rotations (compile/mla/rope_response.py) that the position-free
    queries are scored with; None scores them with the source queries as they are (rotation dropped)."""
    layers = []
    scaling = source_scaling(ctx.adapter, ctx.config, ctx.geometry)
    for idx in range(ctx.geometry.num_layers):
        proj, _ = ctx.source.attention_weights(idx)
        layers.append(
            mla_layer(
                ctx.statistics.layers[idx],
                ctx.geometry,
                proj.q_weight,
                proj.k_weight,
                proj.v_weight,
                proj.o_weight,
                inputs.grams[idx],
                rope_components=widths.rope_components,
                latent_rank=widths.kv_lora_rank,
                source_scaling=scaling,
                key_weight=key_weight,
                rope_frequency_stride=widths.rope_frequency_stride,
                rope_response=None if rope_response is None else rope_response[idx],
            )
        )
        if progress is not None:
            progress()
    return layers


def latent_max_mean_square(layer: MLALayer, max_square_norm: float) -> float:
    """An upper bound on any calibration token's mean(c^2): ||A||_2^2 max||x||^2 / r."""
    latent_rows = layer.kv_a_proj_with_mqa[: layer.kv_lora_rank]
    return float(torch.linalg.matrix_norm(latent_rows, ord=2)) ** 2 * max_square_norm / layer.kv_lora_rank


# ---- the maths' own forward (reference) ------------------------------------------------------------------------


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2p, 2p + 1) of x [..., d_r] by angles whose cos/sin are [..., d_r / 2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)


# The MLA weights the reference attention holds as tensors; o_proj, the fourth, is an nn.Linear (below).
MLA_TENSOR_WEIGHT_NAMES = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLA_WEIGHT_NAMES = (*MLA_TENSOR_WEIGHT_NAMES, "o_proj")


class MLAReferenceAttention(nn.Module):
    """Expanded MLA attention from MLALayer weights; RoPE angles read from the source model's own cos/sin tables.

    trainable: the four weights are parameters (what --distill trains, compile/mla/distill.py), else frozen.
    o_proj is a bias-free nn.Linear, as in the stock attention, so the adapters' output_projection(attn) finds it
    (the o_proj refit hooks it, compile/mla/refit.py); the other three are plain tensors."""

    def __init__(
        self,
        layer: MLALayer,
        num_heads: int,
        dtype: torch.dtype,
        trainable: bool = False,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.layer, self.num_heads = layer, num_heads
        for name in MLA_TENSOR_WEIGHT_NAMES:
            weight = getattr(layer, name).to(device=device, dtype=dtype)
            if trainable:
                self.register_parameter(name, nn.Parameter(weight.clone()))
            else:
                self.register_buffer(name, weight)
        # Where the model's cos/sin tables are, so that picking the kept frequencies copies nothing from the host.
        self.register_buffer("pair_frequency", layer.pair_frequency.to(device), persistent=False)
        out_features, in_features = layer.o_proj.shape
        self.o_proj = nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
        with torch.no_grad():
            self.o_proj.weight.copy_(layer.o_proj)
        self.o_proj.weight.requires_grad_(trainable)
        self.scaling = (layer.qk_nope_head_dim + layer.qk_rope_head_dim) ** -0.5
        # [r] of 0/1 while a narrower width of the rate table is trained (distill.nested_mla_rate_mix): the dims
        # beyond it are zero, exactly as the form truncated to that width, and get no gradient.
        self.latent_keep: torch.Tensor | None = None

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        lay, n_h = self.layer, self.num_heads
        batch, length, _ = hidden_states.shape
        d_nope, d_r, d_v, r = lay.qk_nope_head_dim, lay.qk_rope_head_dim, lay.v_head_dim, lay.kv_lora_rank
        q = (hidden_states @ self.q_proj.T).view(batch, length, n_h, d_nope + d_r).transpose(1, 2)
        q_nope, q_pe = q.split([d_nope, d_r], dim=-1)
        latent, k_pe = (hidden_states @ self.kv_a_proj_with_mqa.T).split([r, d_r], dim=-1)
        if self.latent_keep is not None:
            latent = latent * self.latent_keep
        kv = (latent @ self.kv_b_proj.T).view(batch, length, n_h, d_nope + d_v).transpose(1, 2)
        k_nope, v = kv.split([d_nope, d_v], dim=-1)
        cos, sin = position_embeddings  # [B, T, head_dim], HF layout: angle of frequency j at j and j + d/2
        cos, sin = cos[..., self.pair_frequency].unsqueeze(1), sin[..., self.pair_frequency].unsqueeze(1)
        q_pe = rotate_interleaved(q_pe, cos, sin)
        k_pe = rotate_interleaved(k_pe.unsqueeze(1), cos, sin)
        scores = (q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)) * self.scaling
        causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
        probs = scores.masked_fill(causal, -math.inf).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(batch, length, n_h * d_v)
        return self.o_proj(out), None


def mla_reference_model(model: nn.Module, layers: list[MLALayer], trainable: bool = False) -> nn.Module:
    """A copy of the stock model whose attention is the MLA form (for whole-sequence logits; no cache, no padding),
    on the device `model` is on.

    trainable: the MLA weights are parameters (the rest of the copy is the original's, as parameters too)."""
    adapter = adapter_for(model.config)
    mla = copy.deepcopy(model)
    first = next(model.parameters())
    heads = model.config.num_attention_heads
    for layer, weights in zip(adapter.decoder_layers(mla), layers):
        attention = MLAReferenceAttention(weights, heads, first.dtype, trainable=trainable, device=first.device)
        setattr(layer, adapter.attention_attr, attention)
    return mla.eval()


def mla_layers_of(model: nn.Module, layers: list[MLALayer]) -> list[MLALayer]:
    """The MLA weights `model` (an mla_reference_model) holds now, as MLALayers (float64) with `layers`' widths."""
    adapter = adapter_for(model.config)
    found = []
    for decoder_layer, layer in zip(adapter.decoder_layers(model), layers):
        attention = getattr(decoder_layer, adapter.attention_attr)
        weights = {name: getattr(attention, name) for name in MLA_TENSOR_WEIGHT_NAMES} | {
            "o_proj": attention.o_proj.weight
        }
        found.append(
            dataclasses.replace(
                layer, **{name: weight.detach().to("cpu", torch.float64).clone() for name, weight in weights.items()}
            )
        )
    return found


def _measure_attention_inputs(model, windows: torch.Tensor, progress: bool = False) -> tuple[list[float], list[float]]:
    """Per MLA layer of `model`: the largest ||x||^2 at its input and the largest mean(c^2) of its latent c, over
    every token of `windows` (one window at a time, no gradients)."""
    attentions = [m for m in model.modules() if isinstance(m, MLAReferenceAttention)]
    inputs, latents = [0.0] * len(attentions), [0.0] * len(attentions)

    def hook(idx: int, attention: MLAReferenceAttention):
        def measure(_module, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).detach().double()
            c = x @ attention.kv_a_proj_with_mqa[: attention.layer.kv_lora_rank].detach().double().T
            inputs[idx] = max(inputs[idx], float(x.square().sum(-1).max()))
            latents[idx] = max(latents[idx], float(c.square().mean(-1).max()))

        return measure

    handles = [a.register_forward_pre_hook(hook(i, a), with_kwargs=True) for i, a in enumerate(attentions)]
    try:
        with torch.no_grad(), progress_bar("latent-norm check on the form", len(windows), progress) as bar:
            for window in windows.split(1):
                model(window)
                bar.advance()
    finally:
        for handle in handles:
            handle.remove()
    return inputs, latents


def latent_norm_inputs(
    prepared, model, windows: torch.Tensor, progress: bool = False
) -> tuple[list[float], list[float]]:
    """For the latent-norm bound of a form whose weights changed after the statistics (refit, distillation): per
    layer, the larger of the original's and `model`'s largest ||x||^2 at the attention input (its residual stream
    differs from the original's), and `model`'s largest latent mean(c^2), over `windows`."""
    inputs, latents = _measure_attention_inputs(model, windows, progress)
    return [max(a, b) for a, b in zip(prepared.inputs.max_square_norms, inputs)], latents
