"""Peer methods, each run from its own package: transformers QuantizedCache (optimum-quanto backend),
an FP8 cache, NVIDIA kvpress presses at prefill and during decoding, and presses stacked on per-token codes
(``coded_cache.CodedCache``: the press keeps tokens, the kept tokens keep their codes).

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


def _gather_kept(press: Any, ordered: bool) -> Any:
    """Make a ScorerPress keep its tokens in cache order (``ordered``) and, on a ``CodedCache``, by their codes.

    Order: kvpress's ScorerPress.compress gathers ``scores.topk(n_kept).indices``, i.e. in score order; with tied
    scores (StreamingLLM scores every kept token 1) torch returns them shuffled. Attention does not care, but a press
    applied again during decoding does when its scores are cache positions: StreamingLLM then treats whatever
    landed in slots 0-3 as the sinks and evicts 'the oldest' from a shuffled cache, i.e. recent tokens too.
    Sorting the kept indices restores StreamingLLM's sinks + recent window. Unordered, the kept indices are
    ScorerPress's own, in its order.

    Codes: the press scores what kvpress hands it, ``layer.keys`` / ``layer.values``, which on a ``CodedCache``
    are the dequantized held tokens (what attention reads, and what a user stacking kvpress on a quantized cache
    gets: kvpress dequantizes a QuantizedCache to score it too). The kept indices then go to ``CodedLayer.keep``,
    which gathers the codes as they are, and the press returns the layer's dequantized kept tokens, which kvpress
    assigns back unchanged. On any other cache the kept floats are gathered as ScorerPress does.
    """
    import torch
    from kvpress.utils import compute_n_kept

    from .coded_cache import CodedLayer

    base = type(press)

    class Kept(base):  # type: ignore[misc, valid-type]
        def compress(
            self, module: Any, hidden_states: Any, keys: Any, values: Any, attentions: Any, kwargs: dict
        ) -> tuple[Any, Any]:
            if self.compression_ratio == 0:
                return keys, values
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            kept = scores.topk(compute_n_kept(keys.shape[2], self.compression_ratio), dim=-1).indices
            if ordered:
                kept = torch.sort(kept, dim=-1).values
            layer = kwargs["past_key_values"].layers[module.layer_idx]
            if isinstance(layer, CodedLayer):
                layer.keep(kept)
                return layer.keys, layer.values
            index = kept.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
            return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()

    Kept.__name__ = ("Ordered" if ordered else "Kept") + base.__name__
    press.__class__ = Kept
    return press


def _scorer(kind: str, ratio: float, decoding: bool, coded: bool = False) -> Any:
    """kvpress's scorer ``kind``; ``coded``: it keeps a CodedCache's codes (see _gather_kept)."""
    import kvpress

    if kind == "snapkv":
        # In decoding the scorer sees one 64-token chunk of hidden states and SnapKV needs more than its window.
        scorer = kvpress.SnapKVPress(compression_ratio=ratio, window_size=32 if decoding else 64)
    elif kind == "streaming_llm":
        # Its scores are cache positions, so it needs the cache kept in position order (see _gather_kept).
        return _gather_kept(kvpress.StreamingLLMPress(compression_ratio=ratio), ordered=True)
    else:
        cls = {
            "expected_attention": kvpress.ExpectedAttentionPress,
            "tova": kvpress.TOVAPress,
            "knorm": kvpress.KnormPress,
        }[kind]
        scorer = cls(compression_ratio=ratio)
    return _gather_kept(scorer, ordered=False) if coded else scorer


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


def press(kind: str, ratio: float, interval: int = 64, decoding: bool = True, codec: str | None = None) -> Method:
    """A kvpress scorer press at prefill plus the same scorer as a decoding press (every ``interval`` tokens).

    ``decoding=False`` presses the prefill only (kvpress's default use): the continuation is then kept in full,
    so its bytes share grows back toward 100% over the window. ``codec`` (``int8``, ``int4``, ``fp8``) stacks the
    press on a ``CodedCache`` of those codes: the press keeps tokens, the kept tokens keep their codes."""

    def context(model: Any) -> Any:
        from kvpress import PrefillDecodingPress

        # A fresh press per window: decoding presses keep per-layer buffers and step counts.
        coded = codec is not None
        p = PrefillDecodingPress(
            prefilling_press=_scorer(kind, ratio, decoding=False, coded=coded),
            decoding_press=_token_interval_decoding_press(
                _scorer(kind, 0.0, decoding=True, coded=coded), ratio, interval
            )
            if decoding
            else None,
        )
        return p(model)

    settings: dict[str, Any] = {
        "press": kind if decoding else f"{kind} (prefill only)",
        "compression_ratio": ratio,
        "decoding_interval_tokens": interval if decoding else None,
    }
    if codec is not None:
        settings.update(_coded_settings(codec))
    return Method(
        f"{kind}-{1 - ratio:g}" + ("" if decoding else "-prefill-only") + (f"+{codec}" if codec else ""),
        "peer",
        new_cache=_coded_cache(codec) if codec else (lambda model: None),
        context=context,
        prefill_chunk=None,
        settings=settings,
    )


def _coded_cache(codec: str) -> Any:
    def new_cache(model: Any) -> Any:
        from .coded_cache import CodedCache

        return CodedCache(model.config, codec)

    return new_cache


def _coded_settings(codec: str) -> dict[str, Any]:
    from .coded_cache import CODECS, IntCodec

    c = CODECS[codec]
    if isinstance(c, IntCodec):
        return {
            "codec": codec,
            "nbits": c.bits,
            "axes": "per token, per kv head",
            "group": c.group or "head_dim",
            "scale_zero": "float16",
            "residual_length": 0,
        }
    return {"codec": codec, "dtype": "float8_e4m3fn", "residual_length": 0}


def per_token(codec: str) -> Method:
    """The CodedCache alone: per-token int8/int4 codes (float16 scale + zero per token and head), no residual."""
    return Method(f"{codec}-pertoken", "peer", new_cache=_coded_cache(codec), settings=_coded_settings(codec))


# Presses stacked on codes, at the bytes shares of kvrewrite's recipes (1/4, 1/8, 1/16 of fp16): 8-bit codes hold
# ~1/2, int4 ~1/4, so keep 1/2, 1/4, 1/8 of the tokens on int8 / fp8 and 1/2, 1/4 on int4 (int4 alone is 1/4).
COMBINED_PRESSES = ("tova", "snapkv")
COMBINED_RATIOS = {"int8": (0.5, 0.75, 0.875), "fp8": (0.5, 0.75, 0.875), "int4": (0.5, 0.75)}


def combined(interval: int = 64) -> list[Method]:
    methods = [per_token("int8"), per_token("int4")]
    for codec, ratios in COMBINED_RATIOS.items():
        methods += [press(kind, r, interval, codec=codec) for kind in COMBINED_PRESSES for r in ratios]
    return methods


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
    return methods + combined(interval)


def variants(interval: int = 64) -> list[Method]:
    """Named on request only: presses at prefill only, to compare with prefill-only figures elsewhere."""
    return [press(kind, 0.5, interval, decoding=False) for kind in PRESSES]
