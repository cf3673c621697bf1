"""Greedy rank allocation on measured KL curves (sensitivity allocation with several probe rates).

measure_sensitivity truncates each (layer, side) alone at a few uniform ranks and records, per probe,
the relative error the objective predicts (mean over the layer's KV heads) and the next-token KL
measured end to end. Through those points (and the origin) a monotone piecewise-linear curve
KL_ls(e) maps a layer-side's predicted error to its measured cost. The allocator removes, one chunk
at a time, the tail chunk whose removal raises the sum of the curves least per removed dim. With one
probe point the curve is a line through the origin and this is exactly the weighted greedy
(weight = KL / predicted error); with several points it follows the measured shape (KL usually grows
faster than linearly in the error), which a single probe at p = 0.5 extrapolates badly at other rates.

One removal order serves every rate (each rate keeps a prefix of it), so the rate table stays nested
and slicing a checkpoint to rate q equals compiling for q.
"""

from __future__ import annotations

import numpy as np

from kvrewrite.method.rank_allocation import RankItem, _floor, _unit


def monotone_curve(points: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (error, KL) knots through the origin, KL made non-decreasing (measurement noise aside)."""
    pts = sorted((float(e), float(k)) for e, k in points if e > 0)
    errors = np.array([0.0] + [e for e, _ in pts])
    kls = np.maximum.accumulate(np.array([0.0] + [max(k, 0.0) for _, k in pts]))
    return errors, kls


def curve_value(errors: np.ndarray, kls: np.ndarray, e: float) -> float:
    """Linear interpolation; beyond the last knot, extrapolate with the last segment's slope."""
    if e <= errors[-1]:
        return float(np.interp(e, errors, kls))
    if len(errors) < 2 or errors[-1] <= errors[-2]:
        return float(kls[-1])
    slope = (kls[-1] - kls[-2]) / (errors[-1] - errors[-2])
    return float(kls[-1] + slope * (e - errors[-1]))


def curve_removal_order(
    items: list[RankItem],
    curves: dict[tuple[int, str], list[tuple[float, float]]],
    *,
    min_rank: int = 0,
    rank_multiple: int = 1,
) -> list[tuple[tuple, int, float]]:
    """Every removable tail chunk as (item key, dims, marginal KL per dim), in the order the greedy removes them."""
    groups: dict[tuple[int, str], list[int]] = {}
    for idx, it in enumerate(items):
        groups.setdefault((it.layer, it.side), []).append(idx)
    # Per item: the relative error removed by each successive tail chunk (tail first) and its size.
    chunk_errors, chunk_dims = [], []
    for it in items:
        s2 = np.asarray(it.spectrum, dtype=np.float64) ** 2
        norm = max(s2.sum(), 1e-300)
        d, unit = len(s2), _unit(it, rank_multiple)
        floor = _floor(it, min_rank, unit)
        bounds = [b for b in [d] + list(range(unit * ((d - 1) // unit), floor - 1, -unit)) if b >= floor]
        chunk_errors.append([s2[lo:hi].sum() / norm for hi, lo in zip(bounds, bounds[1:])])
        chunk_dims.append([hi - lo for hi, lo in zip(bounds, bounds[1:])])
    position = [0] * len(items)
    curve = {key: monotone_curve(curves[key]) for key in groups}
    level = {key: 0.0 for key in groups}  # current predicted error (mean over the group's heads)

    def best_in_group(key) -> tuple[float, int]:
        members = groups[key]
        errors, kls = curve[key]
        now = curve_value(errors, kls, level[key])
        best = (np.inf, -1)
        for idx in members:
            if position[idx] < len(chunk_errors[idx]):
                after = level[key] + chunk_errors[idx][position[idx]] / len(members)
                cost = (curve_value(errors, kls, after) - now) / chunk_dims[idx][position[idx]]
                # Ties (e.g. zero-KL curves) break towards the smaller removed error.
                best = min(best, (cost + 1e-18 * chunk_errors[idx][position[idx]], idx))
        return best

    keys = list(groups)
    candidates = np.array([best_in_group(k)[0] for k in keys])
    chosen_idx = [best_in_group(k)[1] for k in keys]
    order = []
    while np.isfinite(candidates).any():
        g = int(np.argmin(candidates))
        idx = chosen_idx[g]
        it = items[idx]
        order.append(((it.layer, it.head, it.side), chunk_dims[idx][position[idx]], float(candidates[g])))
        level[keys[g]] += chunk_errors[idx][position[idx]] / len(groups[keys[g]])
        position[idx] += 1
        candidates[g], chosen_idx[g] = best_in_group(keys[g])
    return order
