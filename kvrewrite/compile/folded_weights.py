"""The rewritten model's tensors, folded from the source one layer at a time (never the whole model at once).

Folding is cheap (a few d_h x d_h products per head), so each consumer (sensitivity probes, verify, emit)
asks for the layer it is running and the fold is redone from the source shards rather than kept.
All products are formed in float64; consumers cast to their own dtype.
"""

from __future__ import annotations

import copy

import torch

from kvrewrite.adapters.base import Projections
from kvrewrite.compile.layer_streaming import SourceModel, StreamedModel, empty_model
from kvrewrite.key_modes import key_mode
from kvrewrite.runtime.compressed_model import compressed_classes, compressed_config
from kvrewrite.spec import CompressionSpec


def fold_layer(
    projections: Projections, transforms, geometry, kept: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """New attention tensors of one layer, keyed by their name inside CompressedAttention, in the dtype of
    `projections` (products formed in float64).

    A bias row is transformed exactly like its weight row (the bias is the weight's column for a constant 1).
    Fused or differently named originals (Phi-3's qkv_proj, GPT-2's c_attn, OPT's out_proj) are not passed
    through: the compressed attention always has separate q_proj/k_proj/v_proj/o_proj.
    """
    d = geometry.head_dim
    dtype = projections.q_weight.dtype

    def f64(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().double()

    w_q, w_k, w_v, w_o = (
        f64(t) for t in (projections.q_weight, projections.k_weight, projections.v_weight, projections.o_weight)
    )
    b_q, b_k, b_v = f64(projections.q_bias), f64(projections.k_bias), f64(projections.v_bias)
    key, value = transforms.key, transforms.value
    mode = key_mode(key.mode)
    original = {"q": (w_q, b_q), "k": (w_k, b_k), "v": (w_v, b_v)}
    # Key side: the mode's fold of q_proj/k_proj (kvrewrite/key_modes/); the value side below.
    new = dict(zip("qk", mode.fold(key, original["q"], original["k"], geometry)))
    new["v"] = (w_v.clone(), None if b_v is None else b_v.clone())
    new_o = w_o.clone()

    def transform_rows(side: str, rows: slice, fn) -> None:
        """Rows `rows` of side's weight and bias become fn(original rows)."""
        (weight, bias), (new_weight, new_b) = original[side], new[side]
        new_weight[rows] = fn(weight[rows])
        if bias is not None:
            new_b[rows] = fn(bias[rows])

    for g in range(geometry.num_key_value_heads):
        kv_rows = slice(g * d, (g + 1) * d)
        q_rows = [slice(h * d, (h + 1) * d) for h in geometry.query_heads_of(g)]
        # Value side: v latents = v @ down  =>  rows of W_v (and b_v) become down^T W_v; o_proj columns of
        # every query head in the group absorb up (W_o[:, h] -> W_o[:, h] up^T). o_proj's bias is unchanged.
        transform_rows("v", kv_rows, lambda x, m=value.down[g]: m.T @ x)
        for rows in q_rows:
            new_o[:, rows] = w_o[:, rows] @ value.up[g].T

    out: dict[str, torch.Tensor] = {"o_proj.weight": new_o}
    for side, (weight, bias) in new.items():
        out[f"{side}_proj.weight"] = weight
        if bias is not None:
            out[f"{side}_proj.bias"] = bias
    if projections.o_bias is not None:
        out["o_proj.bias"] = projections.o_bias
    out.update(mode.stored_tensors(key))
    out.update(kept or {})
    return {name: t.to(dtype).contiguous() for name, t in out.items()}


def full_rank(spec: CompressionSpec) -> CompressionSpec:
    d = spec.head_dim
    return spec.with_ranks(
        [key_mode(l.key_mode).full_key_ranks(len(l.key_ranks), d) for l in spec.layers],
        [[d] * len(l.value_ranks) for l in spec.layers],
        0.0,
    )


class FoldedWeights:
    """Tensors of the rewritten checkpoint by name: attention tensors folded on demand, the rest read from the source."""

    def __init__(self, source: SourceModel, transforms: list, geometry):
        self.source, self.transforms, self.geometry = source, transforms, geometry
        self.attention_prefixes = [source.attention_prefix(i) for i in range(geometry.num_layers)]
        self._last: tuple[int, dict[str, torch.Tensor]] | None = None  # the most recently folded layer
        # Tensors replaced after the fold (refit's o_proj, distillation's attention weights), served by read() instead
        # of the fold. Set only through with_overrides: a FoldedWeights, once made, serves the same tensors.
        self.overrides: dict[str, torch.Tensor] = {}

    def with_overrides(self, tensors: dict[str, torch.Tensor]) -> FoldedWeights:
        """The same folded weights with `tensors` replacing (or adding to) the overrides; this object is unchanged."""
        updated = copy.copy(self)
        updated.overrides = {**self.overrides, **tensors}
        return updated

    def _attention_of(self, name: str) -> tuple[int, str] | None:
        for idx, prefix in enumerate(self.attention_prefixes):
            if name.startswith(prefix + "."):
                return idx, name[len(prefix) + 1 :]
        return None

    def attention(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """Folded tensors of one layer's attention (float64), keyed by their name inside the attention module."""
        if self._last is None or self._last[0] != layer_idx:
            self._last = None  # drop the previous layer before folding the next
            projections, kept = self.source.attention_weights(layer_idx)
            self._last = (layer_idx, fold_layer(projections, self.transforms[layer_idx], self.geometry, kept))
        return self._last[1]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """A TensorSource for StreamedModel and Emit: folded attention tensors, source tensors otherwise."""
        out, plain = {}, []
        for name in names:
            if name in self.overrides:
                out[name] = self.overrides[name]
                continue
            where = self._attention_of(name)
            if where is None:
                plain.append(name)
            else:
                out[name] = self.attention(where[0])[where[1]]
        out.update(self.source.read(plain))
        return out

    def skeleton(self, spec: CompressionSpec):
        """The rewritten model on the meta device, at full rank (the shapes the checkpoint stores)."""
        _, model_class = compressed_classes(self.source.config)
        return empty_model(model_class, compressed_config(self.source.config, full_rank(spec)))

    def streamed(self, spec: CompressionSpec, dtype: torch.dtype, device: str = "cpu") -> StreamedModel:
        """The rewritten model at full rank, run layer by layer (slice a layer with set_ranks / probe_ranks)."""
        return StreamedModel(self.skeleton(spec), self.source.adapter, self.read, dtype, device)

    def output_names(self, spec: CompressionSpec) -> list[str]:
        """Every tensor the checkpoint stores, in module order (a tied LM head is stored once, as the embedding)."""
        skeleton = self.skeleton(spec)
        names = list(skeleton.state_dict().keys())
        if getattr(self.source.config, "tie_word_embeddings", False):
            head = self.source.output_embedding_name()
            names = [n for n in names if n != head]
        return names
