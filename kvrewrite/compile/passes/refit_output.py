"""Pass (only with --refit output / output-local): least-squares refit of every o_proj at the compiled ranks (output_refit.py).

Runs after verify (which checks the full-rank fold against the original) and before the codec fit and emit. The
refitted columns replace the prefix of each query head's o_proj block (FoldedWeights.overrides), so the checkpoint
keeps its full-rank layout; its rate table keeps only the compiled rate, which is the only one the refit is for.
"""

from __future__ import annotations

from kvrewrite.compile.compiled_rank import keep_only_compiled_rate, remeasure_compiled_rank, whole_compressed_model
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.method.output_refit import refit_output_projections, scatter_refit_columns


class RefitOutput:
    name = "refit_output"
    description = "(--refit output|output-local) refit every o_proj by least squares at the compiled ranks, layer by layer, against the original attention outputs"

    def run(self, ctx: CompileContext) -> None:
        plan = ctx.plan
        if plan.refit == "none":
            return
        geo = ctx.geometry
        n_windows = max(1, -(-plan.refit_tokens // ctx.calibration_tokens.shape[1]))
        windows = ctx.calibration_tokens[:n_windows]
        original = ctx.original_model()
        model = whole_compressed_model(ctx.folded, ctx.spec)
        target = "layer" if plan.refit == "output-local" else "model"
        layers = refit_output_projections(model, original, ctx.adapter, windows, ridge=plan.refit_ridge, target=target)

        # The refitted columns replace the prefix of each query head's block in the full-rank o_proj the checkpoint
        # stores; FoldedWeights serves the overrides to emit and the codec fit.
        names = {id(m): n for n, m in model.named_modules()}
        for layer_spec, layer in zip(ctx.spec.layers, ctx.adapter.decoder_layers(model)):
            o_proj = ctx.adapter.output_projection(ctx.adapter.attention(layer))
            name = names[id(o_proj)] + ".weight"
            folded_weight = ctx.folded.read([name])[name]
            ctx.folded.overrides[name] = scatter_refit_columns(folded_weight, o_proj.weight.detach().to(folded_weight.dtype),
                                                               layer_spec.value_ranks, geo.group_size, geo.head_dim).contiguous()
        del model
        keep_only_compiled_rate(ctx)
        verified, kl, top1 = remeasure_compiled_rank(ctx, original)
        ctx.report["refit"] = {
            "method": plan.refit, "target": target, "tokens": int(windows.numel()), "ridge": plan.refit_ridge,
            "layer_relative_error_before": [round(r.relative_error_before, 5) for r in layers],
            "layer_relative_error_after": [round(r.relative_error_after, 5) for r in layers],
            "verify_kl_before": verified.get("kl_mean"), "verify_top1_before": verified.get("top1_agreement"),
            "verify_kl_after": kl, "verify_top1_after": top1,
        }
