"""The frontier's per-token coded cache (benchmarks/frontier/coded_cache.py), in the project env (no kvpress):
codes against a dense float64 reference, bytes read off the real tensors, and eviction that keeps codes bit for bit.
The kvpress side of the combination is tested in test_frontier_combined_press.py (bench env)."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import random_windows, tiny_llama_config  # noqa: E402

from benchmarks.frontier.cache_bytes import cache_bytes, fp16_bytes_per_token  # noqa: E402
from benchmarks.frontier.coded_cache import CodedCache, CodedLayer, FP8Codec, IntCodec  # noqa: E402
from benchmarks.frontier.fp8_cache import FP8Cache  # noqa: E402
from benchmarks.frontier.methods import Method, original  # noqa: E402
from benchmarks.frontier.protocols import continuation_window  # noqa: E402


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def _kv_like(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Key-like data: mostly unit scale, a few outlier channels and one near-constant token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 40.0
    x[..., 0, 5, :] = 0.25 + 1e-4 * torch.randn(shape[-1], generator=g)
    return x


@pytest.mark.parametrize("bits,group", [(8, None), (4, None), (8, 8), (4, 4)])
def test_int_codes_round_to_the_nearest_step_of_a_range_covering_the_group(bits, group):
    x = _kv_like((1, 2, 37, 16))
    codec = IntCodec(bits, group)
    parts = codec.encode(x)
    n_groups = 16 // (group or 16)
    assert parts["codes"].dtype == torch.uint8 and parts["codes"].shape == (1, 2, 37, 16 * bits // 8)
    assert parts["scale"].dtype == parts["zero"].dtype == torch.float16
    assert parts["scale"].shape == parts["zero"].shape == (1, 2, 37, n_groups)

    # Dense float64 reference, per (token, head, group).
    qmax = 2**bits - 1
    g = x.double().reshape(1, 2, 37, n_groups, -1)
    scale, zero = parts["scale"].double()[..., None], parts["zero"].double()[..., None]
    assert (zero <= g.amin(-1, keepdim=True)).all() and (zero + qmax * scale >= g.amax(-1, keepdim=True)).all()
    ref = (((g - zero) / scale).round().clamp(0, qmax) * scale + zero).reshape(x.shape)
    got = codec.decode(parts).double()
    assert torch.allclose(got, ref, rtol=0, atol=1e-6 * float(x.abs().max()))
    # The bound the bit width gives: half a step, the step being the group's range / qmax, up to the float16
    # rounding of the stored scale and zero (2^-10 relative, 2^-24 absolute in float16's subnormals).
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((hi - lo) + lo.abs() * 2**-10 + 2**-24) / qmax * (1 + 2**-10) + 2**-24
    err = (got - x.double()).reshape(g.shape).abs()
    assert (err <= step / 2 + 1e-6 * float(x.abs().max())).all()
    assert err.amax() > 0.25 * step.amax() / 2  # a real quantizer, not a pass-through


def test_fp8_codes_are_the_fp8_cache_codes():
    x = _kv_like((1, 2, 9, 16))
    parts = FP8Codec().encode(x)
    layer = FP8Cache(tiny_llama_config()).layers[0]
    layer.update(x, x)
    assert parts["codes"].dtype == torch.float8_e4m3fn
    assert torch.equal(parts["codes"].view(torch.uint8), layer.keys.view(torch.uint8))
    assert torch.equal(FP8Codec().decode(parts), layer.keys.float())


@pytest.mark.parametrize("codec,per_head_bytes", [("int8", 16 + 4), ("int4", 8 + 4), ("fp8", 16)])
def test_coded_cache_holds_codes_and_scales_only(codec, per_head_bytes):
    model = _model()
    window = random_windows(1, 48)[0]
    config = model.config
    method = Method(codec, "peer", new_cache=lambda m: CodedCache(m.config, codec))
    score = continuation_window(model, method, window, n_ctx=16, chunk=8)
    # codes (+ float16 scale and zero per token and head) x (K, V) x layers x kv heads, for every token fed
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * per_head_bytes
    assert score.bytes_held == 48 * per_token
    full = continuation_window(model, original(), window, n_ctx=16, chunk=8)
    assert full.bytes_held == 48 * fp16_bytes_per_token(config)
    assert abs(score.nll_sum - full.nll_sum) / full.nll_sum < (0.02 if codec == "int8" else 0.1)


def _prefill(model: LlamaForCausalLM, ids: torch.Tensor, cache: CodedCache, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[1])[None]
    with torch.inference_mode():
        return model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True).logits


def _parts(layer: CodedLayer) -> dict[str, torch.Tensor]:
    return {f"k.{n}": t.clone() for n, t in layer.key_parts.items()} | {
        f"v.{n}": t.clone() for n, t in layer.value_parts.items()
    }


def _gathered(parts: dict[str, torch.Tensor], kept: torch.Tensor) -> dict[str, torch.Tensor]:
    index = lambda t: kept[..., None].expand(-1, -1, -1, t.shape[-1])  # noqa: E731
    return {
        n: t.view(torch.uint8).gather(2, index(t)) if t.element_size() == 1 else t.gather(2, index(t))
        for n, t in parts.items()
    }


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_eviction_keeps_the_codes_bit_for_bit_and_the_bytes_are_the_product_of_the_shares(codec):
    model = _model()
    ids = random_windows(1, 56)[0][None]
    alone, combined = CodedCache(model.config, codec), CodedCache(model.config, codec)
    _prefill(model, ids[:, :40], alone)
    _prefill(model, ids[:, :40], combined)
    g = torch.Generator().manual_seed(1)
    n_heads, n, n_kept = model.config.num_key_value_heads, 40, 10
    kept_by_layer = []
    for a, c in zip(alone.layers, combined.layers):
        kept = torch.stack([torch.randperm(n, generator=g)[:n_kept] for _ in range(n_heads)])[None]  # any order
        c.keep(kept)
        kept_by_layer.append(kept)
        assert _bit_equal(_parts(c), _gathered(_parts(a), kept))
        assert torch.equal(c.keys, a.keys.gather(2, kept[..., None].expand(-1, -1, -1, a.keys.shape[-1])))
    # Quantization share x kept share, exactly: nothing but the kept tokens' codes is held.
    per_token = fp16_bytes_per_token(model.config)
    quant_share = cache_bytes(alone) / n / per_token
    assert cache_bytes(combined) / n / per_token == pytest.approx(quant_share * n_kept / n, rel=1e-12)
    assert combined.get_seq_length() == n_kept

    # Decoding goes on over the kept tokens; what was kept is never re-quantized.
    kept_codes = [_parts(c) for c in combined.layers]
    _prefill(model, ids[:, 40:48], combined, start=40)
    _prefill(model, ids[:, 48:56], combined, start=48)
    for before, layer in zip(kept_codes, combined.layers):
        now = {name: t[:, :, :n_kept] for name, t in _parts(layer).items()}
        assert _bit_equal(now, before)
    assert cache_bytes(combined) == cache_bytes(alone) // n * (n_kept + 16)


class _KeyNormPress:
    """A press written against the cache interface kvpress uses (dense torch, no kvpress): after the prefill
    forward of each attention layer it reads ``layer.keys``, keeps the ``n_kept`` tokens with the smallest key norm
    per head (KnormPress's rule) through ``layer.keep``, and assigns keys and values back as kvpress's hook does."""

    def __init__(self, model: LlamaForCausalLM, n_kept: int) -> None:
        self.n_kept = n_kept
        self.kept: list[torch.Tensor] = []
        self.hooks = [
            layer.self_attn.register_forward_hook(self.hook, with_kwargs=True) for layer in model.model.layers
        ]

    def hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> None:
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        kept = (-layer.keys.norm(dim=-1)).topk(self.n_kept, dim=-1).indices
        layer.keep(kept)
        self.kept.append(kept)
        layer.keys, layer.values = layer.keys, layer.values

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_press_on_codes_keeps_what_it_picks_on_the_dequantized_keys_and_the_codes_it_kept(codec):
    model = _model()
    ids = random_windows(1, 40)[0][None]
    alone = CodedCache(model.config, codec)
    logits_alone = _prefill(model, ids, alone)
    combined = CodedCache(model.config, codec)
    press = _KeyNormPress(model, n_kept=12)
    try:
        logits_combined = _prefill(model, ids, combined)
    finally:
        press.remove()
    # The press acts after each layer's attention: the prefill itself is the quantized cache's.
    assert torch.equal(logits_combined, logits_alone)
    for a, c, kept in zip(alone.layers, combined.layers, press.kept):
        expected = (-a.keys.double().norm(dim=-1)).topk(12, dim=-1).indices  # on what attention read
        assert torch.equal(kept.sort(-1).values, expected.sort(-1).values)
        assert _bit_equal(_parts(c), _gathered(_parts(a), kept))


def test_assigning_other_floats_to_a_coded_layer_is_refused():
    model = _model()
    cache = CodedCache(model.config, "int8")
    _prefill(model, random_windows(1, 8)[0][None], cache)
    layer = cache.layers[0]
    layer.keys = layer.keys  # what it serves: a no-op
    with pytest.raises(ValueError, match="re-quantize"):
        layer.keys = layer.keys[:, :, :4]
    with pytest.raises(ValueError, match="re-quantize"):
        layer.values = layer.values + 1e-3
