"""Value-latent balancing (runtime.codecs.value_balance): exact without a codec at several rates, lower
o_proj-weighted value error under int2, and the key side's per-channel quantization being scale-invariant."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.runtime.codecs.kivi import kivi_decode, kivi_encode
from kvrewrite.runtime.codecs.value_balance import balance_value_latents, value_column_norms


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("value_balance")
    src = save_tiny_llama(root / "src", seed=0, num_kv_heads=2, num_heads=4)
    plan = Plan(model=str(src), output=root / "out", progress=False, target_rate=0.5, kv_codec="none")
    run_pipeline(plan, tiny_pipeline(random_windows(8, 64)))
    return root / "out"


@pytest.mark.parametrize("rate", [0.0, 0.3, None])
@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_balancing_leaves_the_uncoded_model_unchanged(compiled, rate, alpha):
    plain = kvrewrite.load(compiled, rate=rate, kv_codec="none")
    balanced = copy.deepcopy(plain)
    balance_value_latents(balanced, alpha)
    attention = balanced.model.layers[0].self_attn
    assert not torch.equal(attention.v_proj.weight, plain.model.layers[0].self_attn.v_proj.weight)
    tokens = random_windows(2, 40, seed=3)
    with torch.no_grad():
        reference, logits = plain(tokens).logits, balanced(tokens).logits
    assert (logits - reference).abs().max().item() < 1e-4 * reference.abs().max().item()


def _value_latents(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's cached value latents [B, S, sum r_v] (v_proj's output) on `tokens`."""
    captured, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: captured.append(o.detach())))
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    return captured


def _weighted_int2_error(model, tokens: torch.Tensor, group_size: int) -> float:
    """sum over layers, dims j of E[(v_j - int2(v)_j)^2] * ||o_proj columns of j||^2, each model in its own
    coordinates (rescaling j by s multiplies its error by s^2 and its weight by 1 / s^2, so the two agree)."""
    total = 0.0
    for layer, v in zip(model.model.layers, _value_latents(model, tokens)):
        batch, length, channels = v.shape
        blocks = v.reshape(batch, length // 8, 8, channels)
        decoded = kivi_decode(kivi_encode(blocks, "value", 2, group_size), "value", 2, group_size, 8, channels)
        err = (decoded - blocks).pow(2).mean(dim=(0, 1, 2))
        weight = torch.cat(value_column_norms(layer.self_attn)).pow(2).float()
        total += float((err * weight).sum())
    return total


def test_balancing_lowers_the_o_proj_weighted_int2_value_error(compiled):
    plain = kvrewrite.load(compiled, rate=0.0, kv_codec="none")
    tokens = random_windows(4, 64, seed=5)
    errors = {}
    for alpha in (0.0, 0.5, 1.0):
        model = copy.deepcopy(plain)
        balance_value_latents(model, alpha)
        errors[alpha] = _weighted_int2_error(model, tokens, group_size=16)
    assert errors[0.5] < errors[0.0]
    assert errors[1.0] < errors[0.0]


def test_key_side_per_channel_quantization_is_scale_invariant():
    """Keys are coded per channel over a block's tokens: scaling a channel scales its error by the same factor
    (exactly for a power of two, where the float16 scale and minimum round the same; within rounding otherwise)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 32, 24, generator=gen)
    keys[..., 5] *= 30
    factor = torch.ones(24)
    factor[5], factor[11] = 8.0, 7.3

    def error(x: torch.Tensor) -> torch.Tensor:
        return kivi_decode(kivi_encode(x, "key", 2, 32), "key", 2, 32, 32, 24) - x

    plain, scaled = error(keys), error(keys * factor)
    assert torch.equal(scaled[..., 5], plain[..., 5] * 8.0)
    others = [c for c in range(24) if c not in (5, 11)]
    assert torch.equal(scaled[..., others], plain[..., others])
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    assert rms(scaled[..., 11]) == pytest.approx(7.3 * rms(plain[..., 11]), rel=0.02)


def test_balancing_carries_a_v_proj_bias():
    """A family with a v_proj bias (Qwen2): the bias entry scales with its row. Attention mixes value rows with
    weights summing to 1, so any mix of the balanced values through the balanced o_proj equals the original."""
    from torch import nn

    from kvrewrite.runtime.kernels.reference import PackedLayout

    class Stub(nn.Module):
        def __init__(self):
            super().__init__()
            self.layout = PackedLayout((4, 3), (5, 2), 2)
            self.v_proj = nn.Linear(8, 7, bias=True)
            self.o_proj = nn.Linear(2 * 7, 8, bias=True)

    torch.manual_seed(0)
    stub = Stub().double()
    with torch.no_grad():
        stub.o_proj.weight[:, 3] *= 50  # one heavy dim (head 0, member 0, dim 3) so the scales are far from 1
    original = copy.deepcopy(stub)
    x, mix = torch.randn(6, 8, dtype=torch.float64), torch.softmax(torch.randn(6, 6, dtype=torch.float64), -1)

    def output(m):
        value = mix @ m.v_proj(x)  # [6, 7]: head 0's 5 dims, then head 1's 2
        heads = [value[:, :5], value[:, 5:]]
        packed = torch.cat([h for h in heads for _ in range(2)], dim=-1)  # member-major per KV head
        return m.o_proj(packed)

    balance_value_latents(stub, 1.0)
    assert not torch.allclose(stub.v_proj.bias, original.v_proj.bias)
    assert torch.allclose(output(stub), output(original), atol=1e-12)
