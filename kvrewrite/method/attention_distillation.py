"""End-to-end distillation of the rewritten attention weights at the compiled ranks (zero runtime cost).

Every closed-form step before this one (the transforms, the rank allocation, the output refit) optimises a
per-layer proxy: an attention output, a Gram-weighted error. What users pay for is the next-token distribution
after thirty layers of small errors compounding. This step trains exactly that:

    min over the attention weights   mean over calibration tokens  KL( p_original(. | x) || p_rewritten(. | x) )

The trained parameters are the rewritten attention's own weights: q/k/v/o projections (weights and biases) and
the latent key up-projection. Every other weight (embeddings, MLPs, norms, LM head) stays the original's, and
the target is the original model's distribution rather than the text's next token, so the best the training can
reach is the original model itself: it recovers what the rank cut lost and cannot adapt the model to the
calibration domain.

The model is trained at FULL rank with every attention truncated to the compiled ranks by the caller: zeroing the
latent dims beyond a rank is exactly the truncation to that rank (kvrewrite.compile.probes.truncated_model), and
those dims then get zero gradient, so Adam (no weight decay) leaves every weight the compiled ranks do not read
bit-for-bit unchanged. The trained state dict therefore has the checkpoint's full-rank layout as it is.
Post-RoPE key maps (q_map/k_map) are not trained: the runtime builds their block-diagonal product outside autograd.

Single-rate (the default): the result depends on the ranks, so the checkpoint serves its compiled rate only.

Nested (a RateMix): one set of weights trained for several rank cuts at once. Every window draws one truncation of
the mix (Matryoshka / nested-dropout style: the latent dims are already ordered by importance, so a smaller rate is
a prefix of a larger one's dims), and the KL of that truncation is what it contributes to the step. The epoch kept
is the one with the best mean validation KL over the mix's validation rates, so one checkpoint serves every rate of
the mix. The dims no truncation of the mix reads get no gradient and stay bit-for-bit unchanged.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvrewrite.progress import progress_bar

# Parameters of CompressedAttention that the runtime multiplies outside autograd (post-rope maps) are left out.
_FROZEN_ATTENTION_PARAMETERS = ("q_map", "k_map")


@dataclass
class DistillSettings:
    epochs: float = 2.0
    learning_rate: float = 1e-5
    batch_windows: int = 4
    warmup_steps: int = 4
    # An epoch that does not beat the best validation KL so far is undone (best weights back, Adam's moments
    # cleared) and training goes on at this fraction of the learning rate, warmed up again.
    backoff: float = 1 / 3
    seed: int = 0


@dataclass(frozen=True)
class RateMix:
    """The truncations nested distillation trains together: each window draws one, with these weights.

    enter[i]() returns a context manager inside which the student computes at truncation i (the caller's: the
    method knows nothing of ranks); validate lists the truncations whose mean validation KL picks the epoch."""

    names: tuple[str, ...]
    enter: tuple[Callable[[], contextlib.AbstractContextManager], ...]
    weights: tuple[float, ...]
    validate: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.names or not (len(self.names) == len(self.enter) == len(self.weights)):
            raise ValueError("a rate mix needs one name, context and weight per truncation")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError(f"rate mix weights must be >= 0 with a positive sum, got {self.weights}")
        if not self.validate or any(not 0 <= i < len(self.names) for i in self.validate):
            raise ValueError(f"rate mix validation indices {self.validate} are not truncations of the mix")


@dataclass
class DistillReport:
    steps: int
    train_tokens: int
    validation_tokens: int
    trained_tensor_elements: int  # of the trained tensors at full rank; those beyond the compiled ranks never change
    validation_kl_before: float
    validation_kl_after: float  # of the weights kept (the best epoch, or the starting weights if none improved)
    validation_kl_per_epoch: list[float] = field(default_factory=list)
    train_loss_per_epoch: list[float] = field(default_factory=list)
    kept_epoch: int = 0  # 0: no epoch beat the starting weights on the validation windows, nothing was changed
    learning_rate_per_epoch: list[float] = field(default_factory=list)  # peak rate of each epoch (after back-offs)
    seconds: float = 0.0
    # Nested runs: validation KL of each validation truncation (by name), before training and of the weights kept.
    validation_kl_by_rate_before: dict[str, float] = field(default_factory=dict)
    validation_kl_by_rate_after: dict[str, float] = field(default_factory=dict)
    windows_per_rate: dict[str, int] = field(default_factory=dict)  # how many training windows drew each truncation


def distilled_attention_parameters(model, adapter) -> dict[str, torch.nn.Parameter]:
    """Name -> parameter of every attention weight the distillation trains (names as in the model's state dict)."""
    found: dict[str, torch.nn.Parameter] = {}
    prefix = {id(m): n for n, m in model.named_modules()}
    for layer in adapter.decoder_layers(model):
        attention = adapter.attention(layer)
        for name, parameter in attention.named_parameters():
            if name.split(".")[0] in _FROZEN_ATTENTION_PARAMETERS or name.startswith(("q_norm", "k_norm")):
                continue
            found[f"{prefix[id(attention)]}.{name}"] = parameter
    return found


def _log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(model(input_ids=tokens, use_cache=False).logits.float(), dim=-1)


def _kl(reference_log_probs: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(reference || model), in nats."""
    return F.kl_div(
        log_probs.flatten(0, -2), reference_log_probs.flatten(0, -2), log_target=True, reduction="batchmean"
    )


def mean_kl(student, teacher, windows: torch.Tensor) -> float:
    """Mean next-token KL(teacher || student) over windows, one window at a time (one window's logits live), no
    gradients. The teacher's side is recomputed on every call rather than kept: it would hold windows x tokens x
    vocabulary floats (400 MB for 4 SmolLM2 windows) through the whole run."""
    with torch.no_grad():
        return sum(_kl(_log_probs(teacher, w), _log_probs(student, w)).item() for w in windows.split(1)) / max(
            len(windows), 1
        )


def _validation_kls(student, teacher, windows: torch.Tensor, mix: RateMix | None) -> dict[str, float]:
    """Validation KL per validation truncation of the mix ("" alone without a mix: the caller's truncation)."""
    if mix is None:
        return {"": mean_kl(student, teacher, windows)}
    kls = {}
    for i in mix.validate:
        with mix.enter[i]():
            kls[mix.names[i]] = mean_kl(student, teacher, windows)
    return kls


def distill_attention(
    student,
    teacher,
    adapter,
    train_windows: torch.Tensor,
    validation_windows: torch.Tensor,
    settings: DistillSettings,
    progress: bool = True,
    mix: RateMix | None = None,
) -> DistillReport:
    """Train the student's attention weights in place against the teacher's next-token distribution.

    student: the rewritten model at full rank, truncated to its compiled ranks (compile.probes.truncated_model);
    teacher: the original model. Windows are [n, seq_len] token ids. After every epoch the validation KL is
    measured: an epoch that is no better than the best so far is undone and the rate lowered (settings.backoff);
    the student ends with the weights of the best epoch, or unchanged when no epoch beat its start.

    mix: nested distillation: each training window runs inside one truncation of the mix, drawn with its weights
    (its own generator, so the window order is the single-rate run's); epochs are judged by the mean validation KL
    over mix.validate. Without a mix the caller's truncation (if any) holds for the whole run.
    """
    t0 = time.perf_counter()
    trained = distilled_attention_parameters(student, adapter)
    for parameter in student.parameters():
        parameter.requires_grad_(False)
    for parameter in trained.values():
        parameter.requires_grad_(True)
    teacher.eval()
    student.eval()  # no dropout: the rewritten model computes exactly what it will serve

    batch = max(1, int(settings.batch_windows))
    steps_per_epoch = math.ceil(train_windows.shape[0] / batch)
    epochs = max(1, math.ceil(settings.epochs))
    total_steps = max(1, round(settings.epochs * steps_per_epoch))
    optimizer = torch.optim.AdamW(
        list(trained.values()), lr=settings.learning_rate, betas=(0.9, 0.99), weight_decay=0.0
    )
    warmup = max(1, min(settings.warmup_steps, total_steps))
    # Linear warm-up (again after every back-off), then cosine decay to zero over the whole run.
    phase = {"scale": 1.0, "start": 0}
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            phase["scale"]
            * min(1.0, (s - phase["start"] + 1) / warmup)
            * 0.5
            * (1.0 + math.cos(math.pi * min(s, total_steps) / total_steps))
        ),
    )
    generator = torch.Generator().manual_seed(settings.seed)

    rate_draws = torch.Generator().manual_seed(settings.seed + 1)
    mix_weights = torch.tensor(mix.weights, dtype=torch.float64) if mix is not None else None

    def window_context() -> contextlib.AbstractContextManager:
        if mix is None:
            return contextlib.nullcontext()
        i = int(torch.multinomial(mix_weights, 1, generator=rate_draws))
        report.windows_per_rate[mix.names[i]] = report.windows_per_rate.get(mix.names[i], 0) + 1
        return mix.enter[i]()

    by_rate = _validation_kls(student, teacher, validation_windows, mix)
    before = sum(by_rate.values()) / len(by_rate)
    report = DistillReport(
        steps=total_steps,
        train_tokens=int(train_windows.numel()),
        validation_tokens=int(validation_windows.numel()),
        trained_tensor_elements=sum(p.numel() for p in trained.values()),
        validation_kl_before=before,
        validation_kl_after=before,
    )
    if mix is not None:
        report.validation_kl_by_rate_before = dict(by_rate)
        report.validation_kl_by_rate_after = dict(by_rate)
    best = {name: p.detach().clone() for name, p in trained.items()}
    step = 0
    try:
        with progress_bar("distill attention", total_steps, enabled=progress) as bar:
            for epoch in range(1, epochs + 1):
                order = torch.randperm(train_windows.shape[0], generator=generator)
                losses = []
                report.learning_rate_per_epoch.append(settings.learning_rate * phase["scale"])
                for start in range(0, len(order), batch):
                    if step >= total_steps:
                        break
                    tokens = train_windows[order[start : start + batch]]
                    # One window at a time, gradients accumulated: the same mean-over-tokens loss, with the
                    # logits (tokens x vocabulary, the bulk of the memory) of one window live instead of a batch.
                    loss = 0.0
                    for window in tokens.split(1):
                        with torch.no_grad():
                            reference = _log_probs(teacher, window)
                        with window_context():
                            part = _kl(reference, _log_probs(student, window)) * (window.numel() / tokens.numel())
                            part.backward()
                        loss += part.item()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    schedule.step()
                    losses.append(loss)
                    step += 1
                    bar.advance()
                if not losses:
                    break
                report.train_loss_per_epoch.append(sum(losses) / len(losses))
                by_rate = _validation_kls(student, teacher, validation_windows, mix)
                kl = sum(by_rate.values()) / len(by_rate)
                report.validation_kl_per_epoch.append(kl)
                if kl < report.validation_kl_after:
                    report.validation_kl_after, report.kept_epoch = kl, epoch
                    if mix is not None:
                        report.validation_kl_by_rate_after = dict(by_rate)
                    best = {name: p.detach().clone() for name, p in trained.items()}
                elif epoch < epochs:  # too large a step for what is left to fix: undo it, go on more gently
                    with torch.no_grad():
                        for name, parameter in trained.items():
                            parameter.copy_(best[name])
                    optimizer.state.clear()
                    phase["scale"] *= settings.backoff
                    phase["start"] = step
    finally:
        with torch.no_grad():
            for name, parameter in trained.items():
                parameter.copy_(best[name])
                parameter.requires_grad_(False)
    report.seconds = time.perf_counter() - t0
    return report
