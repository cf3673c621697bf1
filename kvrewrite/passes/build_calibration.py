"""Pass 2: tokenise the calibration corpus into fixed-length windows."""

from __future__ import annotations

from kvrewrite.passes.context import CompileContext


class BuildCalibration:
    name = "build_calibration"
    description = "tokenise the calibration corpus (synthetic, wiki or a user file) into windows"

    def run(self, ctx: CompileContext) -> None:
        from kvrewrite.calibration_data import calibration_token_sequences  # gensim is slow to import

        plan = ctx.plan
        # Only synthetic text needs the whole model (it generates with it); other sources never load it.
        model = ctx.original_model() if plan.calibration == "synthetic" else None
        ctx.calibration_tokens = calibration_token_sequences(
            plan.calibration, ctx.tokenizer, plan.calib_tokens, plan.seq_len, model=model, seed=plan.seed
        )
        ctx.report["calibration"] = {
            "source": plan.calibration,
            "tokens": int(ctx.calibration_tokens.numel()),
            "windows": int(ctx.calibration_tokens.shape[0]),
            "seq_len": plan.seq_len,
        }
