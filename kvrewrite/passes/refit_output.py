"""Pass (only with --refit output / output-local): least-squares refit of every o_proj at the compiled ranks (output_refit.py).

Runs after verify (which checks the full-rank fold against the original) and before the codec fit and emit. The
refitted columns replace the prefix of each query head's o_proj block in the folded state dict, so the checkpoint
keeps its full-rank layout; its rate table keeps only the compiled rate, which is the only one the refit is for.
"""

from __future__ import annotations

import dataclasses

from kvrewrite.compressed_model import build_compressed_model
from kvrewrite.output_refit import refit_output_projections, scatter_refit_columns
from kvrewrite.passes.context import CompileContext
from kvrewrite.passes.verify import attention_outputs, next_token_kl
from kvrewrite.spec import rate_key


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
        model = build_compressed_model(ctx.model.config, ctx.spec, ctx.folded_state_dict)
        target = "layer" if plan.refit == "output-local" else "model"
        layers = refit_output_projections(model, ctx.model, ctx.adapter, windows, ridge=plan.refit_ridge, target=target)

        state = dict(ctx.folded_state_dict)
        for layer_spec, layer in zip(ctx.spec.layers, ctx.adapter.decoder_layers(model)):
            o_proj = ctx.adapter.output_projection(ctx.adapter.attention(layer))
            name = next(n for n, m in model.named_modules() if m is o_proj) + ".weight"
            state[name] = scatter_refit_columns(state[name], o_proj.weight.detach(), layer_spec.value_ranks,
                                                geo.group_size, geo.head_dim).contiguous()
        ctx.folded_state_dict = state
        # The refit is for the compiled ranks only: every other rate is dropped from the table.
        key = rate_key(plan.target_rate)
        ctx.spec = dataclasses.replace(ctx.spec, rate_table={key: ctx.spec.rate_table[key]} if key in ctx.spec.rate_table else {})
        ctx.report["rate_table"] = ctx.spec.rate_table

        # Compiled-rank error after the refit, on the tokens verify used before it; verify's figures are replaced
        # (they describe the emitted checkpoint) and kept in the refit report.
        verified = dict(ctx.verification.get("compiled_rank", {}))
        tokens = ctx.calibration_tokens[:2, :256]
        ref_logits, ref_outputs = attention_outputs(ctx.model, ctx.adapter, tokens)
        logits, outputs = attention_outputs(build_compressed_model(ctx.model.config, ctx.spec, state), ctx.adapter, tokens)
        kl, top1 = next_token_kl(ref_logits, logits)
        if verified:
            ctx.verification["compiled_rank"] = {
                **verified, "kl_mean": kl, "top1_agreement": top1,
                "layer_attention_relative_error": [((o - r).norm() / r.norm().clamp_min(1e-30)).item() for o, r in zip(outputs, ref_outputs)],
            }
        ctx.report["refit"] = {
            "method": plan.refit, "target": target, "tokens": int(windows.numel()), "ridge": plan.refit_ridge,
            "layer_relative_error_before": [round(r.relative_error_before, 5) for r in layers],
            "layer_relative_error_after": [round(r.relative_error_after, 5) for r in layers],
            "verify_kl_before": verified.get("kl_mean"), "verify_top1_before": verified.get("top1_agreement"),
            "verify_kl_after": kl, "verify_top1_after": top1,
        }
