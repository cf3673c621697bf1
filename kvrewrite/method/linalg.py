"""Closed-form low-rank transforms computed from d_h x d_h Gram matrices (float64).

Every solver returns full-rank maps whose columns/rows are ordered by importance, so truncation to
rank r is a prefix slice and is optimal for every r at once (Eckart-Young), and the product of the
down and up maps is the identity at full rank (exact folding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Relative ridge added to Gram matrices before whitening: keeps the inverse square root finite for
# rank-deficient statistics (dead dims, short corpora) while changing nothing measurable.
RIDGE = 1e-6


def _sym(m: torch.Tensor) -> torch.Tensor:
    return 0.5 * (m + m.transpose(-1, -2))


def regularise(gram: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    gram = _sym(gram.double())
    d = gram.shape[-1]
    scale = torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1).clamp_min(1e-300) / d
    return gram + ridge * scale[..., None, None] * torch.eye(d, dtype=gram.dtype, device=gram.device)


def sqrt_and_inv_sqrt(gram: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root and inverse square root of a (regularised) PSD matrix."""
    evals, evecs = torch.linalg.eigh(regularise(gram, ridge))
    evals = evals.clamp_min(torch.finfo(torch.float64).tiny)
    root = (evecs * evals.sqrt()) @ evecs.T
    inv_root = (evecs * evals.rsqrt()) @ evecs.T
    return _sym(root), _sym(inv_root)


@dataclass
class LowRankPair:
    """down [d, d] maps a vector into the ordered basis; up [d, d] maps back; down @ up = I.

    spectrum [d]: the objective's singular values, descending; truncating to rank r costs
    sum(spectrum[r:] ** 2) in the objective's own metric.
    """

    down: torch.Tensor
    up: torch.Tensor
    spectrum: torch.Tensor


def principal_basis(gram: torch.Tensor) -> LowRankPair:
    """Right singular vectors of a row-stack whose Gram is `gram` (the ZACK rotation R; up = R^T)."""
    evals, evecs = torch.linalg.eigh(_sym(gram.double()))
    order = torch.argsort(evals, descending=True)
    basis = evecs[:, order]
    return LowRankPair(down=basis, up=basis.T.contiguous(), spectrum=evals[order].clamp_min(0).sqrt())


def whitened_projection(input_gram: torch.Tensor, output_map: torch.Tensor) -> LowRankPair:
    """Minimise E||x (I - down_r up_r) output_map||^2 over rank-r pairs, for every r at once.

    x has second moment `input_gram` [d, d]; output_map is [d, m] (e.g. the stacked W_O rows of a
    KV group, or the square root of a query Gram). With C^{1/2} output_map = U S Z^T:
    down = C^{-1/2} U, up = U^T C^{1/2}.
    """
    root, inv_root = sqrt_and_inv_sqrt(input_gram)
    # Only the d x d left factor is needed: with m >= d columns the thin SVD gives all of it without forming
    # the m x m right factor (m = group x hidden: 9216 for a 3B Llama, where the full SVD took 12 s per head).
    u, _, _ = torch.linalg.svd(root @ output_map.double(), full_matrices=output_map.shape[1] < root.shape[0])
    # The spectrum (which drives rank allocation) is taken without the ridge, so small tails are exact.
    s = torch.linalg.svdvals(unregularised_sqrt(input_gram) @ output_map.double())
    spectrum = torch.zeros(root.shape[0], dtype=torch.float64)
    spectrum[: s.numel()] = s
    return LowRankPair(down=inv_root @ u, up=u.T @ root, spectrum=spectrum)


def unregularised_sqrt(gram: torch.Tensor) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh(_sym(gram.double()))
    return _sym((evecs * evals.clamp_min(0).sqrt()) @ evecs.T)


@dataclass
class BilinearPair:
    """q_map, k_map [d, d]: scores q k^T become (q q_map)(k k_map)^T; exact at full rank."""

    q_map: torch.Tensor
    k_map: torch.Tensor
    spectrum: torch.Tensor


def kq_svd(query_gram: torch.Tensor, key_gram: torch.Tensor) -> BilinearPair:
    """Best rank-r approximation of the score matrix Q K^T in expectation (whitened KQ-SVD).

    With S = Q^T Q, T = K^T K and S^{1/2} T^{1/2} = U Σ W^T: q -> q S^{-1/2} U Σ^{1/2},
    k -> k T^{-1/2} W Σ^{1/2}. Balanced Σ^{1/2} keeps both sides on the same scale.
    """
    s_root, s_inv = sqrt_and_inv_sqrt(query_gram)
    t_root, t_inv = sqrt_and_inv_sqrt(key_gram)
    u, sigma, wt = torch.linalg.svd(s_root @ t_root)
    half = sigma.sqrt()
    spectrum = torch.linalg.svdvals(unregularised_sqrt(query_gram) @ unregularised_sqrt(key_gram))
    return BilinearPair(q_map=s_inv @ u * half, k_map=t_inv @ wt.T * half, spectrum=spectrum)


def psd_sqrt(gram: torch.Tensor) -> torch.Tensor:
    return unregularised_sqrt(gram)
