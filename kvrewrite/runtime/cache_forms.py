"""Which cache policy fields each form of cache can honour, and the error naming the ones it cannot.

A per-head checkpoint with `latent`, `freq`, `post-rope` or `folded` keys honours every field of a CachePolicy
(runtime.cache_policy). The other forms refuse, before any cache is built:
- an MLA export (runtime.mla): its cache is the latent; it honours `rate` only (where it has a rate table);
- crosshead keys (one key block shared by all heads), and families with sliding-window layers: no recent window,
  so no token policy either;
- a block codec on the cache (kv_codec=, or the checkpoint's compiled one): no important tokens and no eviction
  (eviction quantizes its kept tokens per token itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrewrite.errors import InvalidArgumentError

if TYPE_CHECKING:  # cache_policy checks an explicit codec's form here: a runtime import back would close a circle
    from kvrewrite.runtime.cache_policy import CachePolicy
    from kvrewrite.runtime.codecs.config import CodecConfig


@dataclass(frozen=True)
class CacheForm:
    """A form of cache: how errors describe it ("is an MLA export"), the policy fields it honours, what to do instead."""

    description: str
    honours: tuple[str, ...]
    instead: str

    def refused(self, policy: CachePolicy) -> tuple[str, ...]:
        return tuple(name for name in policy.requested() if name not in self.honours)

    def check(self, policy: CachePolicy, subject: str, also: tuple[str, ...] = ()) -> None:
        """Raise naming every requested field (and `also`, load flags) this form cannot honour: '<fields>: <subject>
        <description>, which cannot honour ...; <instead>'."""
        refused = self.refused(policy) + tuple(also)
        if refused:
            them = "them" if len(refused) > 1 else "it"
            raise InvalidArgumentError(
                f"{', '.join(f'{name}=' for name in refused)}: {subject} {self.description}, which cannot honour "
                f"{them}; {self.instead}"
            )


MLA_EXPORT = CacheForm(
    "is an MLA export (its cache is the latent, kvrewrite.runtime.mla)",
    ("rate",),
    "the token tiers, codecs and budget policy are the per-head checkpoints' (kvrewrite compress); load it without "
    "them",
)


def codec_form(codec: CodecConfig, compiled: bool = False) -> CacheForm:
    """A cache coded by a block codec (tokens coded together in blocks): no eviction, no token-adaptive dims."""
    whose = "its compiled codec " if compiled else ""
    return CacheForm(
        f"is coded by {whose}{codec.describe()}",
        ("rate", "recent_window", "kv_codec"),
        "evict= quantizes its kept tokens per token itself and takes no block codec, and token-adaptive dims "
        "(important=) over a codec are not built yet: pass kv_codec='none'",
    )


def per_head_forms(model, policy: CachePolicy) -> list[CacheForm]:
    """The forms a loaded per-head checkpoint's cache takes under `policy` (none for the forms honouring every field)."""
    forms = []
    attention = model.compressed_attentions()[0]
    if attention.mode.shared_key_block:
        forms.append(
            CacheForm(
                f"has {attention.key_mode} keys (one key block shared by all heads)",
                ("rate", "kv_codec"),
                "a tiered cache (recent window) keeps each head's dims; compile with another `rope_mode`",
            )
        )
    if model.kvrewrite_adapter.features(model.config).sliding_layers:
        forms.append(
            CacheForm(
                f"is a {model.kvrewrite_adapter.family} checkpoint with sliding-window layers",
                ("rate", "kv_codec"),
                "a tiered cache (recent window) does not support them yet; load it without one",
            )
        )
    if policy.kv_codec == "compiled" and model.kv_codec is not None:
        forms.append(codec_form(model.kv_codec, compiled=True))
    return forms


def check_per_head(model, policy: CachePolicy, subject: str) -> None:
    """Refuse, naming field and form, what a loaded per-head checkpoint cannot honour of `policy`."""
    for form in per_head_forms(model, policy):
        form.check(policy, subject)
