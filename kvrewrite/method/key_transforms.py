"""Key side for RoPE models: three modes (docs/method.md, "Key side"), each exact at full rank.

- freq: keep whole rotary frequency pairs ranked by score energy; a pure selection commutes with RoPE,
  so it folds into q_proj/k_proj (pairs stored interleaved, most important first).
- post-rope: q and k are projected after RoPE by per-head [d, r] maps (ZACK §5.1).
- folded (models without RoPE): the post-rope maps, folded into q_proj/k_proj (ZACK Fig. 8).
- latent: the cache holds an r-dim latent of the pre-RoPE key (folded into k_proj); attention rebuilds
  k with a per-head up-projection and rotates it. The basis minimises the error of the scores q.k
  under the group's query Gram (query-aware), not plain key PCA.
- crosshead: per rotary frequency, a complex-linear mix across the layer's KV heads (crosshead_keys.py);
  commutes with RoPE, folds into q_proj/k_proj, one shared key block per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.adapters.base import AttentionGeometry
from kvrewrite.method.crosshead_keys import crosshead_maps
from kvrewrite.method.linalg import kq_svd, principal_basis, psd_sqrt, whitened_projection
from kvrewrite.spec import KEY_MODE_CROSSHEAD, KEY_MODE_FOLDED, KEY_MODE_FREQ, KEY_MODE_LATENT, KEY_MODE_POST_ROPE
from kvrewrite.method.statistics import LayerStatistics


@dataclass
class KeyTransform:
    mode: str
    spectrum: torch.Tensor  # [n_kv, d] ([1, n_kv*d] crosshead), descending; truncation error ~ removed squares
    freq_order: torch.Tensor | None = None  # freq: [n_kv, d/2] ([1, n_kv*d/2] crosshead) frequencies, most important first
    q_map: torch.Tensor | None = None  # post-rope: [n_kv, d, d]
    k_map: torch.Tensor | None = None  # post-rope: [n_kv, d, d]
    down: torch.Tensor | None = None  # latent: [n_kv, d, d] folded into k_proj
    up: torch.Tensor | None = None  # latent: [n_kv, d, d] rebuilds the pre-RoPE key
    k_fold: torch.Tensor | None = None  # crosshead: [n_kv*d, n_kv*d] new k_proj rows from the old ones
    q_fold: torch.Tensor | None = None  # crosshead: [n_q, n_kv*d, d] new rows of each query head


def frequency_pair_energy(query_gram: torch.Tensor, key_gram: torch.Tensor) -> torch.Tensor:
    """sqrt(tr S_j tr T_j) for every rotary pair j = (j, j + d/2): bounds that pair's share of q.k.

    A RoPE rotation preserves each pair's norm, so pre-RoPE Grams give the same energy as post-RoPE.
    """
    half = query_gram.shape[-1] // 2
    sq, tk = torch.diagonal(query_gram), torch.diagonal(key_gram)
    return ((sq[:half] + sq[half:]) * (tk[:half] + tk[half:])).clamp_min(0).sqrt()


def interleaved_pair_rows(order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Row permutation storing pairs as (j0, j0 + d/2, j1, j1 + d/2, ...) for frequencies in `order`."""
    return torch.stack((order, order + head_dim // 2), dim=1).flatten()


def key_transform(mode: str, objective: str, stats: LayerStatistics, geometry: AttentionGeometry) -> KeyTransform:
    n_kv = geometry.num_key_value_heads
    if mode == KEY_MODE_FREQ:
        orders, spectra = [], []
        for g in range(n_kv):
            energy = frequency_pair_energy(stats.gram("query_pre", g), stats.gram("key_pre", g))
            order = torch.argsort(energy, descending=True)
            # Each stored dim carries half its pair's energy, so squares sum to the pair's energy^2.
            per_dim = (energy[order] / 2**0.5).repeat_interleave(2)
            orders.append(order)
            spectra.append(per_dim)
        return KeyTransform(mode, torch.stack(spectra), freq_order=torch.stack(orders))

    if mode in (KEY_MODE_POST_ROPE, KEY_MODE_FOLDED):
        # folded (no RoPE): the same maps, folded into W_Q/W_K instead of applied online; post-RoPE
        # Grams equal pre-RoPE ones there.
        q_maps, k_maps, spectra = [], [], []
        for g in range(n_kv):
            s, t = stats.gram("query_post", g), stats.gram("key_post", g)
            if objective == "zack":
                # Paper-faithful: one rotation R from the SVD of the row-stack [Q_h for h in g ; K_g].
                pair = principal_basis(s + t)
                q_maps.append(pair.down)
                k_maps.append(pair.down)
                spectra.append(pair.spectrum)
            else:
                bil = kq_svd(s, t)
                q_maps.append(bil.q_map)
                k_maps.append(bil.k_map)
                spectra.append(bil.spectrum)
        return KeyTransform(mode, torch.stack(spectra), q_map=torch.stack(q_maps), k_map=torch.stack(k_maps))

    if mode == KEY_MODE_LATENT:
        downs, ups, spectra = [], [], []
        for g in range(n_kv):
            s, t = stats.gram("query_pre", g), stats.gram("key_pre", g)
            if objective == "zack":
                pair = principal_basis(s + t)
            else:
                # min E (q.(k - k A_r B_r))^2 = ||T^{1/2}(I - A_r B_r) S^{1/2}||^2: whitened projection
                # with the key Gram as input metric and the query Gram's root as output map.
                pair = whitened_projection(t, psd_sqrt(s))
            downs.append(pair.down)
            ups.append(pair.up)
            spectra.append(pair.spectrum)
        return KeyTransform(mode, torch.stack(spectra), down=torch.stack(downs), up=torch.stack(ups))

    if mode == KEY_MODE_CROSSHEAD:
        maps = crosshead_maps(stats, geometry)  # query-aware for both objectives (no paper version exists)
        return KeyTransform(mode, maps.spectrum[None], freq_order=maps.freq_order[None], k_fold=maps.k_fold, q_fold=maps.q_fold)

    raise ValueError(f"unknown key mode {mode!r}")
