"""GEAR (`gear`, `gear-l`) against its error model: per block, decode(encode(x)) = KIVI backbone + per-head low-rank
part of the backbone's residual + per-vector outliers written back exactly; stored sizes from the formula; the
cache codes a block exactly when the streaming buffer of G tokens is full."""

from __future__ import annotations

import pytest
import torch

from kvrewrite.runtime.codecs import build_layer_codecs, make_codec_cache, parse_codec
from kvrewrite.runtime.codecs.gear import low_rank

KEY_RANKS, VALUE_RANKS = [16, 7, 12], [16, 16, 5]  # ragged ranks, as a rank-reduced layer has


def codec(spec: str):
    return build_layer_codecs(parse_codec(spec), [KEY_RANKS], [VALUE_RANKS])[0]


def latents(side: str, g: int = 64, seed: int = 0) -> torch.Tensor:
    """[2, 3, g, C] with an outlier channel and a channel far from 0, as real keys have, and a few spikes."""
    c = sum(KEY_RANKS if side == "key" else VALUE_RANKS)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, g, c, generator=gen)
    x[..., 3] *= 20
    x[..., 5] += 8
    spikes = torch.rand(x.shape, generator=gen) < 0.01
    return torch.where(spikes, 15 * torch.randn(x.shape, generator=gen), x)


def block_errors(spec: str, x: torch.Tensor, side: str) -> torch.Tensor:
    """Frobenius error of every block [B, n]."""
    c = codec(spec)
    return (c.decode(c.encode(x, side), side) - x).flatten(2).norm(dim=-1)


@pytest.mark.parametrize("side", ["key", "value"])
def test_without_low_rank_and_outliers_gear_is_its_kivi_backbone_bit_for_bit(side):
    x = latents(side)
    plain = codec("int2:group_size=64,residual=0")
    bare = codec("gear-l:rank=0")
    assert torch.equal(bare.decode(bare.encode(x, side), side), plain.decode(plain.encode(x, side), side))


@pytest.mark.parametrize("side", ["key", "value"])
@pytest.mark.parametrize("share", [0, 5])
def test_low_rank_part_never_adds_error_in_any_block(side, share):
    """The low-rank part is A A^T R (R zero at the outliers, which decode writes back): per block, GEAR's error is
    at most its own backbone's (the same codec at rank 0), and strictly below it on these latents."""
    x = latents(side, seed=1)
    with_rank = block_errors(f"gear:outlier_percent={share}", x, side)
    backbone = block_errors(f"gear:outlier_percent={share},rank=0", x, side)
    # float16 factors: a relative 1e-3 of slack on the error.
    assert (with_rank <= backbone * (1 + 1e-3)).all()
    assert (with_rank < 0.97 * backbone).all()


@pytest.mark.parametrize("side", ["key", "value"])
def test_outliers_are_each_vectors_ends_and_come_back_exactly(side):
    x = latents(side, seed=2)
    gear = codec("gear:outlier_percent=10")
    coded = gear.encode(x, side)
    decoded = gear.decode(coded, side)
    dim, length = (2, 64) if side == "key" else (3, x.shape[-1])  # keys per channel, values per token
    k = int(0.05 * length + 0.5)
    position = coded["outlier_position"].long()
    assert position.shape[dim] == 2 * k and coded["outlier_position"].dtype == torch.uint8
    ends = x.sort(dim).values
    expected = torch.cat([ends.narrow(dim, 0, k), ends.narrow(dim, length - k, k)], dim)
    assert torch.equal(x.gather(dim, position).sort(dim).values, expected)
    assert torch.equal(decoded.gather(dim, position), x.gather(dim, position).half().float())
    # Filtered before quantization: the backbone's range is that of the other entries, so the outlier-aware
    # backbone (rank 0) beats plain KIVI on the kept entries by a wide margin on these spiky latents.
    kept = torch.ones_like(x, dtype=torch.bool).scatter(dim, position, False)
    aware = codec("gear:outlier_percent=10,rank=0")
    plain = codec("int2:group_size=64,residual=0")
    aware_err = (aware.decode(aware.encode(x, side), side) - x)[kept].norm()
    plain_err = (plain.decode(plain.encode(x, side), side) - x)[kept].norm()
    assert aware_err < 0.8 * plain_err


def test_outlier_count_rounds_s_half_percent_of_each_vector():
    gear = codec("gear")  # s = 2 %, G = 64: keys 0.64 -> 1 per end per channel; values (37 channels) 0.37 -> 0
    assert gear.outliers_per_end("key") == 1 and gear.outliers_per_end("value") == 0
    assert codec("gear:outlier_percent=5").outliers_per_end("value") == 1  # 0.925 -> 1
    assert codec("gear-l").outliers_per_end("key") == 0


@pytest.mark.parametrize("side", ["key", "value"])
def test_low_rank_is_per_head(side):
    """Each KV head gets its own rank-r factors: with keys (quantized per channel, outliers per channel) a head's
    decoded latents depend on that head's input only; for both sides the factors have the per-head shapes."""
    gear = codec("gear-l:rank=3")
    x = latents(side, seed=3)
    coded = gear.encode(x, side)
    ranks = KEY_RANKS if side == "key" else VALUE_RANKS
    assert coded["lowrank_left"].shape[-1] == 3 * len(ranks)
    assert coded["lowrank_right"].shape[-1] == sum(r * 3 for r in ranks)
    if side == "key":
        y = x.clone()
        y[..., ranks[0] :] = torch.randn(y[..., ranks[0] :].shape, generator=torch.Generator().manual_seed(9))
        first = slice(0, ranks[0])
        assert torch.equal(gear.decode(gear.encode(y, side), side)[..., first], gear.decode(coded, side)[..., first])


def test_power_iteration_captures_what_the_top_singular_values_predict():
    """On quantization-residual-like matrices (uniform noise) with a coherent rank-2 part, ||R||^2 - ||R - L||^2
    after GEAR's 3 power iterations reaches 97% of the sum of the top-r squared singular values (Eckart-Young's
    optimum) and never exceeds it. (Rank 1 here has no spectral gap, sigma_1 ~ sigma_2, and converges slowly.)"""
    gen = torch.Generator().manual_seed(4)
    coherent = torch.randn(50, 64, 2, generator=gen) @ torch.randn(50, 2, 16, generator=gen)
    residual = 0.5 * coherent + torch.rand(50, 64, 16, generator=gen) - 0.5
    for rank in (2, 4):
        left, right = low_rank(residual, rank, 3)
        assert torch.allclose(left.transpose(1, 2) @ left, torch.eye(rank).expand(50, rank, rank), atol=1e-5)
        captured = residual.pow(2).sum((1, 2)) - (residual - left @ right.transpose(1, 2)).pow(2).sum((1, 2))
        optimum = torch.linalg.svdvals(residual)[:, :rank].pow(2).sum(-1)
        assert (captured <= optimum * (1 + 1e-5)).all()
        assert (captured >= 0.97 * optimum).all()


@pytest.mark.parametrize(
    "spec",
    [
        "gear",
        "gear-l",
        "gear:rank=8,outlier_percent=5",
        "gear:group_size=300,rank=1,outlier_percent=1",
        "gear:bits=4,group_size=32",
    ],
)
def test_stored_bytes_match_the_formula(spec):
    gear = codec(spec)
    p = gear.config.params
    g, bits, rank = int(p["group_size"]), int(p["bits"]), int(p["rank"])
    share = float(p["outlier_percent"]) / 100
    for side, ranks in (("key", KEY_RANKS), ("value", VALUE_RANKS)):
        c = sum(ranks)
        groups = c if side == "key" else g * -(-c // g)  # fp16 scale + minimum: per channel / per token group
        backbone = -(-g * c * bits // 8) + 4 * groups
        lowrank = sum(2 * (g + r) * min(rank, g, r) for r in ranks)
        length, vectors = (g, c) if side == "key" else (c, g)
        k = int(share / 2 * length + 0.5)
        position_bytes = 1 if length <= 256 else 2
        outliers = vectors * 2 * k * (2 + position_bytes)
        coded = gear.encode(latents(side, g=g)[:1, :1], side)
        stored = sum(t.numel() * t.element_size() for t in coded.values())
        assert stored == gear.block_bytes(side) == backbone + lowrank + outliers


def test_cache_codes_a_block_exactly_when_the_buffer_of_g_tokens_fills():
    """GEAR's streaming buffer: with the default residual = 0 the float16 part holds 0..G-1 tokens, and G tokens
    are coded together when the G-th arrives (G = n_b = 64)."""
    cache = make_codec_cache(parse_codec("gear"), [KEY_RANKS], [VALUE_RANKS])
    layer, gen = cache.layers[0], torch.Generator().manual_seed(5)
    for step in range(1, 150):
        cache.update(torch.randn(1, 1, 1, 35, generator=gen), torch.randn(1, 1, 1, 37, generator=gen), 0)
        assert layer.keys.shape[-2] == step % 64
        coded_blocks = 0 if layer.coded_keys is None else layer.coded_keys["codes"].shape[1]
        assert coded_blocks == step // 64


def test_outlier_slots_never_widen_a_quantization_group():
    """The filtered entries' slots are filled inside the group's range: on a key channel whose entries are all far
    from 0 (mean 8), the outlier-aware backbone is finer than plain KIVI there; a 0 in those slots would double the
    channel's range and its error."""
    x = latents("key", seed=6)
    x[..., 5] = 8 + torch.randn(x[..., 5].shape, generator=torch.Generator().manual_seed(8))  # no spikes here
    aware = codec("gear:outlier_percent=10,rank=0")
    plain = codec("int2:group_size=64,residual=0")
    channel = x[..., 5]
    assert channel.min() > 2  # far from 0
    aware_err = (aware.decode(aware.encode(x, "key"), "key")[..., 5] - channel).norm()
    plain_err = (plain.decode(plain.encode(x, "key"), "key")[..., 5] - channel).norm()
    assert aware_err < plain_err


@pytest.mark.parametrize("side", ["key", "value"])
def test_low_rank_factors_fit_the_residual_with_the_outliers_zeroed(side):
    """B_h = R_h^T A_h with R = X - backbone, taken as 0 at the outliers (decode overwrites them there)."""
    x = latents(side, seed=7)
    gear = codec("gear:outlier_percent=10")
    coded = gear.encode(x, side)
    backbone = codec("gear:outlier_percent=10,rank=0")  # same outliers, fill and codes, no low-rank part
    base = backbone.decode(backbone.encode(x, side), side)
    dim = 2 if side == "key" else 3
    outlier = torch.zeros_like(x, dtype=torch.bool).scatter(dim, coded["outlier_position"].long(), True)
    residual = (x - base).masked_fill(outlier, 0.0)
    left, right = coded["lowrank_left"].float(), coded["lowrank_right"].float()
    col = flat = 0
    for start, end, rank in gear.head_ranks(side):
        a = left[..., col : col + rank]
        b = right[..., flat : flat + (end - start) * rank].reshape(*x.shape[:2], end - start, rank)
        expected = residual[..., start:end].transpose(-1, -2) @ a
        assert torch.allclose(b, expected, rtol=0, atol=2e-3 * expected.abs().max().item())
        col, flat = col + rank, flat + (end - start) * rank
