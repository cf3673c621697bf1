"""Pass 7: the full-rank rewrite must reproduce the original logits; measure the compiled-rank error.

At full rank every transform is invertible, so any difference beyond rounding is a bug in the
statistics, the transforms or the fold; the compile fails rather than emit such a checkpoint.

The check runs in float64 (both models): a stock fp32 model already differs from itself in float64 by
about 1e-4 in the logits (SmolLM2-135M: 1.0e-4, eager vs SDPA 7e-5), so an fp32 comparison at 1e-4
cannot tell a folding bug from rounding. Everything is layer-streamed (one decoder layer holds weights
at a time, float64 included), so this holds for models of any size; four hidden-state streams run side
by side: the original in the compute dtype and in float64, the rewrite at full rank in float64 and at
the compiled ranks in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrewrite.errors import VerificationError
from kvrewrite.compile.folded_weights import full_rank
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.progress import progress_bar

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


def run_with_attention_output(model, layer, hidden, inputs, adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's output and its attention output (what the output projection returns)."""
    captured = []
    handle = adapter.output_projection(adapter.attention(layer)).register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        out = model.run_layer(layer, hidden, inputs)
    finally:
        handle.remove()
    return out, captured[0]


class Verify:
    name = "verify"
    description = "check full-rank equivalence (logits, in float64) and measure the error at the compiled ranks, layer-streamed"

    def run(self, ctx: CompileContext) -> None:
        plan, adapter, spec = ctx.plan, ctx.adapter, ctx.spec
        tokens = verification_tokens(ctx.calibration_tokens, plan.verify_tokens)
        compute = plan.compute_dtype()
        reference = ctx.source.streamed(compute, plan.device)
        exact_reference = ctx.source.streamed(torch.float64, plan.device)
        exact_full = ctx.folded.streamed(spec, torch.float64, plan.device)
        compiled = ctx.folded.streamed(spec, compute, plan.device)

        with torch.inference_mode(), progress_bar("verifying", ctx.geometry.num_layers + 1, plan.progress) as bar:
            h_ref = reference.embed(tokens)
            h_exact = exact_reference.embed(tokens)
            h_full, h_compiled = h_exact.clone(), h_ref.clone()
            in_ref, in_exact = reference.layer_inputs(h_ref), exact_reference.layer_inputs(h_exact)
            in_full, in_compiled = exact_full.layer_inputs(h_full), compiled.layer_inputs(h_compiled)
            layer_errors, layer_full_diff = [], []
            for idx, layer_spec in enumerate(spec.layers):
                with reference.layer(idx) as layer:
                    h_ref, attn_ref = run_with_attention_output(reference, layer, h_ref, in_ref, adapter)
                with exact_reference.layer(idx) as layer:
                    h_exact = exact_reference.run_layer(layer, h_exact, in_exact)
                with exact_full.layer(idx) as layer:
                    h_full = exact_full.run_layer(layer, h_full, in_full)
                with compiled.layer(idx) as layer:
                    adapter.attention(layer).set_ranks(layer_spec.key_ranks, layer_spec.value_ranks)
                    h_compiled, attn_compiled = run_with_attention_output(compiled, layer, h_compiled, in_compiled, adapter)
                # End to end: each layer sees the (already perturbed) output of the layers before it.
                layer_errors.append(((attn_compiled.float() - attn_ref.float()).norm() / attn_ref.float().norm().clamp_min(1e-30)).item())
                layer_full_diff.append((h_full - h_exact).abs().max().item())
                bar.advance()
            ref_logits = reference.logits(h_ref)
            exact_logits = exact_reference.logits(h_exact)
            full_logits = exact_full.logits(h_full)
            logits = compiled.logits(h_compiled)
            bar.advance()

        max_diff = (full_logits - exact_logits).abs().max().item()
        tolerance = plan.verify_tolerance
        ctx.verification["full_rank_max_abs_logit_diff"] = max_diff
        ctx.verification["full_rank_layer_max_abs_hidden_diff"] = layer_full_diff
        ctx.verification["verify_dtype"] = "float64"
        ctx.verification["compute_dtype"] = plan.dtype
        # The stock model's own rounding noise, for context: compute dtype vs float64 logits.
        ctx.verification["original_compute_dtype_vs_fp64_max_abs_logit_diff"] = (ref_logits.double() - exact_logits).abs().max().item()
        ctx.verification["tolerance"] = tolerance
        if not max_diff < tolerance:
            raise VerificationError(
                f"full-rank rewrite changed the logits by up to {max_diff:.3g} in float64 (tolerance {tolerance:g}); "
                "nothing was written"
            )
        kl, top1 = next_token_kl(ref_logits, logits)
        ctx.verification["compiled_rank"] = {
            "tokens": int(tokens.numel()),
            "kl_mean": kl,
            "top1_agreement": top1,
            "layer_attention_relative_error": layer_errors,
        }
