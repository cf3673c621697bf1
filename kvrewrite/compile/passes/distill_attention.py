"""Pass (only with --distill): train the rewritten attention weights end to end against the original model's
next-token distribution, at the compiled ranks (attention_distillation.py), or with --distill-rates at every rate
of the grid between two rates at once (nested: one checkpoint, every one of those rates served).

Runs after the output refit (it starts from the refitted o_proj when --refit is on) and before the codec fit and
emit. The trained weights replace the folded ones (FoldedWeights.overrides) in the checkpoint's full-rank layout;
weights the compiled ranks do not read are left exactly as folded. The rate table keeps only the compiled rate
(nested: only the trained rates).
Like the refit, it holds both models whole (docs/big-models.md).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from kvrewrite.compile.compiled_rank import keep_only_rates, remeasure_compiled_rank, whole_compressed_model
from kvrewrite.compile.on_device import whole_model_on
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.probes import truncated_model
from kvrewrite.method.attention_distillation import (
    DistillSettings,
    RateMix,
    distill_attention,
    distilled_attention_parameters,
)
from kvrewrite.spec import CompressionSpec, rate_key

# Share of the distillation windows held back to pick the best epoch (and to refuse a run that does not help).
VALIDATION_SHARE = 1 / 16


def split_distill_windows(windows: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first calibration windows covering n_tokens, split into training windows and validation windows
    (the last 1/16 of them, at least one); a single window is used for both."""
    n = max(1, min(windows.shape[0], -(-n_tokens // windows.shape[1])))
    held = max(1, round(n * VALIDATION_SHARE)) if n > 1 else 0
    chosen = windows[:n]
    if held == 0:
        return chosen, chosen
    return chosen[: n - held], chosen[n - held :]


def nested_rate_mix(
    student, adapter, spec: CompressionSpec, trained: tuple[float, ...], named: tuple[float, ...]
) -> RateMix:
    """The truncations of a nested distillation: every trained rate of the spec's table; the named rates draw half
    of the windows together, the rates between them the other half (all of them when none lie between), and the
    named rates' mean validation KL picks the epoch."""
    keys = [rate_key(r) for r in trained if rate_key(r) in spec.rate_table]
    named_keys = {rate_key(r) for r in named}
    between = [k for k in keys if k not in named_keys]
    weights = tuple(
        (0.5 / len(named_keys) if between else 1.0 / len(named_keys)) if k in named_keys else 0.5 / len(between)
        for k in keys
    )

    def at(key: str):
        key_ranks, value_ranks = spec.ranks_for_rate(float(key))
        return lambda: truncated_model(student, adapter, key_ranks, value_ranks)

    return RateMix(
        names=tuple(keys),
        enter=tuple(at(k) for k in keys),
        weights=weights,
        validate=tuple(i for i, k in enumerate(keys) if k in named_keys),
    )


class DistillAttention:
    name = "distill_attention"
    description = (
        "(--distill) train the attention weights at the compiled ranks against the original's next-token distribution"
    )

    produces = ("report.distill",)
    # Refinements, as for refit_output (which may have run before it): folded (trained attention weights as
    # overrides), spec, rate_table and report.rate_table (the compiled rate only), verification (re-measured).
    refines = ("folded", "spec", "rate_table", "report.rate_table", "verification")

    def run(self, ctx: CompileContext) -> dict:
        plan = ctx.plan
        if not plan.distill:
            return {}
        device = torch.device(plan.device)
        train, validation = split_distill_windows(
            ctx.calibration_tokens, plan.distill_token_count(ctx.calibration_tokens.numel())
        )
        # The original whole on the compile device for the training and the re-measure, then back to the host copy.
        with whole_model_on(ctx.original_model(), device) as original:
            student = whole_compressed_model(ctx.folded, ctx.spec, sliced=False).to(device)
            settings = DistillSettings(
                epochs=plan.epochs, learning_rate=plan.distill_lr, batch_windows=plan.batch_size, seed=plan.seed
            )
            trained_rates = (
                tuple(sorted({*plan.nested_distill_rates(), ctx.target_rate}))
                if plan.distill_rates
                else (ctx.target_rate,)
            )
            mix = (
                nested_rate_mix(student, ctx.adapter, ctx.spec, trained_rates, (*plan.distill_rates, ctx.target_rate))
                if plan.distill_rates
                else None
            )
            # Trained at full rank, computing as at the compiled ranks (nested: as at each window's drawn rate): the dims
            # beyond them get no gradient.
            whole_run = (
                contextlib.nullcontext()
                if mix is not None
                else truncated_model(
                    student,
                    ctx.adapter,
                    [l.key_ranks for l in ctx.spec.layers],
                    [l.value_ranks for l in ctx.spec.layers],
                )
            )
            with whole_run:
                report = distill_attention(
                    student,
                    original,
                    ctx.adapter,
                    train.to(device),
                    validation.to(device),
                    settings,
                    progress=plan.progress,
                    mix=mix,
                )

            spec = keep_only_rates(ctx.spec, trained_rates)
            results = {"spec": spec, "rate_table": spec.rate_table, "report.rate_table": spec.rate_table}
            if report.kept_epoch > 0:
                # Full-rank names are the checkpoint's names; dims beyond the compiled ranks were never touched.
                trained = {
                    name: parameter.detach().to("cpu", torch.float32).contiguous()  # emit casts
                    for name, parameter in distilled_attention_parameters(student, ctx.adapter).items()
                }
                del student
                results["folded"] = ctx.folded.with_overrides(trained)
                results["verification"], verified, kl, top1 = remeasure_compiled_rank(  # on the compile device too
                    dataclasses.replace(ctx, folded=results["folded"], spec=spec), original
                )
            else:  # nothing changed: verify's (or the refit's) figures still describe the checkpoint
                verified = dict(ctx.verification.get("compiled_rank", {}))
                kl, top1 = verified.get("kl_mean"), verified.get("top1_agreement")
        results["report.distill"] = {
            "tokens": report.train_tokens,
            "validation_tokens": report.validation_tokens,
            "epochs": plan.epochs,
            "learning_rate": plan.distill_lr,
            "batch_windows": settings.batch_windows,
            "steps": report.steps,
            "trained_tensor_elements": report.trained_tensor_elements,
            "seconds": round(report.seconds, 1),
            "train_loss_per_epoch": report.train_loss_per_epoch,
            "validation_kl_before": report.validation_kl_before,
            "validation_kl_per_epoch": report.validation_kl_per_epoch,
            "validation_kl_after": report.validation_kl_after,
            "kept_epoch": report.kept_epoch,
            "learning_rate_per_epoch": report.learning_rate_per_epoch,
            "verify_kl_before": verified.get("kl_mean"),
            "verify_top1_before": verified.get("top1_agreement"),
            "verify_kl_after": kl,
            "verify_top1_after": top1,
        }
        original.to("cpu")  # back to the host copy the other whole-model passes share
        if mix is not None:
            results["report.distill"].update(
                {
                    "nested_rates": list(mix.names),
                    "validation_rates": [mix.names[i] for i in mix.validate],
                    "windows_per_rate": report.windows_per_rate,
                    "validation_kl_by_rate_before": report.validation_kl_by_rate_before,
                    "validation_kl_by_rate_after": report.validation_kl_by_rate_after,
                }
            )
        return results
