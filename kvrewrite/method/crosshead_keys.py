"""Cross-head RoPE-commuting key mode (beyond the papers; docs/method.md, "Key side").

Under HF's rotate_half, dims (j, j + d/2) of a head form rotary pair j. Read as one complex number
z = k[j] + i k[j + d/2], RoPE multiplies it by e^{i theta_j t}: the same scalar for pair j of EVERY head.
So for each frequency j, any complex-linear map of the vector x_j = (z_{g,j})_g in C^{n_kv} (the pair j
of all KV heads of the layer) commutes with RoPE, and folds exactly into k_proj; the query side gets
the dual map per query head (a complex scalar per latent component), folded into q_proj. The layer
caches one shared key block whose stored pairs are rotated with their own frequency, like freq mode.

Objective (query-aware, phase-averaged): RoPE turns the relative phase between q and k uniformly
over positions, so the expected squared score error of pair j is proportional to
sum_g w_{g,j} E|e_{g,j}|^2, with w_{g,j} = E|q_{h,j}|^2 summed over the query heads of group g and
e the reconstruction error of the keys. Per frequency that is a weighted low-rank problem in C^{n_kv}:
minimise E||(x - x D_r U_r) W^{1/2}||^2 with C = E[x^H x] (rows x): C^{1/2} W^{1/2} = U S Z^H,
D = C^{-1/2} U, U_up = U^H C^{1/2} (the complex twin of linalg.whitened_projection). Its squared
singular values are in the same units as freq mode's pair energies, and the components of all
frequencies are ranked together, so keeping the first R stored dims keeps the best R/2 components.

Storage: stored pair m = component l of frequency j = freq_order[m]; k rows (Re c, Im c) of
c = sum_g z_{g,j} D[g, l]; query head h in group g gets rows (Re, Im) of z_{h,j} conj(U_up[l, g]), so
Re(conj(q_c) c) summed over all components equals q.k at full rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.adapters.base import AttentionGeometry
from kvrewrite.method.linalg import RIDGE
from kvrewrite.method.statistics import LayerStatistics


@dataclass
class CrossheadMaps:
    freq_order: torch.Tensor  # [n_kv * d/2] frequency of every stored pair, most important first
    spectrum: torch.Tensor  # [n_kv * d] per stored real dim (component singular value / sqrt 2, twice)
    k_fold: torch.Tensor  # [n_kv * d, n_kv * d]: new k_proj rows = k_fold @ old k_proj rows
    q_fold: torch.Tensor  # [n_q, n_kv * d, d]: new rows of query head h = q_fold[h] @ old rows of head h


def _hermitian_roots(gram: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(regularised root, its inverse, unregularised root) of a Hermitian PSD matrix."""
    gram = 0.5 * (gram + gram.conj().T)
    n = gram.shape[0]
    scale = gram.diagonal().real.sum().clamp_min(1e-300) / n
    evals, evecs = torch.linalg.eigh(gram + ridge * scale * torch.eye(n, dtype=gram.dtype))
    evals = evals.clamp_min(torch.finfo(torch.float64).tiny)
    root = (evecs * evals.sqrt().to(gram.dtype)) @ evecs.conj().T
    inv_root = (evecs * evals.rsqrt().to(gram.dtype)) @ evecs.conj().T
    raw_evals, raw_evecs = torch.linalg.eigh(gram)
    raw_root = (raw_evecs * raw_evals.clamp_min(0).sqrt().to(gram.dtype)) @ raw_evecs.conj().T
    return root, inv_root, raw_root


def frequency_key_gram(layer_key_gram: torch.Tensor, j: int, n_kv: int, d: int) -> torch.Tensor:
    """C_j = E[x^H x] for x_g = k[g*d + j] + i k[g*d + j + d/2], from the real [n_kv*d, n_kv*d] Gram."""
    half = d // 2
    a = torch.tensor([g * d + j for g in range(n_kv)])
    b = a + half
    k = layer_key_gram
    real = k[a][:, a] + k[b][:, b]
    imag = k[a][:, b] - k[b][:, a]
    return torch.complex(real, imag)


def frequency_components(stats: LayerStatistics, geometry: AttentionGeometry) -> tuple[list, list, list]:
    """Per rotary frequency j, the query-aware complex mix across KV heads: downs[j] [n_kv (head g), n_kv (component l)],
    ups[j] [component l, head g] (downs[j] @ ups[j] = I) and values[j] [n_kv], the components' singular values, descending."""
    n_kv, d, half = geometry.num_key_value_heads, geometry.head_dim, geometry.head_dim // 2
    layer_gram = stats.gram("key_pre_layer", 0).double()
    # Query power of every pair, summed over the query heads of each group: [n_kv, half].
    q_diag = torch.stack([torch.diagonal(stats.gram("query_pre", g)).double() for g in range(n_kv)])
    weights = (q_diag[:, :half] + q_diag[:, half:]).clamp_min(0)

    downs, ups, values = [], [], []
    for j in range(half):
        c = frequency_key_gram(layer_gram, j, n_kv, d)
        root, inv_root, raw_root = _hermitian_roots(c)
        w_half = torch.diag(weights[:, j].sqrt()).to(c.dtype)
        u, _, _ = torch.linalg.svd(root @ w_half)
        downs.append(inv_root @ u)  # [n_kv (head g), n_kv (component l)]
        ups.append(u.conj().T @ root)  # [n_kv (component l), n_kv (head g)]
        values.append(torch.linalg.svdvals(raw_root @ w_half))
    return downs, ups, values


def crosshead_maps(stats: LayerStatistics, geometry: AttentionGeometry) -> CrossheadMaps:
    n_kv, d, half = geometry.num_key_value_heads, geometry.head_dim, geometry.head_dim // 2
    downs, ups, values = frequency_components(stats, geometry)

    # Rank every (frequency, component) of the layer together; ties keep frequency order (stable sort).
    flat = torch.stack(values).flatten()  # index = j * n_kv + l
    order = torch.sort(flat, descending=True, stable=True).indices
    freqs, comps = order // n_kv, order % n_kv
    spectrum = (flat[order] / 2**0.5).repeat_interleave(2)

    k_fold = torch.zeros(n_kv * d, n_kv * d, dtype=torch.float64)
    heads = torch.arange(n_kv)
    for m, (j, l) in enumerate(zip(freqs.tolist(), comps.tolist())):
        coeff = downs[j][:, l]  # alpha + i beta per KV head
        a_cols, b_cols = heads * d + j, heads * d + j + half
        k_fold[2 * m, a_cols], k_fold[2 * m, b_cols] = coeff.real, -coeff.imag
        k_fold[2 * m + 1, a_cols], k_fold[2 * m + 1, b_cols] = coeff.imag, coeff.real

    q_fold = torch.zeros(geometry.num_attention_heads, n_kv * d, d, dtype=torch.float64)
    for g in range(n_kv):
        for m, (j, l) in enumerate(zip(freqs.tolist(), comps.tolist())):
            coeff = ups[j][l, g].conj()  # mu + i nu
            for h in geometry.query_heads_of(g):
                q_fold[h, 2 * m, j], q_fold[h, 2 * m, j + half] = coeff.real, -coeff.imag
                q_fold[h, 2 * m + 1, j], q_fold[h, 2 * m + 1, j + half] = coeff.imag, coeff.real
    return CrossheadMaps(freq_order=freqs, spectrum=spectrum, k_fold=k_fold, q_fold=q_fold)
