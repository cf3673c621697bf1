"""Offline measurements for token-adaptive dims (ZDC §5.2): token importance per layer, the layers that share
important-token sets (layer groups), and how many important tokens each layer needs (g_l by depth).

Everything here reads the ORIGINAL model's attention: `record_attention_evidence` runs one forward with an eager
attention function that also keeps, per layer, each token's

- received attention: summed over heads and over every later query (itself included);
- aged received attention: the same, over only the queries that read it beyond a recent window of W tokens
  (query t reads key j at full rank when t - j <= W, as kvrewrite.runtime.tiers does);
- log softmax denominator: ZDC's score, log sum_h sum_{k <= t} exp(s_k^h) with s the scaled logits of the token
  as a query (the log is monotone, so it ranks tokens like the denominator itself and cannot overflow).

The rest are pure functions on those tensors: important-token masks at a share g (globally or per pool of tokens,
as the tiers classify), the repetition ratio |S_i ∩ S_j| / |S_i| between layers, ZDC's offline grouping of
contiguous layers whose sets repeat above a threshold, and the smallest share of tokens holding a given fraction
of the attention mass.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface

from kvrewrite.errors import InvalidArgumentError

MEASURE_ATTENTION = "kvrewrite_measure"


@dataclass
class AttentionEvidence:
    """Per layer and token, tensors [L, B, T] (float64): see the module docstring."""

    received: torch.Tensor
    aged_received: torch.Tensor
    log_denominator: torch.Tensor
    window: int

    @property
    def length(self) -> int:
        return self.received.shape[-1]

    def mean_received(self) -> torch.Tensor:
        """Accumulated attention as a mean over the queries that read the token (t >= j), summed over heads."""
        readers = torch.arange(self.length, 0, -1, dtype=self.received.dtype, device=self.received.device)
        return self.received / readers

    def mean_aged_received(self) -> torch.Tensor:
        """Aged attention as a mean over the queries that read the token beyond the window (t - j > W); 0 where
        no query does."""
        readers = (torch.arange(self.length, 0, -1, device=self.received.device) - 1 - self.window).clamp(min=0)
        return torch.where(
            readers > 0,
            self.aged_received / readers.clamp(min=1).to(self.received.dtype),
            torch.zeros_like(self.aged_received),
        )


_records: dict[int, dict[str, torch.Tensor]] | None = None
_window = 0


def _measure_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers' eager attention, with the evidence of one full-sequence forward (no cache) recorded."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        logits = logits + attention_mask
    probs = nn.functional.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    if _records is not None:
        q_len, k_len = logits.shape[-2:]
        if q_len != k_len:
            raise InvalidArgumentError("attention evidence needs one forward over the whole sequence, without a cache")
        p = probs.double()
        t = torch.arange(q_len, device=p.device)
        aged = (t[:, None] - t[None, :]) > _window  # [query, key]: key read beyond the window
        _records[module.layer_idx] = {
            "received": p.sum(dim=(1, 2)),
            "aged_received": (p * aged).sum(dim=(1, 2)),
            "log_denominator": torch.logsumexp(logits.double(), dim=-1).logsumexp(dim=1),
        }
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


def _register() -> None:
    AttentionInterface.register(MEASURE_ATTENTION, _measure_attention)
    AttentionMaskInterface.register(MEASURE_ATTENTION, eager_mask)


@contextmanager
def measuring_attention(model: nn.Module, window: int) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """Within the block, `model` (a transformers decoder with the attention-function interface) runs eager
    attention and records each layer's evidence into the yielded dict (layer index -> tensors [B, T])."""
    global _records, _window
    _register()
    config = model.config
    before = config._attn_implementation
    _records, _window = {}, window
    config._attn_implementation = MEASURE_ATTENTION
    try:
        yield _records
    finally:
        config._attn_implementation = before
        _records = None


def record_attention_evidence(model: nn.Module, input_ids: torch.Tensor, window: int) -> AttentionEvidence:
    """One forward over `input_ids` [B, T] (no padding); per layer, the evidence described in the module docstring."""
    if window < 0:
        raise InvalidArgumentError(f"recent window must be >= 0, got {window}")
    with measuring_attention(model, window) as records, torch.no_grad():
        model(input_ids, use_cache=False)
        layers = [records[i] for i in sorted(records)]
    if len(layers) != model.config.num_hidden_layers:
        raise InvalidArgumentError(f"recorded {len(layers)} attention layers of {model.config.num_hidden_layers}")
    stack = {name: torch.stack([layer[name] for layer in layers]) for name in layers[0]}
    return AttentionEvidence(window=window, **stack)


def important_mask(scores: torch.Tensor, share: float, pool: int | None = None) -> torch.Tensor:
    """Bool mask [..., N]: the share of tokens with the highest score, over all N (pool=None) or per pool of `pool`
    consecutive tokens (round(share * pool) per pool, as kvrewrite.runtime.tiers classifies; N a multiple of pool)."""
    if not 0 <= share <= 1:
        raise InvalidArgumentError(f"share must be in [0, 1], got {share}")
    n = scores.shape[-1]
    if pool is None:
        view, k = scores[..., None, :], round(share * n)
    else:
        if pool < 1 or n % pool:
            raise InvalidArgumentError(f"{n} tokens do not split into pools of {pool}")
        view, k = scores.reshape(*scores.shape[:-1], n // pool, pool), round(share * pool)
    mask = torch.zeros_like(view, dtype=torch.bool)
    if k:
        mask.scatter_(-1, view.topk(k, dim=-1).indices, True)
    return mask.reshape(scores.shape)


def repetition_matrix(masks: torch.Tensor) -> torch.Tensor:
    """Repetition ratio R[i, j] = |S_i ∩ S_j| / |S_i| between the layers' token sets, masks [n, L, N] (n samples
    pooled: sums of intersections over sums of set sizes). float64 [L, L]."""
    m = masks.double()
    inter = torch.einsum("sin,sjn->ij", m, m)
    sizes = m.sum(dim=(0, 2))
    return inter / sizes.clamp(min=1)[:, None]


def greedy_layer_groups(ratios: Sequence[torch.Tensor], threshold: float) -> list[list[int]]:
    """ZDC's offline grouping: contiguous layers, each group started by its first layer f; layer j joins while
    every matrix R has R[f, j] >= threshold (ZDC: the important AND the unimportant sets repeat, > 95%)."""
    n = ratios[0].shape[0]
    groups = [[0]] if n else []
    for j in range(1, n):
        first = groups[-1][0]
        if all(float(r[first, j]) >= threshold for r in ratios):
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


def group_ratio(ratio: torch.Tensor, group: Sequence[int]) -> float | None:
    """Mean repetition ratio of a group's later layers to its first (the layer whose sets they would reuse);
    None for a group of one layer."""
    if len(group) < 2:
        return None
    return float(torch.stack([ratio[group[0], j] for j in group[1:]]).mean())


def mass_share(mass: torch.Tensor, fraction: float, pool: int | None = None) -> torch.Tensor:
    """Smallest share of tokens whose mass holds `fraction` of the total, for mass [..., N] (non-negative): over
    all N (pool=None) or per pool of `pool` tokens, averaged over the pools. Returns [...]."""
    if not 0 < fraction <= 1:
        raise InvalidArgumentError(f"fraction must be in (0, 1], got {fraction}")
    n = mass.shape[-1]
    if pool is None:
        view = mass[..., None, :]
    else:
        if pool < 1 or n % pool:
            raise InvalidArgumentError(f"{n} tokens do not split into pools of {pool}")
        view = mass.reshape(*mass.shape[:-1], n // pool, pool)
    ordered = view.double().sort(dim=-1, descending=True).values
    cum = ordered.cumsum(dim=-1)
    need = fraction * cum[..., -1:]
    # tokens needed = 1 + count of prefixes still short of the target (a tiny tolerance for float sums)
    count = (cum < need * (1 - 1e-12)).sum(dim=-1) + 1
    share = count.clamp(max=view.shape[-1]).double() / view.shape[-1]
    return share.mean(dim=-1)


def scale_to_mean(values: Sequence[float], mean: float, low: float = 0.0, high: float = 1.0) -> list[float]:
    """Per-layer shares proportional to `values`, averaging `mean`, clipped to [low, high] (rescaled after clipping
    until it settles, so the mean holds where the clip allows)."""
    v = torch.tensor(list(values), dtype=torch.float64)
    if v.numel() == 0:
        return []
    if float(v.mean()) <= 0:
        raise InvalidArgumentError("values have no positive mean to scale")
    for _ in range(200):
        v = (v * (mean / v.mean())).clamp(low, high)
    return [float(x) for x in v]


def linear_ramp(values: Sequence[float], mean: float, low: float = 0.0, high: float = 1.0) -> list[float]:
    """A per-layer g_l ramp: the least-squares line through `values` (one per layer), scaled to average `mean`
    and clipped to [low, high] (see scale_to_mean)."""
    y = torch.tensor(list(values), dtype=torch.float64)
    n = y.numel()
    if n == 0:
        return []
    x = torch.arange(n, dtype=torch.float64)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()) if n > 1 else 0.0
    return scale_to_mean(y.mean() + slope * (x - x.mean()), mean, low, high)
