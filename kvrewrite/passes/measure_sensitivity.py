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

from kvrewrite.folded_weights import FoldedWeights
from kvrewrite.layer_streaming import StreamedModel
from kvrewrite.passes.context import CompileContext
from kvrewrite.passes.fold_weights import build_spec
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
        plan, geo, d = ctx.plan, ctx.geometry, ctx.geometry.head_dim
        full = [[d] * geo.num_key_value_heads for _ in range(geo.num_layers)]
        spec = build_spec(ctx, full, full)
        # Rank-independent, so FoldWeights reuses it.
        ctx.folded = FoldedWeights(ctx.source, ctx.transforms, geo)
        tokens = ctx.calibration_tokens[:PROBE_WINDOWS, :PROBE_TOKENS]
        kls = probe_kls(ctx.source.streamed(plan.compute_dtype(), plan.device),
                        ctx.folded.streamed(spec, plan.compute_dtype(), plan.device),
                        ctx.transforms, tokens, d, PROBE_RATE, plan.progress)
        weights, probes = {}, {}
        for (idx, side), (rank, kl) in kls.items():
            spectra = ctx.transforms[idx].key.spectrum if side == "key" else ctx.transforms[idx].value.spectrum
            predicted = relative_error(spectra, rank)
            probes[f"{idx}.{side}"] = {"rank": rank, "kl": kl, "predicted_relative_error": predicted}
            weights[(idx, side)] = kl / max(predicted, 1e-12)
        mean = sum(weights.values()) / len(weights)
        ctx.sensitivity = {key: w / mean for key, w in weights.items()}
        ctx.report["sensitivity"] = {"probe_rate": PROBE_RATE, "probe_tokens": int(tokens.numel()), "probes": probes,
                                     "weights": {f"{l}.{s}": w for (l, s), w in ctx.sensitivity.items()}}


def probe_kls(original: StreamedModel, rewritten: StreamedModel, transforms, tokens: torch.Tensor, head_dim: int,
              rate: float, progress: bool = True) -> dict[tuple[int, str], tuple[int, float]]:
    """(layer, side) -> (probe rank, KL of the model with only that side of that layer truncated).

    Layer-streamed: every probe is a hidden-state stream that leaves the reference stream at its layer
    (that layer's side truncated) and then runs through the rewritten layers at full rank, so all
    2 x layers probes share one pass over the weights. Cost: about layers^2 layer-forwards of the
    probe tokens; memory: 2 x layers + 1 hidden-state streams.
    """
    probes: dict[tuple[int, str], torch.Tensor] = {}
    ranks: dict[tuple[int, str], int] = {}
    with torch.inference_mode(), progress_bar("measuring sensitivity", len(transforms) + 1, progress) as bar:
        hidden = original.embed(tokens)
        inputs, rewritten_inputs = original.layer_inputs(hidden), rewritten.layer_inputs(hidden)
        for idx, layer_transforms in enumerate(transforms):
            with rewritten.layer(idx) as layer:
                for key in probes:
                    probes[key] = rewritten.run_layer(layer, probes[key], rewritten_inputs)
                key_step = 2 if layer_transforms.key.mode == KEY_MODE_FREQ else 1
                n_kv = layer_transforms.value.spectrum.shape[0]
                for side, step in (("key", key_step), ("value", 1)):
                    r = probe_rank(head_dim, rate, step)
                    keep = [r] * n_kv
                    layer.self_attn.probe_ranks = (keep, [head_dim] * n_kv) if side == "key" else ([head_dim] * n_kv, keep)
                    probes[(idx, side)] = rewritten.run_layer(layer, hidden, rewritten_inputs)
                    layer.self_attn.probe_ranks = None
                    ranks[(idx, side)] = r
            with original.layer(idx) as layer:
                hidden = original.run_layer(layer, hidden, inputs)
            bar.advance()
        reference = F.log_softmax(original.logits(hidden).float(), dim=-1)
        kls = {}
        with rewritten.output_head() as head:
            for key, stream in probes.items():
                logp = F.log_softmax(head(stream).float(), dim=-1)
                kls[key] = (ranks[key], float((reference.exp() * (reference - logp)).sum(-1).mean()))
        bar.advance()
    return kls
