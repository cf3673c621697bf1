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

import contextlib
from collections.abc import Iterator

import torch

from kvrewrite.compile.compiled_rank import next_token_kl, verification_tokens
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.errors import VerificationError
from kvrewrite.progress import progress_bar


def recording_attention_outputs(adapter, outputs: list[torch.Tensor]):
    """An on_layer that appends each layer's attention output (what the output projection returns) to `outputs`.
    Per layer run, not on the whole skeleton: the original's two streams (compute dtype, float64) share one."""

    @contextlib.contextmanager
    def on_layer(_idx: int, layer) -> Iterator[None]:
        handle = adapter.output_projection(adapter.attention(layer)).register_forward_hook(
            lambda _m, _i, out: outputs.append(out)
        )
        try:
            yield
        finally:
            handle.remove()

    return on_layer


class Verify:
    name = "verify"
    description = (
        "check full-rank equivalence (logits, in float64) and measure the error at the compiled ranks, layer-streamed"
    )

    produces = ("verification",)

    def run(self, ctx: CompileContext) -> dict:
        plan, adapter, spec = ctx.plan, ctx.adapter, ctx.spec
        tokens = verification_tokens(ctx.calibration_tokens, plan.verify_tokens)
        compute = plan.compute_dtype(ctx.config)
        reference = ctx.source.streamed(compute, plan.device)
        exact_reference = ctx.source.streamed(torch.float64, plan.device)
        exact_full = ctx.folded.streamed(spec, torch.float64, plan.device)
        compiled = ctx.folded.streamed(spec, compute, plan.device)

        attn_ref, attn_compiled = [], []

        def at_compiled_ranks(idx: int, layer):
            adapter.attention(layer).set_ranks(spec.layers[idx].key_ranks, spec.layers[idx].value_ranks)
            return recording_attention_outputs(adapter, attn_compiled)(idx, layer)

        with torch.inference_mode(), progress_bar("verifying", ctx.geometry.num_layers + 1, plan.progress) as bar:
            h_ref, h_exact = reference.embed_batches([tokens]), exact_reference.embed_batches([tokens])
            h_full, h_compiled = [h_exact[0].clone()], [h_ref[0].clone()]
            layer_errors, layer_full_diff = [], []
            # Four streams in lockstep, one layer of each holding weights at a time.
            for idx, *_ in zip(
                reference.walk(h_ref, recording_attention_outputs(adapter, attn_ref)),
                exact_reference.walk(h_exact),
                exact_full.walk(h_full),
                compiled.walk(h_compiled, at_compiled_ranks),
            ):
                # End to end: each layer sees the (already perturbed) output of the layers before it.
                attn, ref = attn_compiled[idx].float(), attn_ref[idx].float()
                layer_errors.append(((attn - ref).norm() / ref.norm().clamp_min(1e-30)).item())
                layer_full_diff.append((h_full[0] - h_exact[0]).abs().max().item())
                bar.advance()
            ref_logits = reference.logits(h_ref[0])
            exact_logits = exact_reference.logits(h_exact[0])
            full_logits = exact_full.logits(h_full[0])
            logits = compiled.logits(h_compiled[0])
            bar.advance()

        max_diff = (full_logits - exact_logits).abs().max().item()
        tolerance = plan.verify_tolerance
        verification = {
            "full_rank_max_abs_logit_diff": max_diff,
            "full_rank_layer_max_abs_hidden_diff": layer_full_diff,
            "verify_dtype": "float64",
            "compute_dtype": str(compute).removeprefix("torch."),  # resolved: `dtype=auto` is the source's
            # The stock model's own rounding noise, for context: compute dtype vs float64 logits.
            "original_compute_dtype_vs_fp64_max_abs_logit_diff": (ref_logits.double() - exact_logits)
            .abs()
            .max()
            .item(),
            "tolerance": tolerance,
        }
        if not max_diff < tolerance:
            raise VerificationError(
                f"full-rank rewrite changed the logits by up to {max_diff:.3g} in float64 (tolerance {tolerance:g}); "
                "nothing was written"
            )
        kl, top1 = next_token_kl(ref_logits, logits)
        verification["compiled_rank"] = {
            "tokens": int(tokens.numel()),
            "kl_mean": kl,
            "top1_agreement": top1,
            "layer_attention_relative_error": layer_errors,
        }
        return {"verification": verification}
