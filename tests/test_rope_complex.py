"""The eager complex-product RoPE (key_modes.rows.turn_interleaved_pairs, mla.attention.rope_interleaved_to_halves)
against the real formulas they replace outside torch.compile and transformers' own DeepseekV3 function, on the
strided inputs the models hand them."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

from kvrewrite.key_modes.freq import rotate_stored_pairs
from kvrewrite.key_modes.rows import complex_pairs, phase_table, rotate_interleaved_pairs, turn_interleaved_pairs
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
    odd = randn(2, 16).as_strided((2, 1, 16), (16, 1, 1))  # dense, with an odd stride on its size-1 dim
    assert torch.equal(torch.view_as_real(complex_pairs(odd, torch.float32)).flatten(-2), odd)
    assert complex_pairs(randn(0, 3, 16), torch.float32).shape == (0, 3, 8)  # an empty batch


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


def randn64(*shape: int) -> torch.Tensor:
    """float64 numbers that float32 cannot hold exactly."""
    return torch.randn(*shape, generator=GEN, dtype=torch.float64)


def test_float64_stays_float64():
    angles = randn64(2, 3, 8)
    cos, sin = angles.cos(), angles.sin()
    x = randn64(2, 3, 16)
    got = turn_interleaved_pairs(x, torch.complex(cos, sin))
    assert got.dtype == torch.float64 and (got - rotate_interleaved_pairs(x, cos, sin)).abs().max().item() < 1e-14
    q, k = randn64(2, 4, 3, 16), randn64(2, 1, 3, 16)
    cos2, sin2 = torch.cat([cos] * 2, -1), torch.cat([sin] * 2, -1)
    for a, b in zip(rope_interleaved_to_halves(q, k, cos2, sin2), apply_rotary_pos_emb_interleave(q, k, cos2, sin2)):
        assert a.dtype == torch.float64 and (a - b).abs().max().item() < 1e-14


class PairedAttention(nn.Module):
    """What rotate_stored_pairs reads of a freq layer: its pair-frequency index tables."""

    def __init__(self):
        super().__init__()
        self.tables = {"query_pair_freq": torch.tensor([3, 0, 7, 7, 1, 2]), "key_pair_freq": torch.tensor([5, 4, 0])}

    def _index(self, name: str, device) -> torch.Tensor:
        return self.tables[name]


def test_freq_pairs_rotate_each_by_its_own_frequency_with_one_table_per_forward():
    """Against the real formula on the gathered cos / sin; two layers of one forward share the phase table, the next
    forward's tables replace it."""
    layers = PairedAttention(), PairedAttention()
    angles = randn(2, 3, 8)
    cos, sin = angles.cos(), angles.sin()
    query, key = randn(2, 3, 12), randn(2, 3, 6)
    for layer in layers:
        got_q, got_k = rotate_stored_pairs(layer, query, key, cos, sin)
        q_freq, k_freq = layer.tables["query_pair_freq"], layer.tables["key_pair_freq"]
        assert (got_q - rotate_interleaved_pairs(query, cos[..., q_freq], sin[..., q_freq])).abs().max() < 1e-6
        assert (got_k - rotate_interleaved_pairs(key, cos[..., k_freq], sin[..., k_freq])).abs().max() < 1e-6
    table = phase_table(cos, sin)
    assert table is phase_table(cos, sin)  # held for the forward's other layers
    later = randn(2, 3, 8)
    assert torch.equal(phase_table(later.cos(), later.sin()), torch.complex(later.cos(), later.sin()))


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
