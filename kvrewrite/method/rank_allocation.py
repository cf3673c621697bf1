"""Choosing a rank for every (layer, KV head, side) so the whole cache keeps (1 - p) of its elements.

- eps (ZACK §5.2, Eq. 6): one singular-value removal rate eps shared by all heads and layers; each
  head keeps the smallest rank whose removed share of (plain, unsquared) singular values is <= eps;
  eps is searched to hit the overall rate.
- greedy: remove, across all heads, the tail chunks with the smallest error in the objective's own
  metric (removed squared singular values, relative to the head's total), until the rate is met.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvrewrite.errors import InvalidArgumentError


@dataclass
class RankItem:
    layer: int
    head: int
    side: str  # "key" | "value"
    spectrum: np.ndarray  # descending singular values, length d
    step: int = 1  # ranks move in steps of this many dims (2 for whole rotary pairs)
    weight: float = 1.0  # sensitivity weight on this item's error (greedy)


@dataclass
class RankAllocation:
    ranks: dict[tuple[int, int, str], int]
    kept: int
    total: int
    eps: float | None = None

    @property
    def rate(self) -> float:
        return 1.0 - self.kept / self.total

    def as_lists(self, num_layers: int, num_kv_heads: int) -> tuple[list[list[int]], list[list[int]]]:
        # A crosshead layer has one shared key item (head 0): its other KV heads hold no key dims.
        key = [[self.ranks.get((l, g, "key"), 0) for g in range(num_kv_heads)] for l in range(num_layers)]
        value = [[self.ranks[(l, g, "value")] for g in range(num_kv_heads)] for l in range(num_layers)]
        return key, value


def _unit(item: RankItem, rank_multiple: int) -> int:
    return item.step * rank_multiple // math.gcd(item.step, rank_multiple)


def _floor(item: RankItem, min_rank: int, unit: int) -> int:
    return min(len(item.spectrum), unit * math.ceil(min_rank / unit))


def _target_kept(total: int, rate: float) -> int:
    return int(round((1.0 - rate) * total))


def allocate_eps(items: list[RankItem], rate: float, *, min_rank: int = 0, rank_multiple: int = 1) -> RankAllocation:
    total = sum(len(it.spectrum) for it in items)
    target = _target_kept(total, rate)
    prepared = []
    for it in items:
        s = np.clip(np.asarray(it.spectrum, dtype=np.float64), 0, None)
        d, unit = len(s), _unit(it, rank_multiple)
        # removed[r] = share of singular values removed when keeping the first r dims.
        tail = np.concatenate([np.cumsum(s[::-1])[::-1], [0.0]])
        removed = tail / max(tail[0], 1e-300)
        candidates = [r for r in range(0, d + 1, unit)] + ([d] if d % unit else [])
        candidates = [r for r in candidates if r >= _floor(it, min_rank, unit)]
        prepared.append((it, np.array(candidates), removed[np.array(candidates)]))

    def ranks_at(eps: float) -> dict:
        out = {}
        for it, cands, rem in prepared:
            ok = np.nonzero(rem <= eps + 1e-15)[0]
            out[(it.layer, it.head, it.side)] = int(cands[ok[0]]) if len(ok) else int(cands[-1])
        return out

    lo, hi = 0.0, 1.0  # kept(eps) is non-increasing; find the smallest eps with kept <= target
    if sum(ranks_at(hi).values()) > target:
        raise InvalidArgumentError(
            f"rate {rate} cannot be reached with `min_rank={min_rank}`: the floor alone keeps "
            f"{sum(ranks_at(hi).values())} of {total} elements"
        )
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if sum(ranks_at(mid).values()) <= target:
            hi = mid
        else:
            lo = mid
    ranks = ranks_at(hi)
    return RankAllocation(ranks=ranks, kept=sum(ranks.values()), total=total, eps=hi)


def greedy_removal_order(
    items: list[RankItem], *, min_rank: int = 0, rank_multiple: int = 1
) -> list[tuple[tuple, int, float]]:
    """Every removable tail chunk as (item key, dims, cost), cheapest first; prefix order is kept per item."""
    chunks = []
    for it in items:
        s2 = np.asarray(it.spectrum, dtype=np.float64) ** 2
        norm = max(s2.sum(), 1e-300)
        d, unit = len(s2), _unit(it, rank_multiple)
        floor = _floor(it, min_rank, unit)
        # Chunk boundaries from the tail: d, then the largest multiple of unit below it, and so on.
        bounds = [d] + list(range(unit * ((d - 1) // unit), floor - 1, -unit))
        bounds = [b for b in bounds if b >= floor]
        cumulative = 0.0
        for hi, lo in zip(bounds, bounds[1:]):
            cost = it.weight * s2[lo:hi].sum() / norm
            # Costs along one item's tail are non-decreasing, so sorting by the cumulative cost
            # keeps each item's chunks in tail-first order.
            cumulative = max(cumulative, cost)
            chunks.append(((it.layer, it.head, it.side), hi - lo, cumulative, -hi))
    chunks.sort(key=lambda c: (c[2], c[3]))
    return [(key, dims, cost) for key, dims, cost, _ in chunks]


def allocate_greedy(
    items: list[RankItem], rate: float, *, min_rank: int = 0, rank_multiple: int = 1, order=None
) -> RankAllocation:
    total = sum(len(it.spectrum) for it in items)
    target = _target_kept(total, rate)
    ranks = {(it.layer, it.head, it.side): len(it.spectrum) for it in items}
    kept = total
    for key, dims, _cost in (
        order if order is not None else greedy_removal_order(items, min_rank=min_rank, rank_multiple=rank_multiple)
    ):
        if kept <= target:
            break
        ranks[key] -= dims
        kept -= dims
    if kept > target and rate > 0:
        raise InvalidArgumentError(
            f"rate {rate} cannot be reached with `min_rank={min_rank}`: at most {1 - kept / total:.3f} can be removed"
        )
    return RankAllocation(ranks=ranks, kept=kept, total=total)


def allocate_uniform(
    items: list[RankItem], rate: float, *, min_rank: int = 0, rank_multiple: int = 1
) -> RankAllocation:
    """The same rank for every head and side (the baseline the adaptive allocators must beat)."""
    total = sum(len(it.spectrum) for it in items)
    target = _target_kept(total, rate)
    units = [_unit(it, rank_multiple) for it in items]
    share = target / len(items)
    ranks = {}
    for it, unit in zip(items, units):
        r = max(_floor(it, min_rank, unit), unit * int(share // unit))
        ranks[(it.layer, it.head, it.side)] = min(r, len(it.spectrum))
    kept = sum(ranks.values())
    # Hand out what rounding left over, one unit at a time, while it still fits the target.
    for it, unit in zip(items, units):
        key = (it.layer, it.head, it.side)
        if kept + unit <= target and ranks[key] + unit <= len(it.spectrum):
            ranks[key] += unit
            kept += unit
    if kept > target and rate > 0:
        raise InvalidArgumentError(f"rate {rate} cannot be reached with `min_rank={min_rank}`")
    return RankAllocation(ranks=ranks, kept=kept, total=total)


def allocate(
    items: list[RankItem], rate: float, method: str, *, min_rank: int = 0, rank_multiple: int = 1
) -> RankAllocation:
    """eps (ZACK Eq. 6), greedy (objective error), sensitivity (greedy on KL-weighted error), uniform."""
    if method == "eps":
        return allocate_eps(items, rate, min_rank=min_rank, rank_multiple=rank_multiple)
    if method in ("greedy", "sensitivity"):
        # The sensitivity weights ride on the items (RankItem.weight); the search itself is the same.
        return allocate_greedy(items, rate, min_rank=min_rank, rank_multiple=rank_multiple)
    if method == "uniform":
        return allocate_uniform(items, rate, min_rank=min_rank, rank_multiple=rank_multiple)
    raise InvalidArgumentError(f"unknown allocation {method!r}; choose eps, greedy, sensitivity or uniform")
