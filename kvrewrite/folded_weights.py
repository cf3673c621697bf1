"""The rewritten model's tensors, folded from the source one layer at a time (never the whole model at once).

Folding is cheap (a few d_h x d_h products per head), so each consumer (sensitivity probes, verify, emit)
asks for the layer it is running and the fold is redone from the source shards rather than kept.
All products are formed in float64; consumers cast to their own dtype.
"""

from __future__ import annotations

import torch

from kvrewrite.compressed_model import compressed_config
from kvrewrite.key_transforms import interleaved_pair_rows
from kvrewrite.layer_streaming import SourceModel, StreamedModel, empty_model
from kvrewrite.modeling.llama import KVRewriteLlamaForCausalLM
from kvrewrite.spec import KEY_MODE_CROSSHEAD, KEY_MODE_FREQ, KEY_MODE_LATENT, KEY_MODE_POST_ROPE, CompressionSpec, full_key_ranks


def fold_layer(weights: dict[str, torch.Tensor], transforms, geometry) -> dict[str, torch.Tensor]:
    """New attention tensors of one layer (float64), keyed by their name inside the attention module.

    `weights` holds the original attention tensors under the same names; any tensor the fold does not
    touch is passed through unchanged.
    """
    d = geometry.head_dim
    w_q = weights["q_proj.weight"].double()
    w_k = weights["k_proj.weight"].double()
    w_v = weights["v_proj.weight"].double()
    w_o = weights["o_proj.weight"].double()
    key, value = transforms.key, transforms.value
    out: dict[str, torch.Tensor] = dict(weights)

    new_q, new_k, new_v, new_o = w_q.clone(), w_k.clone(), w_v.clone(), w_o.clone()
    for g in range(geometry.num_key_value_heads):
        kv_rows = slice(g * d, (g + 1) * d)
        # Value side: v latents = v @ down  =>  rows of W_v become down^T W_v; o_proj columns of every
        # query head in the group absorb up (W_o[:, h] -> W_o[:, h] up^T).
        new_v[kv_rows] = value.down[g].T @ w_v[kv_rows]
        for h in geometry.query_heads_of(g):
            new_o[:, h * d : (h + 1) * d] = w_o[:, h * d : (h + 1) * d] @ value.up[g].T
        if key.mode == KEY_MODE_FREQ:
            rows = interleaved_pair_rows(key.freq_order[g], d)
            new_k[kv_rows] = w_k[kv_rows][rows]
            for h in geometry.query_heads_of(g):
                new_q[h * d : (h + 1) * d] = w_q[h * d : (h + 1) * d][rows]
        elif key.mode == KEY_MODE_LATENT:
            new_k[kv_rows] = key.down[g].T @ w_k[kv_rows]
    if key.mode == KEY_MODE_CROSSHEAD:
        # Every query head now scores against the whole shared key block: n_kv*d rows per head at full rank.
        new_k = key.k_fold.double() @ w_k
        new_q = torch.cat([key.q_fold[h].double() @ w_q[h * d : (h + 1) * d] for h in range(geometry.num_attention_heads)])
    out["q_proj.weight"] = new_q
    out["k_proj.weight"] = new_k
    out["v_proj.weight"] = new_v
    out["o_proj.weight"] = new_o
    if key.mode == KEY_MODE_POST_ROPE:
        out["q_map"] = key.q_map
        out["k_map"] = key.k_map
    elif key.mode == KEY_MODE_LATENT:
        out["k_up"] = key.up
    return {name: t.double().contiguous() for name, t in out.items()}


def full_rank(spec: CompressionSpec) -> CompressionSpec:
    d = spec.head_dim
    return spec.with_ranks([full_key_ranks(l.key_mode, len(l.key_ranks), d) for l in spec.layers],
                           [[d] * len(l.value_ranks) for l in spec.layers], 0.0)


class FoldedWeights:
    """Tensors of the rewritten checkpoint by name: attention tensors folded on demand, the rest read from the source."""

    def __init__(self, source: SourceModel, transforms: list, geometry):
        self.source, self.transforms, self.geometry = source, transforms, geometry
        self.attention_prefixes = [source.attention_prefix(i) for i in range(geometry.num_layers)]
        self._last: tuple[int, dict[str, torch.Tensor]] | None = None  # the most recently folded layer
        self.layers_folded = 0

    def _attention_of(self, name: str) -> tuple[int, str] | None:
        for idx, prefix in enumerate(self.attention_prefixes):
            if name.startswith(prefix + "."):
                return idx, name[len(prefix) + 1 :]
        return None

    def attention(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """Folded tensors of one layer's attention (float64), keyed by their name inside the attention module."""
        if self._last is None or self._last[0] != layer_idx:
            self._last = None  # drop the previous layer before folding the next
            prefix = self.attention_prefixes[layer_idx]
            names = [n for n in self.source.checkpoint.names() if n.startswith(prefix + ".")]
            original = self.source.read(names)
            local = {n[len(prefix) + 1 :]: t for n, t in original.items()}
            del original
            self._last = (layer_idx, fold_layer(local, self.transforms[layer_idx], self.geometry))
            self.layers_folded += 1
        return self._last[1]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """A TensorSource for StreamedModel and Emit: folded attention tensors, source tensors otherwise."""
        out, plain = {}, []
        for name in names:
            where = self._attention_of(name)
            if where is None:
                plain.append(name)
            else:
                out[name] = self.attention(where[0])[where[1]]
        out.update(self.source.read(plain))
        return out

    def skeleton(self, spec: CompressionSpec):
        """The rewritten model on the meta device, at full rank (the shapes the checkpoint stores)."""
        return empty_model(KVRewriteLlamaForCausalLM, compressed_config(self.source.config, full_rank(spec)))

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
