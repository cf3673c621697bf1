"""Pass (only with --refit output / output-local): least-squares refit of every o_proj at the compiled ranks (output_refit.py).

Runs after verify (which checks the full-rank fold against the original) and before the codec fit and emit. The
refitted columns replace the prefix of each query head's o_proj block (FoldedWeights.overrides), so the checkpoint
keeps its full-rank layout; its rate table keeps only the compiled rate, which is the only one the refit is for.
"""

from __future__ import annotations

import dataclasses

import torch

from kvrewrite.runtime.compressed_model import compressed_classes, compressed_config
from kvrewrite.compile.folded_weights import FoldedWeights, full_rank
from kvrewrite.method.output_refit import record_attention_outputs, refit_output_projections, scatter_refit_columns
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.verify import next_token_kl, verification_tokens
from kvrewrite.spec import CompressionSpec, rate_key


def whole_compressed_model(folded: FoldedWeights, spec: CompressionSpec, sliced: bool = True):
    """The rewritten model materialised whole in fp32 at the spec's ranks (sliced) or at full rank (not sliced).

    The refit runs every layer on the activations of the already refitted earlier ones against the original model,
    so unlike the other passes it holds both models whole (like --value-metric fisher; docs/big-models.md)."""
    _, model_class = compressed_classes(folded.source.config)
    model = model_class(compressed_config(folded.source.config, full_rank(spec)))
    names = folded.output_names(spec)
    state = {name: tensor.float() for name, tensor in folded.read(names).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # output_names leaves out only a tied LM head (stored once, as the embedding); anything else missing is a bug.
    tied = {folded.source.output_embedding_name()} if getattr(folded.source.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"rewritten weights do not match the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    if sliced:
        model.set_ranks([layer.key_ranks for layer in spec.layers], [layer.value_ranks for layer in spec.layers])
    return model


def keep_only_compiled_rate(ctx: CompileContext) -> None:
    """A rank-specific weight update (refit, distillation) is for the compiled ranks only: drop every other rate."""
    key = rate_key(ctx.target_rate)
    ctx.spec = dataclasses.replace(ctx.spec, rate_table={key: ctx.spec.rate_table[key]} if key in ctx.spec.rate_table else {})
    ctx.report["rate_table"] = ctx.spec.rate_table


def remeasure_compiled_rank(ctx: CompileContext, original) -> tuple[dict, float, float]:
    """Verify's compiled-rank KL, top-1 and per-layer attention error again, with the weights emit will write
    (FoldedWeights with its overrides), on the tokens verify used. Replaces verify's figures (they describe the
    emitted checkpoint); returns verify's figures from before, and the new KL and top-1."""
    verified = dict(ctx.verification.get("compiled_rank", {}))
    tokens = verification_tokens(ctx.calibration_tokens, ctx.plan.verify_tokens)
    ref_logits, ref_outputs = record_attention_outputs(original, ctx.adapter, tokens, with_logits=True)
    logits, outputs = record_attention_outputs(whole_compressed_model(ctx.folded, ctx.spec), ctx.adapter, tokens, with_logits=True)
    kl, top1 = next_token_kl(ref_logits, logits)
    if verified:
        ctx.verification["compiled_rank"] = {
            **verified, "kl_mean": kl, "top1_agreement": top1,
            "layer_attention_relative_error": [((o - r).norm() / r.norm().clamp_min(1e-30)).item() for o, r in zip(outputs, ref_outputs)],
        }
    return verified, kl, top1


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
