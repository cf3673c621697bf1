"""Peer methods, each run from its own package: transformers QuantizedCache (optimum-quanto backend),
an FP8 cache, and NVIDIA kvpress presses at prefill and during decoding.

Imports of optional packages happen inside the factories, so the project env (no kvpress) can still list and run
the methods it has.
"""

from __future__ import annotations

from typing import Any

from .methods import Method

# Fractions of the sequence a press evicts: keep ~50%, ~25%, ~12.5%, ~6.25% of the tokens.
PRESS_RATIOS = (0.5, 0.75, 0.875, 0.9375)
PRESSES = ("streaming_llm", "expected_attention", "snapkv", "tova", "knorm")


def quantized(nbits: int, kivi: bool, residual_length: int = 128, q_group_size: int = 64) -> Method:
    """transformers QuantizedCache, quanto backend. quanto's axis 0 groups along head_dim (one scale per token),
    axis -1 groups along the sequence (one scale per channel): KIVI = keys per channel, values per token."""
    axis_key, axis_value = (-1, 0) if kivi else (0, 0)

    def new_cache(model: Any) -> Any:
        from transformers import QuantizedCache

        return QuantizedCache(
            backend="quanto",
            config=model.config,
            nbits=nbits,
            axis_key=axis_key,
            axis_value=axis_value,
            q_group_size=q_group_size,
            residual_length=residual_length,
        )

    name = f"quanto-int{nbits}" + ("-kivi" if kivi else "")
    settings = {
        "backend": "quanto",
        "nbits": nbits,
        "axis_key": axis_key,
        "axis_value": axis_value,
        "q_group_size": q_group_size,
        "residual_length": residual_length,
    }
    return Method(name, "peer", new_cache=new_cache, settings=settings)


def fp8() -> Method:
    def new_cache(model: Any) -> Any:
        from .fp8_cache import FP8Cache

        return FP8Cache(model.config)

    return Method("fp8-e4m3", "peer", new_cache=new_cache, settings={"dtype": "float8_e4m3fn"})


def _in_position_order(press: Any) -> Any:
    """Make a ScorerPress gather the tokens it keeps in their cache order.

    kvpress's ScorerPress.compress gathers ``scores.topk(n_kept).indices``, i.e. in score order; with tied scores
    (StreamingLLM scores every kept token 1) torch returns them shuffled. Attention does not care, but a press
    applied again during decoding does when its scores are cache positions: StreamingLLM then treats whatever
    landed in slots 0-3 as the sinks and evicts 'the oldest' from a shuffled cache, i.e. recent tokens too.
    Sorting the kept indices restores StreamingLLM's sinks + recent window; nothing else changes.
    """
    import torch
    from kvpress.utils import compute_n_kept

    base = type(press)

    class Ordered(base):  # type: ignore[misc, valid-type]
        def compress(
            self, module: Any, hidden_states: Any, keys: Any, values: Any, attentions: Any, kwargs: dict
        ) -> tuple[Any, Any]:
            if self.compression_ratio == 0:
                return keys, values
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            kept = scores.topk(compute_n_kept(keys.shape[2], self.compression_ratio), dim=-1).indices
            index = torch.sort(kept, dim=-1).values.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
            return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()

    Ordered.__name__ = f"Ordered{base.__name__}"
    press.__class__ = Ordered
    return press


def _scorer(kind: str, ratio: float, decoding: bool) -> Any:
    import kvpress

    if kind == "snapkv":
        # In decoding the scorer sees one 64-token chunk of hidden states and SnapKV needs more than its window.
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=32 if decoding else 64)
    if kind == "streaming_llm":
        # Its scores are cache positions, so it needs the cache kept in position order (see _in_position_order).
        return _in_position_order(kvpress.StreamingLLMPress(compression_ratio=ratio))
    cls = {
        "expected_attention": kvpress.ExpectedAttentionPress,
        "tova": kvpress.TOVAPress,
        "knorm": kvpress.KnormPress,
    }[kind]
    return cls(compression_ratio=ratio)


def _token_interval_decoding_press(base: Any, ratio: float, interval: int) -> Any:
    """kvpress's CompressionRatioDecodingPress (keeps 1 - ratio of all tokens seen), compressing every
    ``interval`` tokens instead of every ``interval`` forward calls, so 64-token chunks and 1-token generation
    steps are pressed on the same token schedule (and never on a 1-token buffer, where scorers that skip sink
    tokens would average an empty set)."""
    from kvpress.presses.base_press import is_prefilling
    from kvpress.presses.compression_ratio_decoding_press import CompressionRatioDecodingPress

    class TokenIntervalDecodingPress(CompressionRatioDecodingPress):
        def forward_hook(self, module: Any, input: Any, kwargs: dict, output: Any) -> Any:
            q_len = kwargs["hidden_states"].shape[1]
            if not is_prefilling(kwargs["cache_position"], q_len):
                self.layer_step_counts[module.layer_idx] += q_len - 1  # the parent adds the last 1
            return super().forward_hook(module, input, kwargs, output)

    return TokenIntervalDecodingPress(
        base_press=base,
        target_compression_ratio=ratio,
        compression_interval=interval,
        hidden_states_buffer_size=interval,
    )


def press(kind: str, ratio: float, interval: int = 64, decoding: bool = True) -> Method:
    """A kvpress scorer press at prefill plus the same scorer as a decoding press (every ``interval`` tokens).

    ``decoding=False`` presses the prefill only (kvpress's default use): the continuation is then kept in full,
    so its bytes share grows back toward 100% over the window."""

    def context(model: Any) -> Any:
        from kvpress import PrefillDecodingPress

        # A fresh press per window: decoding presses keep per-layer buffers and step counts.
        p = PrefillDecodingPress(
            prefilling_press=_scorer(kind, ratio, decoding=False),
            decoding_press=_token_interval_decoding_press(_scorer(kind, 0.0, decoding=True), ratio, interval)
            if decoding
            else None,
        )
        return p(model)

    return Method(
        f"{kind}-{1 - ratio:g}" + ("" if decoding else "-prefill-only"),
        "peer",
        context=context,
        prefill_chunk=None,
        settings={
            "press": kind if decoding else f"{kind} (prefill only)",
            "compression_ratio": ratio,
            "decoding_interval_tokens": interval if decoding else None,
        },
    )


def think(ratio: float = 0.5) -> Method:
    """ThinK prunes key channels at prefill; kvpress zeroes them in place, so real bytes do not shrink."""

    def context(model: Any) -> Any:
        from kvpress import ThinKPress

        return ThinKPress(key_channel_compression_ratio=ratio)(model)

    return Method(
        f"think-keys-{ratio:g}",
        "peer",
        context=context,
        prefill_chunk=None,
        nominal_share=1 - ratio / 2,
        settings={"press": "think", "key_channel_compression_ratio": ratio},
    )


def all_peers(interval: int = 64) -> list[Method]:
    methods = [quantized(4, False), quantized(4, True), quantized(2, False), quantized(2, True), fp8()]
    methods += [press(kind, r, interval) for kind in PRESSES for r in PRESS_RATIOS]
    methods.append(think(0.5))
    return methods


def variants(interval: int = 64) -> list[Method]:
    """Named on request only: presses at prefill only, to compare with prefill-only figures elsewhere."""
    return [press(kind, 0.5, interval, decoding=False) for kind in PRESSES]
