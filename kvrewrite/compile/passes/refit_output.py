"""Pass (only with --refit output / output-local): least-squares refit of every o_proj at the compiled ranks (output_refit.py).

Runs after verify (which checks the full-rank fold against the original) and before the codec fit and emit. The
refitted columns replace the prefix of each query head's o_proj block (FoldedWeights.overrides), so the checkpoint
keeps its full-rank layout; its rate table keeps only the compiled rate, which is the only one the refit is for.
"""

from __future__ import annotations

import dataclasses

from kvrewrite.compile.compiled_rank import keep_only_compiled_rate, remeasure_compiled_rank, whole_compressed_model
from kvrewrite.compile.on_device import whole_model_on
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.method.output_refit import refit_output_projections, refit_windows, scatter_refit_columns


class RefitOutput:
    name = "refit_output"
    description = "(--refit output|output-local) refit every o_proj by least squares at the compiled ranks, layer by layer, against the original attention outputs"
    produces = ("report.refit",)
    # Refinements of what fold_weights / allocate_ranks / verify set, for the weights the checkpoint will hold:
    # folded (refitted o_proj columns as overrides), spec, rate_table and report.rate_table (the compiled rate only:
    # the refit is for those ranks), verification (its compiled-rank figures re-measured with the refitted weights).
    refines = ("folded", "spec", "rate_table", "report.rate_table", "verification")

    def run(self, ctx: CompileContext) -> dict:
        plan = ctx.plan
        if plan.refit == "none":
            return {}
        geo = ctx.geometry
        windows = refit_windows(ctx.calibration_tokens, plan.refit_tokens)
        # Both models whole on the compile device (docs/big-models.md); the original goes back to the shared host copy.
        with whole_model_on(ctx.original_model(), plan.device) as original:
            model = whole_compressed_model(ctx.folded, ctx.spec).to(plan.device)
            target = "layer" if plan.refit == "output-local" else "model"
            layers = refit_output_projections(
                model, original, ctx.adapter, windows, ridge=plan.refit_ridge, target=target
            )

            # The refitted columns replace the prefix of each query head's block in the full-rank o_proj the
            # checkpoint stores; FoldedWeights serves the overrides to emit and the codec fit.
            names = {id(m): n for n, m in model.named_modules()}
            refitted = {}
            for layer_spec, layer in zip(ctx.spec.layers, ctx.adapter.decoder_layers(model)):
                o_proj = ctx.adapter.output_projection(ctx.adapter.attention(layer))
                name = names[id(o_proj)] + ".weight"
                folded_weight = ctx.folded.read([name])[name]
                refitted[name] = scatter_refit_columns(
                    folded_weight,
                    o_proj.weight.detach().to("cpu", folded_weight.dtype),
                    layer_spec.value_ranks,
                    geo.group_size,
                    geo.head_dim,
                ).contiguous()
            del model
            spec = keep_only_compiled_rate(ctx.spec, ctx.target_rate)
            folded = ctx.folded.with_overrides(refitted)
            verification, verified, kl, top1 = remeasure_compiled_rank(
                dataclasses.replace(ctx, folded=folded, spec=spec), original
            )
        return {
            "folded": folded,
            "spec": spec,
            "rate_table": spec.rate_table,
            "report.rate_table": spec.rate_table,
            "verification": verification,
            "report.refit": {
                "method": plan.refit,
                "target": target,
                "tokens": int(windows.numel()),
                "ridge": plan.refit_ridge,
                "layer_relative_error_before": [round(r.relative_error_before, 5) for r in layers],
                "layer_relative_error_after": [round(r.relative_error_after, 5) for r in layers],
                "verify_kl_before": verified.get("kl_mean"),
                "verify_top1_before": verified.get("top1_agreement"),
                "verify_kl_after": kl,
                "verify_top1_after": top1,
            },
        }
