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
import torch.nn.functional as F

from kvrewrite.compressed_model import build_compressed_model
from kvrewrite.passes.context import CompileContext
from kvrewrite.passes.fold_weights import build_spec, folded_state_dict
from kvrewrite.progress import progress_bar
from kvrewrite.spec import KEY_MODE_CROSSHEAD, KEY_MODE_FREQ, full_key_ranks

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

    def run(self, ctx: CompileContext) -> None:
        if ctx.plan.allocation != "sensitivity":
            return
        geo, d = ctx.geometry, ctx.geometry.head_dim
        full_values = [[d] * geo.num_key_value_heads for _ in range(geo.num_layers)]
        full_keys = [full_key_ranks(t.key.mode, geo.num_key_value_heads, d) for t in ctx.transforms]
        spec = build_spec(ctx, full_keys, full_values)
        # Rank-independent, so FoldWeights reuses it instead of folding again.
        ctx.folded_state_dict = folded_state_dict(ctx.model, ctx.adapter, ctx.transforms, geo)
        model = build_compressed_model(ctx.model.config, spec, ctx.folded_state_dict)
        tokens = ctx.calibration_tokens[: ctx.plan.probe_windows, :PROBE_TOKENS]
        rates = ctx.plan.probe_rates
        with torch.inference_mode():
            reference = F.log_softmax(ctx.model(input_ids=tokens, use_cache=False).logits.float(), dim=-1)

            def kl_now() -> float:
                logp = F.log_softmax(model(input_ids=tokens, use_cache=False).logits.float(), dim=-1)
                return float((reference.exp() * (reference - logp)).sum(-1).mean())

            curves, probes = {}, {}
            layers = ctx.adapter.decoder_layers(model)
            with progress_bar("measuring sensitivity", 2 * len(layers) * len(rates), ctx.plan.progress) as bar:
                for idx, (layer, transforms) in enumerate(zip(layers, ctx.transforms)):
                    attn = ctx.adapter.attention(layer)
                    key_step = 2 if transforms.key.mode in (KEY_MODE_FREQ, KEY_MODE_CROSSHEAD) else 1
                    for side, spectra, step in (("key", transforms.key.spectrum, key_step), ("value", transforms.value.spectrum, 1)):
                        points = []
                        for rate in rates:
                            r = probe_rank(d, rate, step)
                            keep = [r] * geo.num_key_value_heads
                            if side == "key" and transforms.key.mode == KEY_MODE_CROSSHEAD:
                                keep = [r * geo.num_key_value_heads] + [0] * (geo.num_key_value_heads - 1)
                            full_k, full_v = full_keys[idx], full_values[idx]
                            attn.probe_ranks = (keep, full_v) if side == "key" else (full_k, keep)
                            kl = kl_now()
                            attn.probe_ranks = None
                            predicted = relative_error(spectra, sum(keep) // spectra.shape[0])
                            points.append((predicted, kl))
                            probes.setdefault(f"{idx}.{side}", []).append({"rate": rate, "rank": r, "kl": kl, "predicted_relative_error": predicted})
                            bar.advance()
                        curves[(idx, side)] = points
        ctx.sensitivity_curves = curves
        # One weight per layer side (KL per unit of predicted error at the middle probe, mean-normalised), for
        # the report and for passes that weigh layer sides (the tada codec's bit search).
        slopes = {key: pts[len(pts) // 2][1] / max(pts[len(pts) // 2][0], 1e-12) for key, pts in curves.items()}
        mean = sum(slopes.values()) / len(slopes)
        ctx.sensitivity = {key: w / mean for key, w in slopes.items()}
        ctx.report["sensitivity"] = {"probe_rates": list(rates), "probe_tokens": int(tokens.numel()), "probes": probes,
                                     "weights": {f"{l}.{s}": w for (l, s), w in ctx.sensitivity.items()}}
