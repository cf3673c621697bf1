"""Pass `export`: the form the context holds written as a stock DeepSeek-V3 checkpoint at plan.output, with its rate
table, the narrower rates' refitted o_proj and the kvrewrite_mla marker (compile/mla/deepseek_v3_export.py).

The marker records the source, the refit and distillation sections the passes reported, which position-free queries
the form used and how the widths were placed (report.allocation: the `allocate` pass's record, written only with
layer_widths=sensitivity; the section keeps the name exports have always written, so markers on disk read one way)."""

from __future__ import annotations

import torch

from kvrewrite.compile.mla.export import export_at_share
from kvrewrite.compile.mla.passes.context import MLAContext
from kvrewrite.compile.mla.plan import DTYPES
from kvrewrite.compile.plan import source_dtype


class WriteCheckpoint:
    name = "export"
    description = "the DeepSeek-V3 checkpoint, its rate table and per-rate o_proj, written atomically"
    produces = ("summary",)
    refines = ()

    def run(self, ctx: MLAContext) -> dict:
        plan = ctx.plan
        chosen = getattr(torch, DTYPES[plan.dtype]) if DTYPES[plan.dtype] else source_dtype(ctx.prepared.ctx.config)
        # The marker's sections in the order exports wrote them before the export became passes:
        # refit, distill, the position-free queries, then how the widths were placed.
        marker = {key: value for key, value in ctx.report.items() if key != "allocation"}
        marker["position_free_queries"] = plan.position_free_queries
        if "allocation" in ctx.report:
            marker["allocation"] = ctx.report["allocation"]
        summary = export_at_share(
            ctx.prepared,
            ctx.layers,
            plan.output,
            dtype=chosen,
            overwrite=plan.overwrite,
            max_square_norms=ctx.norms,
            provenance=marker,
            rate_table=ctx.served_rates,
            rate_o_proj=None if ctx.rate_refit is None else ctx.rate_refit.rate_o_proj,
        )
        return {"summary": summary}
