"""Calibration statistics: per layer and head, d_h x d_h Gram matrices of the attention activations.

Every objective needs only these (docs/method.md, "Statistics"): the right singular vectors of a row-stack are the
eigenvectors of its summed Grams, so memory is O(layers x heads x d_h^2) for any corpus size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# Activations we keep Grams of. Query kinds are summed over the query heads of a KV group (the
# paper's row-stack of the group's Q_h), except "output", kept per query head.
KV_GROUP_KINDS = ("query_pre", "key_pre", "query_post", "key_post", "value")
PER_QUERY_HEAD_KINDS = ("output",)
# One [n_kv*d, n_kv*d] Gram per layer of the pre-RoPE keys of all KV heads side by side (the cross-head
# covariances the crosshead key mode needs).
PER_LAYER_KINDS = ("key_pre_layer",)


@dataclass
class LayerStatistics:
    grams: dict[str, torch.Tensor]  # kind -> [heads, d, d] float64 sums over calibration tokens
    tokens: int

    def gram(self, kind: str, head: int) -> torch.Tensor:
        return self.grams[kind][head]


@dataclass
class CalibrationStatistics:
    layers: list[LayerStatistics]
    tokens: int
    reduce: str = "none"
    notes: dict = field(default_factory=dict)


class GramAccumulator:
    """Sums X^T X in float64 per (layer, kind, head) while calibration batches stream through."""

    def __init__(self, num_layers: int, num_kv_heads: int, num_heads: int, head_dim: int):
        self.grams = [
            {
                **{k: torch.zeros(num_kv_heads, head_dim, head_dim, dtype=torch.float64) for k in KV_GROUP_KINDS},
                **{k: torch.zeros(num_heads, head_dim, head_dim, dtype=torch.float64) for k in PER_QUERY_HEAD_KINDS},
                **{
                    k: torch.zeros(1, num_kv_heads * head_dim, num_kv_heads * head_dim, dtype=torch.float64)
                    for k in PER_LAYER_KINDS
                },
            }
            for _ in range(num_layers)
        ]
        self.tokens = [0] * num_layers

    def add(self, layer: int, kind: str, head: int, rows: torch.Tensor) -> None:
        rows = rows.reshape(-1, rows.shape[-1]).double()
        target = self.grams[layer][kind]
        target[head] += (rows.T @ rows).to(target.device)  # Grams stay on the CPU whatever the compute device

    def count(self, layer: int, tokens: int) -> None:
        self.tokens[layer] += tokens

    def finish(self) -> CalibrationStatistics:
        layers = [LayerStatistics(grams=g, tokens=t) for g, t in zip(self.grams, self.tokens)]
        return CalibrationStatistics(layers=layers, tokens=max(self.tokens, default=0), reduce="none")


class KMeansGramReducer(GramAccumulator):
    """ZDC §5.1's reducer: drop a share of sequences, k-means the remaining vectors, Gram of the centroids.

    Each centroid is weighted by its cluster size and the result rescaled to the full token count, so
    its scale matches the exact Gram (which matters where Grams are stacked with weights, as in zack).
    """

    def __init__(
        self, num_layers, num_kv_heads, num_heads, head_dim, clusters: int = 256, keep_share: float = 0.5, seed: int = 0
    ):
        super().__init__(num_layers, num_kv_heads, num_heads, head_dim)
        self.clusters, self.keep_share, self.seed = clusters, keep_share, seed
        self.samples: dict[tuple[int, str, int], list[np.ndarray]] = {}
        self._rng = np.random.default_rng(seed)
        self.keep_batch = True
        self.group_size = num_heads // num_kv_heads

    def batch_rng_state(self) -> dict:
        """The batch-sampling state, so a layer-by-layer run keeps the same batches at every layer."""
        return self._rng.bit_generator.state

    def restore_batch_rng_state(self, state: dict) -> None:
        self._rng.bit_generator.state = state

    def start_batch(self) -> None:
        # Sequence pruning: decide once per batch whether its vectors are kept for clustering.
        self.keep_batch = bool(self._rng.random() < self.keep_share)

    def add(self, layer, kind, head, rows):
        super().add(layer, kind, head, rows)  # exact Gram kept too, to report how far k-means moves things
        if self.keep_batch:
            flat = rows.reshape(-1, rows.shape[-1]).float().cpu().numpy()
            self.samples.setdefault((layer, kind, head), []).append(flat)

    def finish(self) -> CalibrationStatistics:
        from sklearn.cluster import MiniBatchKMeans

        exact = super().finish()
        reduced_layers = []
        drift = []
        for layer_idx, layer in enumerate(exact.layers):
            reduced = {}
            for kind, grams in layer.grams.items():
                out = grams.clone()
                for head in range(grams.shape[0]):
                    chunks = self.samples.get((layer_idx, kind, head))
                    if not chunks:
                        continue
                    vectors = np.concatenate(chunks)
                    k = min(self.clusters, len(vectors))
                    km = MiniBatchKMeans(n_clusters=k, random_state=self.seed, n_init=1, batch_size=2048).fit(vectors)
                    sizes = np.bincount(km.labels_, minlength=k).astype(np.float64)
                    centres = torch.from_numpy(km.cluster_centers_.astype(np.float64))
                    gram = (centres.T * torch.from_numpy(sizes)) @ centres
                    # Rescale from the kept (pruned) rows to every calibration row.
                    gram *= layer.tokens * self._rows_per_token(kind) / vectors.shape[0]
                    drift.append(float((gram - grams[head]).norm() / grams[head].norm().clamp_min(1e-300)))
                    out[head] = gram
                reduced[kind] = out
            reduced_layers.append(LayerStatistics(grams=reduced, tokens=layer.tokens))
        notes = {
            "kmeans_relative_gram_change_mean": float(np.mean(drift)) if drift else 0.0,
            "kmeans_relative_gram_change_max": float(np.max(drift)) if drift else 0.0,
            "clusters": self.clusters,
            "keep_share": self.keep_share,
        }
        return CalibrationStatistics(layers=reduced_layers, tokens=exact.tokens, reduce="kmeans", notes=notes)

    def _rows_per_token(self, kind: str) -> int:
        # Query kinds stack the rows of every query head of the KV group.
        return self.group_size if kind in ("query_pre", "query_post") else 1
