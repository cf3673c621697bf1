"""`export-mla --refit output|output-local`: least-squares refit of every o_proj of the MLA form at its exported widths.

The same closed-form fix as `compress --refit` (method/output_refit.py), applied to the MLA form: layer by layer over
calibration windows, each o_proj is refitted to map what the MLA attention feeds it (every query head's value read
out of the shared latent) onto the original attention's output, so later layers are fitted on the activations of the
already refitted earlier ones. It fixes what the per-layer latent objective cannot see: the attention probabilities
the approximated keys change (the dropped rotation, the narrow latent), and the drift of the inputs. The shapes do not
change; nothing is added at run time. The fit is for the exported widths, so a refitted export serves those alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvrewrite.compile.mla.form import latent_norm_inputs, mla_reference_model
from kvrewrite.compile.on_device import whole_model_on
from kvrewrite.method.mla import MLALayer
from kvrewrite.method.output_refit import RefitLayerReport, refit_output_projections, refit_windows
from kvrewrite.progress import progress_bar

# --refit choice -> refit_output_projections' target (as `compress --refit`).
REFIT_TARGETS = {"output": "model", "output-local": "layer"}


@dataclass(frozen=True)
class MLARefitResult:
    layers: list[MLALayer]  # the form with refitted o_proj (every other weight as it was)
    method: str  # the --refit choice
    tokens: int  # calibration tokens the least squares read
    ridge: float
    reports: list[RefitLayerReport]  # per layer: ||z W^T - t|| / ||t|| before and after
    # per layer, for the latent-norm bound: max(original's, refitted form's) ||x||^2; None when not measured
    max_square_norms: list[float] | None

    def provenance(self) -> dict:
        return {
            "method": self.method,
            "target": REFIT_TARGETS[self.method],
            "tokens": self.tokens,
            "ridge": self.ridge,
            "layer_relative_error_before": [round(r.relative_error_before, 5) for r in self.reports],
            "layer_relative_error_after": [round(r.relative_error_after, 5) for r in self.reports],
        }


def refit_mla_output(
    prepared,
    layers: list[MLALayer],
    method: str,
    tokens: int,
    ridge: float,
    progress: bool = False,
    measure_inputs: bool = True,
) -> MLARefitResult:
    """The MLA form `layers` of prepared.ctx's source with every o_proj refitted on the first `tokens` calibration
    tokens (whole windows, at least one), all run as one batch (memory: one layer's activations of them).

    The refitted o_proj change every later layer's input, so the latent-norm bound then reads the larger of the
    original's and the refitted form's largest attention input on the calibration windows (as --distill does).
    measure_inputs=False skips that pass (a --distill that follows measures its own trained form)."""
    ctx = prepared.ctx
    device = ctx.plan.device
    windows = refit_windows(ctx.calibration_tokens, tokens)
    with whole_model_on(ctx.original_model(), device) as original:
        model = mla_reference_model(original, layers)  # on the compile device, as the original is
        with progress_bar(f"o_proj refit ({method}), layer by layer", ctx.geometry.num_layers, progress) as bar:
            reports = refit_output_projections(
                model, original, ctx.adapter, windows, ridge=ridge, target=REFIT_TARGETS[method], on_layer=bar.advance
            )
    # Only o_proj changed; the other weights keep their float64 values rather than the model's copies.
    refitted = [
        replace(
            layer,
            o_proj=ctx.adapter.output_projection(ctx.adapter.attention(decoder_layer))
            .weight.detach()
            .to("cpu", torch.float64)
            .clone(),
        )
        for layer, decoder_layer in zip(layers, ctx.adapter.decoder_layers(model))
    ]
    norms = None
    if measure_inputs:
        norms = latent_norm_inputs(prepared, model, ctx.calibration_tokens.to(device), progress)[0]
    return MLARefitResult(refitted, method, int(windows.numel()), ridge, reports, norms)
