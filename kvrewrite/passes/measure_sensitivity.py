"""Pass (sensitivity allocation only): how much each layer's key and value side matters, end to end.

Layers differ in sensitivity by orders of magnitude, so one unit of the objective's relative error
does not cost the same everywhere. For every (layer, side) we truncate that side alone, to the
uniform rank of a fixed probe rate (0.5), and measure the KL divergence of the next-token distribution against
the original on calibration text. The weight of the (layer, side) is then that KL divided by the
relative error the allocator predicts for the probe, so the greedy allocator trades KL, not raw error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrewrite.compressed_model import build_compressed_model
from kvrewrite.passes.context import CompileContext
from kvrewrite.passes.fold_weights import build_spec, folded_state_dict
from kvrewrite.progress import progress_bar
from kvrewrite.spec import KEY_MODE_FREQ

PROBE_WINDOWS = 2
PROBE_TOKENS = 256
# One fixed probe rate, not the target: the weights (and so the whole rate table) are then a function of
# the statistics alone, and slicing rate q from a checkpoint equals compiling for q directly.
PROBE_RATE = 0.5


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
        full = [[d] * geo.num_key_value_heads for _ in range(geo.num_layers)]
        spec = build_spec(ctx, full, full)
        # Rank-independent, so FoldWeights reuses it instead of folding again.
        ctx.folded_state_dict = folded_state_dict(ctx.model, ctx.adapter, ctx.transforms, geo)
        model = build_compressed_model(ctx.model.config, spec, ctx.folded_state_dict)
        tokens = ctx.calibration_tokens[:PROBE_WINDOWS, :PROBE_TOKENS]
        rate = PROBE_RATE
        with torch.inference_mode():
            reference = F.log_softmax(ctx.model(input_ids=tokens, use_cache=False).logits.float(), dim=-1)

            def kl_now() -> float:
                logp = F.log_softmax(model(input_ids=tokens, use_cache=False).logits.float(), dim=-1)
                return float((reference.exp() * (reference - logp)).sum(-1).mean())

            weights, probes = {}, {}
            layers = ctx.adapter.decoder_layers(model)
            with progress_bar("measuring sensitivity", 2 * len(layers), ctx.plan.progress) as bar:
                for idx, (layer, transforms) in enumerate(zip(layers, ctx.transforms)):
                    attn = ctx.adapter.attention(layer)
                    key_step = 2 if transforms.key.mode == KEY_MODE_FREQ else 1
                    for side, spectra, step in (("key", transforms.key.spectrum, key_step), ("value", transforms.value.spectrum, 1)):
                        r = probe_rank(d, rate, step)
                        keep = [r] * geo.num_key_value_heads
                        attn.probe_ranks = (keep, [d] * len(keep)) if side == "key" else ([d] * len(keep), keep)
                        kl = kl_now()
                        attn.probe_ranks = None
                        predicted = relative_error(spectra, r)
                        probes[f"{idx}.{side}"] = {"rank": r, "kl": kl, "predicted_relative_error": predicted}
                        weights[(idx, side)] = kl / max(predicted, 1e-12)
                        bar.advance()
        mean = sum(weights.values()) / len(weights)
        ctx.sensitivity = {key: w / mean for key, w in weights.items()}
        ctx.report["sensitivity"] = {"probe_rate": rate, "probe_tokens": int(tokens.numel()), "probes": probes,
                                     "weights": {f"{l}.{s}": w for (l, s), w in ctx.sensitivity.items()}}
