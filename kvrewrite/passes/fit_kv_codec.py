"""Pass: fit the KV codec on calibration latents of the compiled model (after the ranks are fixed).

int4/int2/gear need nothing trained; tada searches per-layer bit widths under --kv-bits-budget (weighted by
the sensitivity pass's per-layer KL weights when it ran); csr trains its dictionaries. The codec and its
parameters go into the spec, the tables into kv_codec.safetensors.
"""

from __future__ import annotations

import dataclasses

from kvrewrite.codecs import parse_codec
from kvrewrite.codecs.fitting import fit_codec_tables
from kvrewrite.compressed_model import build_compressed_model
from kvrewrite.passes.context import CompileContext

FIT_WINDOWS = 8  # calibration windows whose latents the codec is fitted on (8 x 512 tokens by default)


class FitKVCodec:
    name = "fit_kv_codec"
    description = "fit the KV codec (--kv-codec) on the compiled model's calibration latents: TaDA bit search, CSR dictionaries"

    def run(self, ctx: CompileContext) -> None:
        codec = parse_codec(ctx.plan.kv_codec)
        ctx.codec_tables = {}
        if codec is None:
            ctx.spec = dataclasses.replace(ctx.spec, kv_codec=None)
            return
        model = build_compressed_model(ctx.model.config, ctx.spec, ctx.folded_state_dict)
        ctx.codec_tables, ctx.report["kv_codec"] = fit_codec_tables(
            codec, model, ctx.calibration_tokens[:FIT_WINDOWS], budget_bits=ctx.plan.kv_bits_budget,
            sensitivity=ctx.sensitivity, batch_size=ctx.plan.batch_size, progress=ctx.plan.progress)
        ctx.spec = dataclasses.replace(ctx.spec, kv_codec=codec.to_dict())
