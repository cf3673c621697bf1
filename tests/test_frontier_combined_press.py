"""kvpress presses stacked on the coded cache (benchmarks/frontier/peers.py, ``tova-0.5+int8`` and the like): each
part does what it does alone. Needs kvpress, so it is skipped in the project env; run it in the bench env by hand
(that env has no pytest, so borrow the project env's, same Python):

    mkdir -p /tmp/pytest-overlay && for p in pytest _pytest pluggy iniconfig py.py; do
        ln -sf "$PWD"/.venv/lib/python3.11/site-packages/$p /tmp/pytest-overlay/; done
    PYTHONPATH=.:/tmp/pytest-overlay .venv-bench/bin/python -m pytest -q -p no:cacheprovider \\
        tests/test_frontier_combined_press.py

No kvrewrite import here (it does not import on the bench env's transformers 5.2)."""

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, DynamicLayer

pytest.importorskip("kvpress")

from benchmarks.frontier.cache_bytes import cache_bytes, fp16_bytes_per_token  # noqa: E402
from benchmarks.frontier.coded_cache import CODECS, CodedCache, CodedLayer  # noqa: E402
from benchmarks.frontier.methods import Method  # noqa: E402
from benchmarks.frontier.peers import per_token, press  # noqa: E402
from benchmarks.frontier.protocols import continuation_window  # noqa: E402


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


class _FakeQuantLayer(DynamicLayer):
    """Float storage of the dequantized codes: what attention reads from a CodedLayer, held as plain floats, so
    an unmodified kvpress press acts on it as it does alone (gathering floats)."""

    codec: Any = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rt = lambda x: self.codec.decode(self.codec.encode(x)).to(x.dtype)  # noqa: E731
        return super().update(rt(key_states), rt(value_states), *args, **kwargs)


def _fake_quant_cache(config: Any, codec: str) -> Cache:
    layers = []
    for _ in range(config.num_hidden_layers):
        layer = _FakeQuantLayer()
        layer.codec = CODECS[codec]
        layers.append(layer)
    return Cache(layers=layers)


def _run(model: LlamaForCausalLM, method: Method, new_cache: Any, window: torch.Tensor) -> tuple[Any, Any]:
    caches: list[Any] = []

    def keep(m: Any) -> Any:
        caches.append(new_cache(m))
        return caches[-1]

    score = continuation_window(
        model,
        Method(method.name, "peer", new_cache=keep, context=method.context, prefill_chunk=None),
        window,
        n_ctx=96,
        chunk=64,
    )
    return score, caches[-1]


@pytest.mark.parametrize("kind,keep,codec", [("tova", 0.5, "int8"), ("snapkv", 0.25, "int4"), ("tova", 0.25, "fp8")])
def test_a_press_on_codes_keeps_the_press_alone_tokens_with_the_quantizer_alone_codes(kind, keep, codec):
    model = _model()
    window = torch.randint(3, 96, (224,), generator=torch.Generator().manual_seed(0))
    combined = press(kind, 1 - keep, codec=codec)
    alone = press(kind, 1 - keep)  # unmodified kvpress scorers
    s_c, c_cache = _run(model, combined, combined.new_cache, window)
    # The press alone, on a float cache holding exactly what the coded cache dequantizes to.
    s_p, p_cache = _run(model, alone, lambda m: _fake_quant_cache(m.config, codec), window)
    # The quantizer alone: every token's codes, nothing evicted.
    s_q, q_cache = _run(model, per_token(codec), per_token(codec).new_cache, window)

    assert s_c.nll_sum == s_p.nll_sum  # same tokens kept, same values read, at every step
    for c, p in zip(c_cache.layers, p_cache.layers):
        assert isinstance(c, CodedLayer)
        assert torch.equal(c.keys, p.keys) and torch.equal(c.values, p.values)
    held = p_cache.get_seq_length()
    assert held < 224 and c_cache.get_seq_length() == held  # the decoding press kept pressing
    # Bytes: the press alone's token share x the quantizer alone's bytes share, on the real tensors.
    per_token_fp16 = fp16_bytes_per_token(model.config)
    quant_share = cache_bytes(q_cache) / 224 / per_token_fp16
    assert cache_bytes(c_cache) / 224 / per_token_fp16 == pytest.approx(held / 224 * quant_share, rel=1e-12)


def test_the_kept_codes_are_the_quantizer_alone_codes_at_prefill():
    """After the prefill press the codes held are the quant-alone cache's codes of the tokens kept, bit for bit
    (the prefill forward is the same in both: a press acts after each layer's attention)."""
    model = _model()
    ids = torch.randint(3, 96, (1, 96), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(96)[None]
    alone, combined = CodedCache(model.config, "int4"), CodedCache(model.config, "int4")
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=alone, position_ids=positions, use_cache=True)
        with press("tova", 0.5, codec="int4").context(model):
            model(input_ids=ids, past_key_values=combined, position_ids=positions, use_cache=True)
    for a, c in zip(alone.layers, combined.layers):
        assert c.get_seq_length() == 48
        # Each kept token's codes are one of the alone cache's rows, bit for bit, per head.
        for part in ("codes", "scale", "zero"):
            ca, cc = a.key_parts[part][0], c.key_parts[part][0]
            for h in range(ca.shape[0]):
                match = (cc[h][:, None, :] == ca[h][None, :, :]).all(-1)
                assert match.any(-1).all()
