"""Pass: fit the KV codec on calibration latents of the compiled model (after the ranks are fixed).

int4/int2/gear need nothing trained; tada searches per-layer bit widths under --kv-bits-budget (weighted by
the sensitivity pass's per-layer KL weights when it ran); csr trains its dictionaries. The codec and its
parameters go into the spec, the tables into kv_codec.safetensors.
"""

from __future__ import annotations

import dataclasses

from kvrewrite.compile.codec_fitting import collect_latents_streamed, fit_codec_tables_on_latents
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.runtime.codecs import parse_codec

FIT_WINDOWS = 8  # calibration windows whose latents the codec is fitted on (8 x 512 tokens by default)


class FitKVCodec:
    name = "fit_kv_codec"
    description = (
        "fit the KV codec (--kv-codec) on the compiled model's calibration latents: TaDA bit search, CSR dictionaries"
    )

    produces = ("codec_tables", "report.kv_codec")
    # spec: the fold built it before the codec was fitted; the codec and its parameters are written into it here.
    refines = ("spec",)

    def run(self, ctx: CompileContext) -> dict:
        codec = parse_codec(ctx.plan.kv_codec)
        if codec is None:
            return {"codec_tables": {}, "spec": dataclasses.replace(ctx.spec, kv_codec=None)}
        plan, spec = ctx.plan, ctx.spec
        # The compiled model, layer-streamed from the folded weights, each layer sliced to its compiled ranks.
        streamed = ctx.folded.streamed(spec, plan.compute_dtype(ctx.config), plan.device)
        key_ranks = [layer.key_ranks for layer in spec.layers]
        value_ranks = [layer.value_ranks for layer in spec.layers]
        latents = collect_latents_streamed(
            streamed,
            list(zip(key_ranks, value_ranks)),
            ctx.calibration_tokens[:FIT_WINDOWS],
            batch_size=plan.batch_size,
            progress=plan.progress,
        )
        codec_tables, report = fit_codec_tables_on_latents(
            codec,
            latents,
            key_ranks,
            value_ranks,
            budget_bits=plan.kv_bits_budget,
            sensitivity=ctx.sensitivity,
            progress=plan.progress,
        )
        return {
            "codec_tables": codec_tables,
            "report.kv_codec": report,
            "spec": dataclasses.replace(spec, kv_codec=codec.to_dict()),
        }
