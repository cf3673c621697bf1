"""Pass `verify`: the checks against our maths on about plan.verify_tokens calibration tokens, chosen as compress's
checks choose theirs (compiled_rank.verification_tokens: the first windows, cut to 256 tokens each), so the shared
--verify-tokens means one thing in both commands.

The full-width form (every RoPE component, full latent) against the original (exactness of the maths); the written
checkpoint in stock transformers against our maths at its widths; every narrower refitted rate loaded by
kvrewrite.load against our maths at that rate; and, for a trained form, the neutralised kv_a_layernorm's error at
the trained latent's measured mean square."""

from __future__ import annotations

from kvrewrite.compile.compiled_rank import verification_tokens
from kvrewrite.compile.mla.deepseek_v3_export import TRANSFORMERS_LATENT_NORM_EPS
from kvrewrite.compile.mla.distill import measured_latent_norm_errors
from kvrewrite.compile.mla.export import export_matches_maths, full_width_max_logit_diff
from kvrewrite.compile.mla.passes.context import MLAContext
from kvrewrite.compile.mla.rate_refit import rates_match_maths
from kvrewrite.compile.on_device import whole_model_on


class VerifyExport:
    name = "verify"
    description = "max |Δlogit| of the full-width form, of the checkpoint and of each refitted rate vs our maths"
    produces = ("full_width_diff", "export_diff", "rate_diffs", "latent_norm_errors")
    refines = ()

    def run(self, ctx: MLAContext) -> dict:
        prepared, output = ctx.prepared, ctx.plan.output
        tokens = verification_tokens(prepared.ctx.calibration_tokens, ctx.plan.verify_tokens)
        rated, distilled = ctx.rate_refit, ctx.distilled
        with whole_model_on(prepared.ctx.original_model(), prepared.ctx.plan.device):  # once for all three checks
            full_width_diff = full_width_max_logit_diff(prepared, tokens)
            export_diff = export_matches_maths(prepared, ctx.layers, output, tokens)
            rate_diffs = rates_match_maths(prepared, rated, output, tokens) if rated and rated.rate_o_proj else {}
        return {
            "full_width_diff": full_width_diff,
            "export_diff": export_diff,
            "rate_diffs": rate_diffs,
            "latent_norm_errors": measured_latent_norm_errors(
                distilled, ctx.summary.neutralisers, TRANSFORMERS_LATENT_NORM_EPS
            )
            if distilled is not None and distilled.report is not None
            else None,
        }
