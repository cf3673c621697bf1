"""Pass 2: tokenise the calibration corpus into fixed-length windows."""

from __future__ import annotations

from kvrewrite.compile.passes.context import CompileContext


def generation_model(ctx: CompileContext):
    """The whole original model on the compile device in the compile dtype, where synthetic text is generated.

    A copy of its own, read straight onto the device (on a GPU no copy stays in host memory), freed when the pass
    ends: the passes after this one stream layers, and host memory should not hold the whole model meanwhile."""
    from kvrewrite.io.source_model import load_whole_model

    plan = ctx.plan
    return load_whole_model(ctx.source.directory, plan.compute_dtype(ctx.config), plan.device)


class BuildCalibration:
    name = "build_calibration"
    description = "tokenise the calibration corpus (synthetic, wiki or a user file) into windows"

    produces = ("calibration_tokens", "budget_tokens", "report.calibration")

    def run(self, ctx: CompileContext) -> dict:
        from kvrewrite.io.calibration_data import calibration_token_sequences  # gensim is slow to import

        plan = ctx.plan
        held_back = -(-plan.budget_tokens // plan.seq_len) if plan.has_quality_budget() else 0
        n_calib = -(-plan.calib_tokens // plan.seq_len)
        # Only synthetic text needs the whole model (it generates with it); other sources never load it.
        model = generation_model(ctx) if plan.calibration == "synthetic" else None
        # One draw of distinct non-overlapping windows: the quality budget's windows never overlap the statistics'.
        windows = calibration_token_sequences(
            plan.calibration,
            ctx.tokenizer,
            plan.calib_tokens + held_back * plan.seq_len,
            plan.seq_len,
            model=model,
            seed=plan.seed,
        )
        del model  # a copy loaded for generation alone is freed here
        calibration_tokens = windows[:n_calib]
        budget_tokens = windows[n_calib:] if held_back else None
        return {
            "calibration_tokens": calibration_tokens,
            "budget_tokens": budget_tokens,
            "report.calibration": {
                "source": plan.calibration,
                "tokens": int(calibration_tokens.numel()),
                "windows": int(calibration_tokens.shape[0]),
                "seq_len": plan.seq_len,
                "held_back_for_quality_budget": 0 if budget_tokens is None else int(budget_tokens.numel()),
            },
        }
