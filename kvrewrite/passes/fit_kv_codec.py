"""Pass: fit the KV codec on calibration latents of the compiled model (after the ranks are fixed).

int4/int2/gear need nothing trained; tada searches per-layer bit widths under --kv-bits-budget; csr trains
its dictionaries. The codec and its parameters go into the spec, the tables into kv_codec.safetensors.
"""

from __future__ import annotations

import dataclasses

from kvrewrite.codecs import build_layer_codecs, parse_codec
from kvrewrite.codecs.fitting import codec_calibration_errors, collect_latents, fit_csr_dictionaries, search_tada_bits
from kvrewrite.codecs.tada import BITS_TABLE
from kvrewrite.compressed_model import build_compressed_model
from kvrewrite.passes.context import CompileContext
from kvrewrite.progress import progress_bar

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
        spec = ctx.spec
        key_ranks = [layer.key_ranks for layer in spec.layers]
        value_ranks = [layer.value_ranks for layer in spec.layers]
        model = build_compressed_model(ctx.model.config, spec, ctx.folded_state_dict)
        latents = collect_latents(model, ctx.calibration_tokens[:FIT_WINDOWS], ctx.plan.batch_size)
        del model
        report: dict = {"codec": codec.describe(), "fit_tokens": int(latents[0]["key"].shape[0])}
        if codec.name == "tada" and ctx.plan.kv_bits_budget is not None:
            table, info = search_tada_bits(codec, latents, key_ranks, value_ranks, ctx.plan.kv_bits_budget, ctx.sensitivity)
            ctx.codec_tables[BITS_TABLE] = table
            report.update(info, bits=table.tolist())
        if codec.name == "csr":
            with progress_bar("fitting CSR dictionaries", len(latents), enabled=ctx.plan.progress) as bar:
                ctx.codec_tables.update(fit_csr_dictionaries(codec, latents, key_ranks, value_ranks, bar.advance))
        codecs = build_layer_codecs(codec, key_ranks, value_ranks, ctx.codec_tables)
        report["calibration_relative_sq_error"] = codec_calibration_errors(codecs, latents)
        g = codec.block_tokens
        coded = sum(c.block_bytes(side) for c in codecs for side in ("key", "value"))
        report["coded_bytes_per_token"] = coded / g  # excluding the float16 residual window
        ctx.report["kv_codec"] = report
        ctx.spec = dataclasses.replace(spec, kv_codec=codec.to_dict())
