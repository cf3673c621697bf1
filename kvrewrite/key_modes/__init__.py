"""Key modes: one class per way of compressing a layer's keys, behind a registry (docs/key-modes.md).

Adding a mode is one new file here defining a `@register_key_mode` KeyMode subclass, plus its import below.
Checkpoints store the mode's name, so a registered name never changes.
"""

from kvrewrite.key_modes.base import (
    KeyMode,
    KeyTransform,
    key_mode,
    key_mode_names,
    key_transform,
    register_key_mode,
    unregister_key_mode,
)

# The built-in modes, registered on import, in this order (the order --rope-mode auto lists its candidates in).
from kvrewrite.key_modes import freq, post_rope, latent, crosshead, folded  # noqa: E402,F401  isort: skip

from kvrewrite.key_modes.families import allowed_key_modes, preferred_key_modes, resolve_key_mode  # noqa: E402

__all__ = [
    "KeyMode",
    "KeyTransform",
    "allowed_key_modes",
    "key_mode",
    "key_mode_names",
    "key_transform",
    "preferred_key_modes",
    "register_key_mode",
    "resolve_key_mode",
    "unregister_key_mode",
]
