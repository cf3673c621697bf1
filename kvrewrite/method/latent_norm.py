"""Neutralising DeepSeek's kv_a_layernorm: an RMSNorm on the latent that our MLA maths does not have.

RMSNorm(c') = w c' / sqrt(mean(c'^2) + eps). Scale the latent rows of kv_a_proj_with_mqa by s (c' = s c) and set
w = sqrt(eps) / s: the output is c / sqrt(1 + u) with u = s^2 mean(c^2) / eps, so the relative error is
1 - (1 + u)^(-1/2) <= u / 2. Choosing s from the largest per-token mean(c^2) seen in calibration keeps u / 2 under a
tolerance on those tokens (the error grows smoothly, linearly in mean(c^2), beyond them).

The price is tiny latent activations: rms(c') = sqrt(2 * tolerance * eps). bf16 and fp32 have fp32's exponent range
and hold them; fp16's smallest normal number (6.1e-5) does not, so fp16 is refused rather than silently subnormal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LatentNormNeutraliser:
    scale: float  # s, multiplies the latent rows of kv_a_proj_with_mqa
    norm_weight: float  # sqrt(eps) / s, every entry of kv_a_layernorm.weight
    relative_error_bound: float  # s^2 * max mean(c^2) / (2 eps) on the calibration tokens
    latent_rms: float  # sqrt(s^2 * max mean(c^2)): the largest latent rms after scaling


def neutralise_latent_norm(max_mean_square: float, eps: float, tolerance: float = 1e-6) -> LatentNormNeutraliser:
    """s such that s^2 * max_mean_square / (2 eps) = tolerance."""
    max_mean_square = max(float(max_mean_square), 1e-300)
    scale = (2.0 * tolerance * eps / max_mean_square) ** 0.5
    return LatentNormNeutraliser(
        scale=scale,
        norm_weight=eps**0.5 / scale,
        relative_error_bound=tolerance,
        latent_rms=(scale**2 * max_mean_square) ** 0.5,
    )


def relative_error(mean_square: torch.Tensor, neutraliser: LatentNormNeutraliser, eps: float) -> torch.Tensor:
    """The exact relative error of the neutralised norm for tokens whose unscaled latent has this mean(c^2)."""
    u = neutraliser.scale**2 * mean_square.double() / eps
    return 1.0 - (1.0 + u).rsqrt()


def dtype_holds_latent(neutraliser: LatentNormNeutraliser, dtype: torch.dtype, headroom: float = 1e3) -> bool:
    """Whether latents of rms down to latent_rms / headroom stay normal numbers in `dtype` (fp16 does not)."""
    return neutraliser.latent_rms / headroom >= torch.finfo(dtype).tiny
