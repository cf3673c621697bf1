"""The method interface: what the harness needs to run a KV-cache method.

A method is a model (the shared original by default, or its own loader) plus a cache factory, plus optionally a
context manager the forwards run inside (kvpress presses hook the attention layers that way). The harness does
prefill, continuation scoring, generation and byte counting itself, so a new method needs no harness change.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Literal

Family = Literal["original", "peer", "kvrewrite"]


@dataclass(frozen=True)
class Method:
    name: str
    family: Family
    # Fresh cache for one window/prompt; None lets the model make its default cache (DynamicCache).
    new_cache: Callable[[Any], Any] = lambda model: None
    # Loads this method's model from the original's path; None shares the original model.
    load: Callable[[str], Any] | None = None
    # Entered around all forwards of one window/prompt (a kvpress press: `lambda model: press(model)`).
    context: Callable[[Any], ContextManager] | None = None
    # Prefill chunk in tokens; None prefills the whole context in one forward (kvpress prefill presses only act
    # on the forward that starts at position 0, so they need the context in one piece).
    prefill_chunk: int | None = 512
    # Bytes share the method claims when its real tensors do not shrink (ThinK zeroes key channels in place);
    # reported next to the measured share, never instead of it.
    nominal_share: float | None = None
    # Prefills a context itself: (model, ids [1, S], cache) -> (last position's logits, cache); None: the harness
    # feeds it in prefill_chunk pieces.
    prefill: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None
    # Free-form settings recorded in the results (compression ratio, nbits, ...).
    settings: dict[str, Any] = field(default_factory=dict)

    def enter(self, model: Any) -> ContextManager:
        return self.context(model) if self.context is not None else contextlib.nullcontext()


def original() -> Method:
    return Method("original", "original", settings={"cache": "DynamicCache"})
