"""Which key modes a model family may use, and the one it gets by default (--rope-mode default / auto / a mode)."""

from __future__ import annotations

from kvrewrite.errors import UnsupportedModelError
from kvrewrite.key_modes.base import key_mode, key_mode_names

# --rope-mode default: the preferred mode per objective where the family allows it, else post-rope.
DEFAULT_MODE = {"optimal": "latent"}
FALLBACK_MODE = "post-rope"


def allowed_key_modes(adapter, config) -> tuple[str, ...]:
    """Every registered mode this family's attention features allow, in registration order."""
    features = adapter.features(config)
    return tuple(name for name in key_mode_names() if key_mode(name).allowed_for(features))


def preferred_key_modes(prefer: str) -> tuple[str, ...]:
    """The modes that compete in --rope-mode auto: all of them (quality), or those whose run-time work does not
    grow with the context (zero-overhead)."""
    if prefer == "zero-overhead":
        return tuple(name for name in key_mode_names() if key_mode(name).context_independent)
    return key_mode_names()


def resolve_key_mode(adapter, config, rope_mode: str, objective: str) -> str:
    """The key mode for this family, before any work: `default` picks the family's best fixed mode, `auto`
    stays `auto` (chosen per layer later) unless only one mode is possible, an explicit mode is checked."""
    allowed = allowed_key_modes(adapter, config)
    if rope_mode in ("default", "auto") and len(allowed) == 1:
        return allowed[0]
    if rope_mode == "auto":
        return "auto"
    if rope_mode == "default":
        preferred = DEFAULT_MODE.get(objective, FALLBACK_MODE)
        return preferred if preferred in allowed else FALLBACK_MODE
    if rope_mode not in allowed:
        features = adapter.features(config)
        why = (
            "it has no RoPE, so its keys fold exactly into W_Q/W_K"
            if not features.has_rope
            else "its per-head q/k norms sit between the projections and RoPE, so the key side can only be compressed after RoPE"
            if features.qk_norm
            else "it has sliding-window layers, whose cache renumbers positions"
        )
        raise UnsupportedModelError(
            f"`rope_mode={rope_mode}` is not possible for model type {config.model_type!r}: {why}; "
            f"allowed: default, auto, {', '.join(allowed)}"
        )
    return rope_mode
