"""The maths of the key side for RoPE models (docs/method.md, "Key side"): each mode's basis, exact at full rank.

The modes themselves (what they store, fold and do at run time) live in kvrewrite/key_modes/, one file each;
these are the solvers they call.

- freq: keep whole rotary frequency pairs ranked by score energy; a pure selection commutes with RoPE.
- post-rope / folded: per-head [d, r] maps of q and k after RoPE (ZACK §5.1), folded into W_Q/W_K without RoPE.
- latent: an r-dim latent of the pre-RoPE key, minimising the error of the scores q.k under the group's query
  Gram (query-aware), not plain key PCA.
- crosshead: per rotary frequency, a complex-linear mix across the layer's KV heads (crosshead_keys.py).
"""

from __future__ import annotations

import torch

from kvrewrite.method.linalg import kq_svd, principal_basis, psd_sqrt, whitened_projection
from kvrewrite.method.statistics import LayerStatistics


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


def frequency_pair_selection(stats: LayerStatistics, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the rotary frequencies most important first [n_kv, d/2] and the per-stored-dim spectrum [n_kv, d]."""
    orders, spectra = [], []
    for g in range(num_kv_heads):
        energy = frequency_pair_energy(stats.gram("query_pre", g), stats.gram("key_pre", g))
        order = torch.argsort(energy, descending=True)
        # Each stored dim carries half its pair's energy, so squares sum to the pair's energy^2.
        per_dim = (energy[order] / 2**0.5).repeat_interleave(2)
        orders.append(order)
        spectra.append(per_dim)
    return torch.stack(orders), torch.stack(spectra)


def post_rope_maps(
    objective: str, stats: LayerStatistics, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per KV head, the query and key maps [n_kv, d, d] applied after RoPE, and their spectrum [n_kv, d].

    Without RoPE (folded) the same maps fold into W_Q/W_K; post-RoPE Grams equal pre-RoPE ones there.
    """
    q_maps, k_maps, spectra = [], [], []
    for g in range(num_kv_heads):
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
    return torch.stack(q_maps), torch.stack(k_maps), torch.stack(spectra)


def latent_key_basis(
    objective: str, stats: LayerStatistics, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per KV head, the down-projection [n_kv, d, d] to the pre-RoPE key latent, its up-projection and spectrum."""
    downs, ups, spectra = [], [], []
    for g in range(num_kv_heads):
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
    return torch.stack(downs), torch.stack(ups), torch.stack(spectra)
