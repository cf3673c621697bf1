"""The rewrite at its compiled ranks against the original: the tokens and the next-token KL verify measures it with,
the whole rewritten model (for the passes that update rank-specific weights: refit, distillation), and the
re-measurement and rate table those updates leave."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrewrite.compile.folded_weights import FoldedWeights, full_rank
from kvrewrite.method.output_refit import record_attention_outputs
from kvrewrite.runtime.compressed_model import compressed_classes, compressed_config
from kvrewrite.spec import CompressionSpec, rate_key

if TYPE_CHECKING:
    from kvrewrite.compile.passes.context import CompileContext

VERIFY_WINDOW = 256  # tokens per verification window (at most)


def verification_tokens(windows: torch.Tensor, tokens: int) -> torch.Tensor:
    """The first calibration windows, cut to VERIFY_WINDOW tokens, about `tokens` tokens in all."""
    length = min(windows.shape[1], VERIFY_WINDOW)
    count = max(1, min(windows.shape[0], tokens // length))
    return windows[:count, :length]


def next_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || model) in nats and the top-1 agreement."""
    ref = F.log_softmax(reference_logits.float(), dim=-1)
    new = F.log_softmax(logits.float(), dim=-1)
    kl = (ref.exp() * (ref - new)).sum(-1).mean().item()
    top1 = (reference_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
    return kl, top1


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
    tied = (
        {folded.source.output_embedding_name()}
        if getattr(folded.source.config, "tie_word_embeddings", False)
        else set()
    )
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"rewritten weights do not match the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
        )
    model.tie_weights()
    model.eval()
    if sliced:
        model.set_ranks([layer.key_ranks for layer in spec.layers], [layer.value_ranks for layer in spec.layers])
    return model


def keep_only_compiled_rate(spec: CompressionSpec, target_rate: float) -> CompressionSpec:
    """A rank-specific weight update (refit, distillation) is for the compiled ranks only: the spec with every other
    rate dropped from its rate table."""
    return keep_only_rates(spec, [target_rate])


def keep_only_rates(spec: CompressionSpec, rates) -> CompressionSpec:
    """The spec with its rate table cut to `rates` (those it has): the rates a weight update was trained for."""
    keys = [rate_key(r) for r in rates]
    return dataclasses.replace(spec, rate_table={k: spec.rate_table[k] for k in keys if k in spec.rate_table})


def remeasure_compiled_rank(ctx: CompileContext, original) -> tuple[dict, dict, float, float]:
    """Verify's compiled-rank KL, top-1 and per-layer attention error again, with the weights emit will write
    (ctx.folded with its overrides, at ctx.spec's ranks), on the tokens verify used.

    Returns the verification to keep (verify's, its compiled-rank figures replaced: they describe the emitted
    checkpoint), verify's compiled-rank figures from before, and the new KL and top-1."""
    verified = dict(ctx.verification.get("compiled_rank", {}))
    tokens = verification_tokens(ctx.calibration_tokens, ctx.plan.verify_tokens)
    device = next(original.parameters()).device  # where the caller put the original: the compile device
    ref_logits, ref_outputs = record_attention_outputs(original, ctx.adapter, tokens, with_logits=True)
    logits, outputs = record_attention_outputs(
        whole_compressed_model(ctx.folded, ctx.spec).to(device), ctx.adapter, tokens, with_logits=True
    )
    kl, top1 = next_token_kl(ref_logits, logits)
    verification = ctx.verification
    if verified:
        verification = {
            **ctx.verification,
            "compiled_rank": {
                **verified,
                "kl_mean": kl,
                "top1_agreement": top1,
                "layer_attention_relative_error": [
                    ((o - r).norm() / r.norm().clamp_min(1e-30)).item() for o, r in zip(outputs, ref_outputs)
                ],
            },
        }
    return verification, verified, kl, top1
