"""`export-mla --distill`: train the MLA form's own weights at its compiled widths against the original model's
next-token distribution, with the machinery `compress --distill` uses (method/attention_distillation.py: one window
per backward, a held-back validation split, the best epoch kept, back-off on an epoch that does not help).

The student is mla_reference_model with trainable weights: per layer q_proj (q_nope and q_pe rows), the latent
down-projection and the shared RoPE key (kv_a_proj_with_mqa), the key/value up-projection (kv_b_proj) and o_proj.
Everything else (embeddings, norms, MLPs, LM head) is frozen at the original's. The widths do not change: the
trained tensors have the export's shapes, so the DeepSeek-V3 checkpoint and our absorbed runtime carry them as they
are. Nothing is added at run time.

Before training, each latent dim is rescaled so its kv_a row and kv_b column have equal norms (an exact
reparametrisation, method/mla.py balance_latent_gauge): the whitened latent comes out at the calibration Gram's
scale, far from the other projections', and Adam's per-element steps would otherwise train the two factors at
wildly different relative rates.

The kv_a_layernorm neutralisation is derived afresh from the trained weights: its bound reads the trained latent
rows' spectral norm and the largest attention input, now the larger of the original's calibration inputs and the
distilled form's own (its residual stream differs from the original's); mean(c^2) of the trained latent on the
calibration windows is measured too, so the bound can be checked against it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvrewrite.compile.mla.form import MLAReferenceAttention, latent_norm_inputs, mla_layers_of, mla_reference_model
from kvrewrite.compile.on_device import whole_model_on
from kvrewrite.compile.passes.distill_attention import split_distill_windows
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.method.attention_distillation import DistillReport, DistillSettings, RateMix, distill_attention
from kvrewrite.method.mla import MLALayer, balance_latent_gauge, full_latent_rank


@dataclass(frozen=True)
class MLADistillResult:
    layers: list[MLALayer]  # the trained form (or the starting one where nothing was trained)
    report: DistillReport | None  # None: nothing to train (the form is exact)
    max_square_norms: list[float]  # per layer, for the latent-norm bound: max(original's, distilled form's) ||x||^2
    latent_mean_square_max: list[
        float
    ]  # per layer, the largest measured mean(c^2) of the trained latent (unscaled); [] untrained
    rates: tuple[str, ...] = ()  # nested: the rate keys trained together (their widths are the rate table's)


def form_is_exact(layers: list[MLALayer], geometry) -> bool:
    """Every RoPE component kept and a full latent: the form equals the original, there is nothing to recover."""
    n_kv, d = geometry.num_key_value_heads, geometry.head_dim
    return all(l.qk_rope_head_dim == n_kv * d and l.kv_lora_rank == full_latent_rank(geometry, n_kv) for l in layers)


@contextlib.contextmanager
def _latent_widths(model, widths: list[int]):
    """Inside the block, every MLA layer of `model` computes as truncated to its width in `widths`."""
    attentions = [m for m in model.modules() if isinstance(m, MLAReferenceAttention)]
    for attention, width in zip(attentions, widths):
        r = attention.layer.kv_lora_rank
        attention.latent_keep = (torch.arange(r, device=attention.kv_a_proj_with_mqa.device) < width).to(
            attention.kv_a_proj_with_mqa.dtype
        )
    try:
        yield model
    finally:
        for attention in attentions:
            attention.latent_keep = None


def nested_mla_rate_mix(student, rate_table: dict[str, list[int]], named: tuple[str, ...]) -> RateMix:
    """The truncations of a nested MLA distillation: every rate of `rate_table` (its per-layer latent widths); the
    named rates draw half of the windows together, the others the other half, and the named rates' mean validation
    KL picks the epoch (as the per-head forms' nested_rate_mix)."""
    keys = sorted(rate_table)
    between = [k for k in keys if k not in named]
    weights = tuple(
        (0.5 / len(named) if between else 1.0 / len(named)) if k in named else 0.5 / len(between) for k in keys
    )
    return RateMix(
        names=tuple(keys),
        enter=tuple((lambda w=rate_table[k]: _latent_widths(student, w)) for k in keys),
        weights=weights,
        validate=tuple(i for i, k in enumerate(keys) if k in named),
    )


def distill_mla_layers(
    prepared,
    layers: list[MLALayer],
    progress: bool = True,
    rate_table: dict[str, list[int]] | None = None,
    named_rates: tuple[str, ...] = (),
) -> MLADistillResult:
    """Train `layers` (the MLA form of prepared.ctx's source) as the plan's distill settings say.

    rate_table (nested, `--distill-rates`): per-layer widths of every rate to train together, each window drawing one
    (named_rates weigh as much as the others together); `layers` are at the widest, and every rate keeps a prefix."""
    ctx = prepared.ctx
    plan = ctx.plan
    calibration = ctx.calibration_tokens
    if plan.distill_tokens > calibration.numel():
        raise InvalidArgumentError(
            f"`distill_tokens={plan.distill_tokens}` is more than the {calibration.numel()} calibration tokens it trains "
            f"on; raise `calib_tokens` to at least {plan.distill_tokens} or lower `distill_tokens`"
        )
    if plan.distill_tokens < 2 * calibration.shape[1]:
        raise InvalidArgumentError(
            f"`distill_tokens={plan.distill_tokens}` is less than two {calibration.shape[1]}-token windows: nothing would "
            "be left to validate on"
        )
    if form_is_exact(layers, ctx.geometry):  # trained, it could only drift by rounding noise
        return MLADistillResult(list(layers), None, list(prepared.inputs.max_square_norms), [])
    device = torch.device(plan.device)
    train, validation = split_distill_windows(calibration, plan.distill_tokens)
    # Same function, latent factors at one scale, so Adam's per-element steps move both alike (method/mla.py).
    layers = [balance_latent_gauge(layer) for layer in layers]
    settings = DistillSettings(
        epochs=plan.epochs, learning_rate=plan.distill_lr, batch_windows=plan.batch_size, seed=plan.seed
    )
    with whole_model_on(ctx.original_model(), device) as teacher:
        student = mla_reference_model(teacher, layers, trainable=True)  # on the device, as the teacher is
        mix = nested_mla_rate_mix(student, rate_table, named_rates) if rate_table else None
        report = distill_attention(
            student, teacher, ctx.adapter, train.to(device), validation.to(device), settings, progress=progress, mix=mix
        )
    norms, latents = latent_norm_inputs(prepared, student, calibration.to(device), progress)  # on the training device
    student.to("cpu")
    trained = mla_layers_of(student, layers)
    return MLADistillResult(trained, report, norms, latents, tuple(mix.names) if mix is not None else ())


def measured_latent_norm_errors(result: MLADistillResult, neutralisers: list, eps: float) -> list[float]:
    """Per layer, the neutralised kv_a_layernorm's relative error at the largest measured latent mean(c^2) of the
    trained form on the calibration windows (method/latent_norm.py). `export-mla` prints the largest beside the
    largest bound; tests/test_mla_distill.py checks the bound through the real norm."""
    from kvrewrite.method.latent_norm import relative_error

    return [float(relative_error(torch.tensor(m), n, eps)) for m, n in zip(result.latent_mean_square_max, neutralisers)]


def distill_provenance(result: MLADistillResult, plan) -> dict:
    """What the checkpoint's kvrewrite_mla marker records of its distillation (stock loaders ignore it)."""
    report = result.report
    entry = {"tokens": plan.distill_tokens, "epochs": plan.epochs, "learning_rate": plan.distill_lr}
    if report is None:
        return {"distill": {**entry, "trained": False, "why": "the form is exact at these widths"}}
    record = {
        **entry,
        "trained": report.kept_epoch > 0,
        "train_tokens": report.train_tokens,
        "validation_tokens": report.validation_tokens,
        "steps": report.steps,
        "validation_kl_before": report.validation_kl_before,
        "validation_kl_per_epoch": report.validation_kl_per_epoch,
        "validation_kl_after": report.validation_kl_after,
        "kept_epoch": report.kept_epoch,
        "learning_rate_per_epoch": report.learning_rate_per_epoch,
        "seconds": round(report.seconds, 1),
    }
    if result.rates:  # nested: every rate of the table trained together
        record.update(
            {
                "nested_rates": list(result.rates),
                "validation_rates": sorted(report.validation_kl_by_rate_before),
                "windows_per_rate": report.windows_per_rate,
                "validation_kl_by_rate_before": report.validation_kl_by_rate_before,
                "validation_kl_by_rate_after": report.validation_kl_by_rate_after,
            }
        )
    return {"distill": record}
