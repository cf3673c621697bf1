"""The eager complex-product RoPE (key_modes.rows.turn_interleaved_pairs, mla.attention.rope_interleaved_to_halves)
against the real formulas they replace outside torch.compile and transformers' own DeepseekV3 function, on the
strided inputs the models hand them."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

from kvrewrite.key_modes.rows import complex_pairs, rotate_interleaved_pairs, turn_interleaved_pairs
from kvrewrite.runtime.mla.attention import rope_interleaved_to_halves

GEN = torch.Generator().manual_seed(7)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def strided_inputs() -> list[torch.Tensor]:
    """[2, 3, 16]-shaped pairs as the models pass them: dense, a slice at an odd element, size-1 dims with odd
    strides, a transposed view."""
    return [
        randn(2, 3, 16),
        randn(2, 3, 21)[..., 3:19],  # odd storage offset, rows 21 apart
        randn(2, 1, 17)[..., 1:].expand(2, 3, 16).contiguous()[:, :1].expand(2, 3, 16),  # broadcast rows
        randn(3, 2, 16).transpose(0, 1),
    ]


def test_complex_pairs_views_every_layout_as_its_pairs():
    for x in strided_inputs():
        pairs = complex_pairs(x, torch.float32)
        assert torch.equal(pairs.real, x[..., 0::2]) and torch.equal(pairs.imag, x[..., 1::2])
    one = randn(1, 1, 8)[:, :, 1:7]  # size-1 dims, odd offset
    assert torch.equal(torch.view_as_real(complex_pairs(one, torch.float32)).flatten(-2), one)


def test_turned_pairs_equal_the_real_formula():
    angles = randn(2, 3, 8)
    cos, sin = angles.cos(), angles.sin()
    for x in strided_inputs():
        want = rotate_interleaved_pairs(x, cos, sin)
        got = turn_interleaved_pairs(x, torch.complex(cos, sin))
        assert got.dtype == x.dtype and (got - want).abs().max().item() < 1e-6
    # bf16: one rounding of the float32 product instead of one per elementwise op: no further from float64.
    x = randn(2, 3, 16).bfloat16()
    exact = rotate_interleaved_pairs(x.double(), cos.bfloat16().double(), sin.bfloat16().double())
    got = turn_interleaved_pairs(x, torch.complex(cos.bfloat16().float(), sin.bfloat16().float()))
    old = rotate_interleaved_pairs(x, cos.bfloat16(), sin.bfloat16())
    assert got.dtype == torch.bfloat16
    assert (got.double() - exact).abs().max() <= (old.double() - exact).abs().max()


def test_mla_rope_equals_transformers_interleaved_rope():
    """Decode and prefill shapes, q a transposed slice of the query projection, k a slice of the latent row."""
    for tokens in (1, 5):
        heads, nope, rope, rank = 4, 8, 16, 12
        query = randn(2, tokens, heads, nope + rope)
        q_pe = query[..., nope:].transpose(1, 2)  # [B, H, T, dr], strided
        k_pe = randn(2, tokens, rank + rope)[..., rank:].view(2, 1, tokens, rope)
        angles = randn(2, tokens, rope // 2)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        want = apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
        got = rope_interleaved_to_halves(q_pe, k_pe, cos, sin)
        for a, b in zip(got, want):
            assert a.shape == b.shape and (a - b).abs().max().item() < 1e-6
