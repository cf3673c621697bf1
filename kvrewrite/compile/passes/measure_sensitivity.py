"""Pass (sensitivity allocation only): how much each layer's key and value side matters, end to end.

Layers differ in sensitivity by orders of magnitude, so one unit of the objective's relative error
does not cost the same everywhere. For every (layer, side) we truncate that side alone, to the
uniform rank of each probe rate (`Plan.probe_rates`, default 0.5), and measure the KL divergence of the
next-token distribution against the original on calibration text. Each probe gives a point (relative
error the allocator predicts, measured KL); curve_allocation turns the points into a KL curve per
(layer, side), so the greedy allocator trades measured KL, not raw error.
"""

from __future__ import annotations

import torch

from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.probes import probe_kls
from kvrewrite.compile.rewrite_spec import build_spec
from kvrewrite.key_modes import key_mode
from kvrewrite.spec import full_key_ranks

PROBE_TOKENS = 256
# Fixed probe rates, not the target: the curves (and so the whole rate table) are then a function of
# the statistics alone, and slicing rate q from a checkpoint equals compiling for q directly.


def probe_rank(head_dim: int, rate: float, step: int) -> int:
    return max(step, step * round((1 - rate) * head_dim / step))


def relative_error(spectra: torch.Tensor, rank: int) -> float:
    """Mean over heads of the removed share of squared singular values at `rank`."""
    s2 = spectra.double() ** 2
    return float((s2[:, rank:].sum(-1) / s2.sum(-1).clamp_min(1e-300)).mean())


class MeasureSensitivity:
    name = "measure_sensitivity"
    description = "measure each layer's key/value KL sensitivity to truncation (only for --allocation sensitivity)"

    produces = ("sensitivity_curves", "sensitivity", "report.sensitivity")

    def run(self, ctx: CompileContext) -> dict:
        if ctx.plan.allocation != "sensitivity":
            return {}
        plan, geo, d = ctx.plan, ctx.geometry, ctx.geometry.head_dim
        n_kv = geo.num_key_value_heads
        full_values = [[d] * n_kv for _ in range(geo.num_layers)]
        full_keys = [full_key_ranks(t.key.mode, n_kv, d) for t in ctx.transforms]
        spec = build_spec(ctx, full_keys, full_values)
        # The full-rank rewrite, folded layer by layer as the probes run (fold_weights makes the checkpoint's own).
        folded = FoldedWeights(ctx.source, ctx.transforms, geo)
        tokens = ctx.calibration_tokens[: plan.probe_windows, :PROBE_TOKENS]
        rates = plan.probe_rates
        # Every (layer, side, rate) probe: (key ranks, value ranks) of that layer, all others at full rank.
        layer_probes, meta = [], {}
        for idx, transforms in enumerate(ctx.transforms):
            mode = key_mode(transforms.key.mode)
            key_step = mode.rank_step
            probes_here = {}
            for side, spectra, step in (
                ("key", transforms.key.spectrum, key_step),
                ("value", transforms.value.spectrum, 1),
            ):
                for rate in rates:
                    r = probe_rank(d, rate, step)
                    # crosshead: one shared key block, truncated to the same number of kept key dims in all.
                    keep = mode.uniform_key_ranks(r, n_kv) if side == "key" else [r] * n_kv
                    probes_here[f"{side}@{rate}"] = (
                        (keep, full_values[idx]) if side == "key" else (full_keys[idx], keep)
                    )
                    # Kept dims per row of the spectra (a crosshead spectrum is one row of n_kv * d values).
                    meta[(idx, f"{side}@{rate}")] = (
                        side,
                        rate,
                        r,
                        relative_error(spectra, sum(keep) // spectra.shape[0]),
                    )
            layer_probes.append(probes_here)
        kls = probe_kls(
            ctx.source.streamed(plan.compute_dtype(ctx.config), plan.device),
            folded.streamed(spec, plan.compute_dtype(ctx.config), plan.device),
            layer_probes,
            tokens,
            plan.progress,
        )
        curves, probes = {}, {}
        for (idx, name), (side, rate, r, predicted) in meta.items():  # in probe-rate order per (layer, side)
            kl = kls[(idx, name)]
            curves.setdefault((idx, side), []).append((predicted, kl))
            probes.setdefault(f"{idx}.{side}", []).append(
                {"rate": rate, "rank": r, "kl": kl, "predicted_relative_error": predicted}
            )
        # One weight per layer side (KL per unit of predicted error at the middle probe, mean-normalised), for
        # the report and for passes that weigh layer sides (the tada codec's bit search).
        slopes = {key: pts[len(pts) // 2][1] / max(pts[len(pts) // 2][0], 1e-12) for key, pts in curves.items()}
        mean = sum(slopes.values()) / len(slopes)
        sensitivity = {key: w / mean for key, w in slopes.items()}
        return {
            "sensitivity_curves": curves,
            "sensitivity": sensitivity,
            "report.sensitivity": {
                "probe_rates": list(rates),
                "probe_tokens": int(tokens.numel()),
                "probes": probes,
                "weights": {f"{l}.{s}": w for (l, s), w in sensitivity.items()},
            },
        }
