"""Pass (only with --balance-values ALPHA > 0): value-latent balancing folded into the checkpoint's weights.

Value dim j of every KV head is scaled by s_j = (norm of its o_proj input columns)^alpha over the layer's geometric
mean: v_proj row j (and its bias) times s_j, the o_proj columns that read dim j (every group member) divided by s_j
(runtime/codecs/value_balance.py has the maths and why it helps a value codec). The model's function is unchanged,
at every rate (per-dim scaling keeps the prefix order), so the rate table and spec stay as they are.

Runs after refit_output / distill_attention (they change o_proj, whose column norms set the scales) and before
fit_kv_codec (the codec is fitted on the balanced latents). Verify ran before the refit, on the unbalanced fold, so
this pass checks its own exactness the same way: the balanced weights against the unbalanced ones at full rank, in
float64, layer-streamed, within verify_tolerance, or the compile fails.
"""

from __future__ import annotations

import torch

from kvrewrite.compile.compiled_rank import verification_tokens
from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.errors import VerificationError
from kvrewrite.runtime.codecs.value_balance import balanced_value_weights, column_norms, scales_from_norms
from kvrewrite.runtime.kernels.reference import PackedLayout
from kvrewrite.spec import CompressionSpec


def balanced_overrides(
    folded: FoldedWeights, alpha: float
) -> tuple[dict[str, torch.Tensor], list[tuple[float, float]]]:
    """The balanced v_proj weight/bias and o_proj weight of every layer (full-rank layout, as the checkpoint stores
    them), read through `folded` (so refit / distillation overrides are what gets balanced), and per layer the
    (smallest, largest) scale."""
    geo = folded.geometry
    layout = PackedLayout(
        (geo.head_dim,) * geo.num_key_value_heads, (geo.head_dim,) * geo.num_key_value_heads, geo.group_size
    )
    tensors, ranges = {}, []
    for idx, prefix in enumerate(folded.attention_prefixes):
        names = [f"{prefix}.v_proj.weight", f"{prefix}.o_proj.weight"]
        bias_name = f"{prefix}.v_proj.bias"
        has_bias = bias_name in folded.overrides or "v_proj.bias" in folded.attention(idx)
        current = folded.read(names + ([bias_name] if has_bias else []))
        scales = scales_from_norms(column_norms(current[names[1]], layout), alpha)
        v, b, o = balanced_value_weights(current[names[0]], current.get(bias_name), current[names[1]], layout, scales)
        tensors[names[0]], tensors[names[1]] = v.contiguous(), o.contiguous()
        if b is not None:
            tensors[bias_name] = b.contiguous()
        flat = torch.cat(scales)
        ranges.append((float(flat.min()), float(flat.max())))
    return tensors, ranges


def full_rank_logit_difference(
    before: FoldedWeights, after: FoldedWeights, spec: CompressionSpec, tokens: torch.Tensor, device: str
) -> float:
    """Largest |logit difference| between two sets of rewritten weights at full rank, in float64, layer-streamed."""
    a, b = before.streamed(spec, torch.float64, device), after.streamed(spec, torch.float64, device)
    with torch.inference_mode():
        h_a = a.embed_batches([tokens])
        h_b = [h_a[0].clone()]
        for _ in zip(a.walk(h_a), b.walk(h_b)):
            pass
        with a.output_head() as head:  # the pass changes no head weights: one head serves both streams
            return (head(h_a[0]) - head(h_b[0])).abs().max().item()


class BalanceValues:
    name = "balance_values"
    description = "(--balance-values ALPHA) scale each value latent dim by its o_proj column norm^ALPHA, folded exactly into v_proj/o_proj"
    produces = ("report.value_balance",)
    # folded: the balanced v_proj/o_proj replace the fold's (or refit's / distillation's) as overrides.
    refines = ("folded",)

    def run(self, ctx: CompileContext) -> dict:
        alpha = ctx.plan.balance_values
        if alpha == 0:
            return {}
        tensors, ranges = balanced_overrides(ctx.folded, alpha)
        folded = ctx.folded.with_overrides(tensors)
        tokens = verification_tokens(ctx.calibration_tokens, ctx.plan.verify_tokens)
        difference = full_rank_logit_difference(ctx.folded, folded, ctx.spec, tokens, ctx.plan.device)
        tolerance = ctx.plan.verify_tolerance
        if not difference < tolerance:
            raise VerificationError(
                f"value balancing changed the full-rank logits by up to {difference:.3g} in float64 "
                f"(tolerance {tolerance:g}); nothing was written"
            )
        return {
            "folded": folded,
            "report.value_balance": {
                "alpha": alpha,
                "full_rank_max_abs_logit_diff": difference,
                "layer_scale_min": [round(lo, 5) for lo, _ in ranges],
                "layer_scale_max": [round(hi, 5) for _, hi in ranges],
            },
        }
