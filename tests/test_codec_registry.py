"""A new KV codec is one class plus a registration: an int8 per-token codec defined in this file alone compiles into
a tiny checkpoint, loads from it by default, and codes the cache within half its quantisation step of the dense
latents."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import DynamicCache

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.publish.evaluation import _logits
from kvrewrite.runtime.codecs import LayerCodec, codec_names, parse_codec, register_codec, unregister_codec
from kvrewrite.runtime.codecs.packing import dequantize_minmax, quantize_minmax
from kvrewrite.runtime.kernels.cache_layout import packed_view

LEVELS = 255  # 8-bit codes


class Int8PerToken(LayerCodec):
    """Every token's packed latent vector at 8 bits, with one float16 (scale, minimum) over all its channels."""

    name = "int8-token"
    defaults = {"group_size": 8, "residual": 8}

    def encode(self, x, side):
        codes, scale, low = quantize_minmax(x, (3,), 8)
        return {"codes": codes, "scale": scale.squeeze(-1), "low": low.squeeze(-1)}

    def decode(self, coded, side):
        return dequantize_minmax(coded["codes"], coded["scale"].unsqueeze(-1), coded["low"].unsqueeze(-1))

    def block_bytes(self, side):
        return self.block_tokens * (self.channels[side] + 2 * 2)  # uint8 codes + float16 scale and minimum per token


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    register_codec(Int8PerToken)
    root = tmp_path_factory.mktemp("registry")
    src = save_tiny_llama(root / "src", seed=0, num_kv_heads=2, num_heads=4)
    plan = Plan(model=str(src), output=root / "int8", progress=False, target_rate=0.5, kv_codec="int8-token")
    run_pipeline(plan, tiny_pipeline(random_windows(8, 64)))
    yield root / "int8"
    unregister_codec(Int8PerToken.name)


def test_the_registered_codec_compiles_and_loads_from_the_checkpoint(compiled):
    config = json.loads((compiled / "config.json").read_text())
    assert config["kvrewrite"]["kv_codec"] == {"name": "int8-token", "params": {"group_size": 8, "residual": 8}}
    model = kvrewrite.load(compiled)
    assert model.kv_codec.name == "int8-token" and type(model.make_kv_cache()).__name__ == "CodecCache"
    # The compile report's bytes come from the codec's own formula: per token, every layer's channels + 8 bytes.
    key_ranks, value_ranks = model._layer_ranks()
    expected = sum(sum(k) + 4 + sum(v) + 4 for k, v in zip(key_ranks, value_ranks))
    report = json.loads((compiled / "compress_report.json").read_text())
    assert report["kv_codec"]["coded_bytes_per_token"] == expected


def test_decode_error_is_at_most_half_the_quantisation_step_of_the_dense_latents(compiled):
    plain = kvrewrite.load(compiled, kv_codec="none").eval()
    coded_model = kvrewrite.load(compiled).eval()
    tokens = random_windows(2, 72, seed=9)
    dense = DynamicCache(config=plain.config)
    with torch.no_grad():
        plain(tokens, past_key_values=dense, use_cache=True)
    cache = coded_model.make_kv_cache()
    for i, layer in enumerate(dense.layers):
        keys, values = packed_view(layer.keys), packed_view(layer.values)  # [B, 1, S, C], the dense reference
        cache.update(keys, values, i)
        coded_layer = cache.layers[i]
        for side, x, store in (("key", keys, coded_layer.coded_keys), ("value", values, coded_layer.coded_values)):
            batch, n, g, c = coded_layer.codec.decode(store, side).shape
            assert g == 8 and n * g == 64 and c == x.shape[-1]  # 72 tokens: 8 blocks coded, 8 left in the window
            decoded = coded_layer.codec.decode(store, side).reshape(batch, n * g, c)
            # The codec codes the float16 window's copy of the dense latents; its step is that token's range / 255.
            x16 = x[:, 0, : n * g].half().float()
            step = ((x16.amax(-1, keepdim=True) - x16.amin(-1, keepdim=True)) / LEVELS).expand_as(x16)
            err = (decoded - x16).abs()
            slack = 1e-3 * (x16.abs() + LEVELS * step) + 1e-5  # the float16 scale and minimum
            assert (err <= 0.5 * step + slack).all()
            assert err.mean() < 0.3 * step.mean()  # rounding to the nearest code, not truncation
            assert (err > 0).any()  # it really is lossy: the test reads coded values, not the window
            stored = sum(t.numel() * t.element_size() for t in store.values())
            assert stored == batch * n * coded_layer.codec.block_bytes(side)
    # The coded model follows the plain one closely (int8 at least as well as int4's tolerance in test_codecs).
    with torch.no_grad():
        diff = (_logits(coded_model, tokens, chunk=16) - plain(tokens).logits).abs().max().item()
    assert 0 < diff < 0.05


def test_registry_refuses_clashes_and_forgets_unregistered_codecs():
    class Clash(Int8PerToken):
        name = "int4"

    with pytest.raises(ValueError, match="already registered"):
        register_codec(Clash)

    class NoWindow(LayerCodec):
        name = "no-window"
        defaults = {"group_size": 8}

    with pytest.raises(ValueError, match="residual"):
        register_codec(NoWindow)

    class Int8Wide(Int8PerToken):  # its own name, so the module's compiled checkpoint keeps its codec
        name = "int8-wide"
        defaults = {"group_size": 64, "residual": 32}

    register_codec(Int8Wide)
    try:
        assert "int8-wide" in codec_names()
        assert parse_codec("int8-wide:residual=16").describe() == "int8-wide:residual=16"
        with pytest.raises(InvalidArgumentError, match="codec int8-wide: group_size must be >= 1"):
            parse_codec("int8-wide:group_size=0")
    finally:
        unregister_codec("int8-wide")
    with pytest.raises(InvalidArgumentError, match="`kv_codec` must be one of"):
        parse_codec("int8-wide")
