"""Pass 7: the full-rank rewrite must reproduce the original logits; measure the compiled-rank error.

At full rank every transform is invertible, so any difference beyond rounding is a bug in the
statistics, the transforms or the fold; the compile fails rather than emit such a checkpoint.

The check runs in float64 (both models) where memory allows: a stock fp32 model already differs from
itself in float64 by about 1e-4 in the logits (SmolLM2-135M: 1.0e-4, eager vs SDPA 7e-5), so an fp32
comparison at 1e-4 cannot tell a folding bug from rounding. The fp32 difference is reported as well.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from kvrewrite.compressed_model import build_compressed_model
from kvrewrite.errors import VerificationError
from kvrewrite.passes.context import CompileContext
from kvrewrite.spec import full_key_ranks

VERIFY_WINDOWS = 2
VERIFY_TOKENS = 256
# Above this many parameters the float64 copies would cost too much memory; verify in fp32 instead.
FLOAT64_VERIFY_MAX_PARAMS = 1_000_000_000


def attention_outputs(model, adapter, tokens) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and every layer's attention output (output projection's output) for one batch."""
    captured: list[torch.Tensor] = []
    handles = [
        adapter.output_projection(adapter.attention(layer)).register_forward_hook(lambda _m, _i, out: captured.append(out))
        for layer in adapter.decoder_layers(model)
    ]
    try:
        with torch.inference_mode():
            logits = model(input_ids=tokens, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, captured


def next_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || model) in nats and the top-1 agreement."""
    ref = F.log_softmax(reference_logits.float(), dim=-1)
    new = F.log_softmax(logits.float(), dim=-1)
    kl = (ref.exp() * (ref - new)).sum(-1).mean().item()
    top1 = (reference_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
    return kl, top1


class Verify:
    name = "verify"
    description = "check full-rank equivalence (logits, in float64) and measure the error at the compiled ranks"

    def run(self, ctx: CompileContext) -> None:
        tokens = ctx.calibration_tokens[:VERIFY_WINDOWS, :VERIFY_TOKENS]
        ref_logits, ref_outputs = attention_outputs(ctx.model, ctx.adapter, tokens)

        d = ctx.geometry.head_dim
        full = ctx.spec.with_ranks(
            [full_key_ranks(layer.key_mode, len(layer.key_ranks), d) for layer in ctx.spec.layers],
            [[d] * len(layer.value_ranks) for layer in ctx.spec.layers],
            0.0,
        )
        full_model = build_compressed_model(ctx.model.config, full, ctx.folded_state_dict)
        full_logits, _ = attention_outputs(full_model, ctx.adapter, tokens)
        ctx.verification["full_rank_max_abs_logit_diff_fp32"] = (full_logits - ref_logits).abs().max().item()

        n_params = sum(p.numel() for p in ctx.model.parameters())
        dtype = torch.float64 if n_params <= FLOAT64_VERIFY_MAX_PARAMS else torch.float32
        if dtype == torch.float64:
            reference = copy.deepcopy(ctx.model).to(dtype)
            exact_ref, _ = attention_outputs(reference, ctx.adapter, tokens)
            # The stock model's own rounding noise, for context: fp32 vs float64 logits.
            ctx.verification["original_fp32_vs_fp64_max_abs_logit_diff"] = (ref_logits.double() - exact_ref).abs().max().item()
            del reference
            full_logits, _ = attention_outputs(full_model.to(dtype), ctx.adapter, tokens)
            ref = exact_ref
        else:
            ref = ref_logits
        max_diff = (full_logits - ref).abs().max().item()
        tolerance = ctx.plan.verify_tolerance
        ctx.verification["full_rank_max_abs_logit_diff"] = max_diff
        ctx.verification["verify_dtype"] = str(dtype).removeprefix("torch.")
        ctx.verification["tolerance"] = tolerance
        if not max_diff < tolerance:
            raise VerificationError(
                f"full-rank rewrite changed the logits by up to {max_diff:.3g} in {dtype} (tolerance {tolerance:g}); "
                "nothing was written"
            )
        # The same model, back in fp32 (an exact round trip) and sliced to the compiled ranks.
        model = full_model.to(torch.float32)
        model.set_ranks([layer.key_ranks for layer in ctx.spec.layers], [layer.value_ranks for layer in ctx.spec.layers])
        logits, outputs = attention_outputs(model, ctx.adapter, tokens)
        kl, top1 = next_token_kl(ref_logits, logits)
        layer_errors = [
            ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item() for out, ref in zip(outputs, ref_outputs)
        ]
        ctx.verification["compiled_rank"] = {
            "tokens": int(tokens.numel()),
            "kl_mean": kl,
            "top1_agreement": top1,
            # End to end: each layer sees the (already perturbed) output of the layers before it.
            "layer_attention_relative_error": layer_errors,
        }
