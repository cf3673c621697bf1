"""Flash-decoding kernels (packed, latent, MLA) against dense float64 references, on CPU under TRITON_INTERPRET=1.

Every case reads a cache of capacity S_CAP through strided views of one preallocated buffer, with the live length
KV_LEN < S_CAP given as a device tensor and request 1 left-padded by PAD slots; the slots past KV_LEN and the padded
slots hold NaN, so a kernel that reads any of them fails. Splits: one (no workspace), two, more than the cache has
key blocks (empty splits), and the automatic plan.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed")

from kvrewrite.runtime.kernels.flash_decode_latent import latent_flash_decode  # noqa: E402
from kvrewrite.runtime.kernels.flash_decode_mla import mla_flash_decode  # noqa: E402
from kvrewrite.runtime.kernels.flash_decode_packed import packed_flash_decode, packed_plan, tile_columns  # noqa: E402
from kvrewrite.runtime.kernels.flash_decode_splits import (  # noqa: E402
    choose_splits,
    interpreting,
    mask_argument,
    plan_splits,
)
from kvrewrite.runtime.kernels.reference import PackedLayout, packed_attention  # noqa: E402

BATCH, S_CAP, KV_LEN, PAD = 2, 37, 29, 3  # 37 slots = 3 key blocks of 16 under the interpreter
SCALING = 0.3
SPLITS = [1, 2, 7, None]  # 7 > the 3 key blocks: splits that find no slot
# (key ranks, value ranks, group size): MHA with equal ranks; GQA 3 with a rank-0 key head, a rank-0 value head and
# uneven ranks; GQA 3 with one heavy head and one light one (different split counts per head).
PACKED_LAYOUTS = [((8, 8), (8, 8), 1), ((6, 12, 0), (10, 0, 4), 3), ((5, 16), (7, 3), 3)]
LATENT_LAYOUTS = [((10, 32, 0), (12, 0, 7), 3), ((16, 8), (8, 16), 1)]
HEAD_DIM = 32


def _relative_tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.bfloat16:
        return 1.5e-2
    return 1e-5 if interpreting() else 2e-3  # compiled fp32 dots run in tf32


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    error = (out.double() - ref).norm() / ref.norm()
    assert error < _relative_tolerance(dtype), error


def _allowed(s_cap: int = S_CAP, kv_len: int = KV_LEN) -> torch.Tensor:
    allowed = torch.ones(BATCH, s_cap, dtype=torch.bool)
    allowed[1, :PAD] = False
    allowed[:, kv_len:] = False  # unfilled slots
    return allowed


def _poison(buffer: torch.Tensor, kv_len: int = KV_LEN) -> None:
    """NaN in every slot the kernels must not read: past the live length, and request 1's left padding."""
    buffer[:, :, kv_len:] = float("nan")
    buffer[1, :, :PAD] = float("nan")


def _cache_buffer(columns: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A preallocated [B, 1, S_cap, C + 3] buffer: the kernels get views with non-trivial batch and slot strides."""
    return torch.randn(BATCH, 1, S_CAP, columns + 3, generator=gen).to(dtype)


# ---- packed (freq / post-rope / folded) -------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", PACKED_LAYOUTS, ids=["mha-equal", "gqa3-rank0", "gqa3-uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", SPLITS)
def test_packed_matches_reference(ranks, dtype, splits):
    layout = PackedLayout(*ranks)
    gen = torch.Generator().manual_seed(hash((ranks, splits)) % 2**31)
    ks, vs = sum(layout.key_ranks), sum(layout.value_ranks)
    buffer = _cache_buffer(ks + vs, dtype, gen)
    keys, values = buffer[:, 0, :, :ks], buffer[:, 0, :, ks : ks + vs]
    query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen).to(dtype)
    allowed = _allowed()
    mask = allowed[:, None, None, :KV_LEN]
    ref = packed_attention(
        query[:, None].double(),
        keys[:, None, :KV_LEN].double(),
        values[:, None, :KV_LEN].double(),
        mask,
        SCALING,
        layout,
    )[:, 0]
    _poison(buffer)
    out = packed_flash_decode(query, keys, values, allowed, torch.tensor([KV_LEN]), SCALING, layout, splits)
    _check(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_packed_window_mode_on_padded_rows(dtype, splits):
    """Unaligned head offsets over rows padded to 16 bytes: each tile loads whole aligned groups around its head.
    The neighbours' columns and the row padding (NaN here) must not leak into any head."""
    layout = PackedLayout((5, 11, 6), (3, 9, 7), 3)
    gen = torch.Generator().manual_seed(23)
    ks, vs, padded = sum(layout.key_ranks), sum(layout.value_ranks), 24
    key_rows = torch.randn(BATCH, S_CAP, padded, generator=gen).to(dtype)
    value_rows = torch.randn(BATCH, S_CAP, padded, generator=gen).to(dtype)
    keys, values = key_rows[..., :ks], value_rows[..., :vs]
    query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen).to(dtype)
    allowed = _allowed()
    ref = packed_attention(
        query[:, None].double(),
        keys[:, None, :KV_LEN].double(),
        values[:, None, :KV_LEN].double(),
        allowed[:, None, None, :KV_LEN],
        SCALING,
        layout,
    )[:, 0]
    key_rows[..., ks:] = float("nan")
    value_rows[..., vs:] = float("nan")
    assert tile_columns(layout.key_offsets, keys)[1] and tile_columns(layout.value_offsets, values)[1]
    out = packed_flash_decode(query, keys, values, allowed, torch.tensor([KV_LEN]), SCALING, layout, splits)
    _check(out, ref, dtype)
    # Rows that are not padded (the last row would read past the storage): the kernel keeps to the head's columns.
    assert not tile_columns(layout.key_offsets, keys.contiguous())[1]


def test_packed_without_live_length_reads_every_slot():
    """kv_len None: all S_cap slots are live (only `allowed` masks), int8 mask instead of bool."""
    layout = PackedLayout((12, 4), (4, 12), 3)
    gen = torch.Generator().manual_seed(3)
    ks, vs = sum(layout.key_ranks), sum(layout.value_ranks)
    keys = torch.randn(BATCH, S_CAP, ks, generator=gen)
    values = torch.randn(BATCH, S_CAP, vs, generator=gen)
    query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen)
    allowed = _allowed(kv_len=S_CAP)
    ref = packed_attention(
        query[:, None].double(),
        keys[:, None].double(),
        values[:, None].double(),
        allowed[:, None, None],
        SCALING,
        layout,
    )[:, 0]
    for splits in (1, 3):
        _check(
            packed_flash_decode(query, keys, values, allowed.to(torch.int8), None, SCALING, layout, splits),
            ref,
            torch.float32,
        )


@pytest.mark.parametrize("length_dtype", [torch.int64, torch.int32])
def test_live_length_is_read_from_device_memory(length_dtype):
    """A decode step written into the same buffers and the same kv_len tensor (as a replayed CUDA graph sees them):
    the next call attends the new slot, with the same plan (it depends on S_cap only)."""
    layout = PackedLayout((8, 16), (16, 8), 3)
    gen = torch.Generator().manual_seed(5)
    ks, vs = sum(layout.key_ranks), sum(layout.value_ranks)
    keys = torch.randn(BATCH, S_CAP, ks, generator=gen)
    values = torch.randn(BATCH, S_CAP, vs, generator=gen)
    query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen)
    allowed = _allowed()
    kv_len = torch.tensor([KV_LEN], dtype=length_dtype)
    keys[:, KV_LEN:] = float("nan")
    first = packed_flash_decode(query, keys, values, allowed, kv_len, SCALING, layout, 2)
    keys[:, KV_LEN] = torch.randn(BATCH, ks, generator=gen)  # the step's new token, written in place
    allowed[:, KV_LEN] = True
    kv_len += 1
    second = packed_flash_decode(query, keys, values, allowed, kv_len, SCALING, layout, 2)
    n = KV_LEN + 1
    ref = packed_attention(
        query[:, None].double(),
        keys[:, None, :n].double(),
        values[:, None, :n].double(),
        allowed[:, None, None, :n],
        SCALING,
        layout,
    )[:, 0]
    _check(second, ref, torch.float32)
    assert not torch.allclose(first, second)
    assert packed_plan(layout, BATCH, S_CAP, 4, "cpu", 2) == packed_plan(layout, BATCH, S_CAP, 4, "cpu", 2)


def test_fully_masked_request_gives_zeros():
    """A request with no allowed slot (a padding row) gets zeros, never NaN, split or not."""
    layout = PackedLayout((8, 4), (4, 8), 1)
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(BATCH, S_CAP, 12, generator=gen)
    values = torch.randn(BATCH, S_CAP, 12, generator=gen)
    query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen)
    allowed = _allowed()
    allowed[0] = False
    for splits in (1, 3):
        out = packed_flash_decode(query, keys, values, allowed, torch.tensor([KV_LEN]), SCALING, layout, splits)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0


# ---- latent keys, rebuilt and rotated inside the kernel ----------------------------------------------------------


def _rope_tables(s_cap: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos / sin for positions 0..s_cap-1 (the frequencies duplicated over both halves)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(s_cap, dtype=torch.float64)[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _latent_reference(query, latents, values, allowed, layout, k_up, cos, sin, kv_len):
    """Keys rebuilt densely (latent @ k_up[g, :rk], then RoPE at the slot's position), softmax per query head."""
    batch, g = query.shape[0], layout.group_size
    queries = query.double().view(batch, -1, k_up.shape[-1])
    outs = []
    for h, (rk, rv) in enumerate(zip(layout.key_ranks, layout.value_ranks)):
        ko, vo = layout.key_offsets[h], layout.value_offsets[h]
        k = latents[:, :kv_len, ko : ko + rk].double() @ k_up[h, :rk].double()
        k = k * cos[:kv_len] + _rotate_half(k) * sin[:kv_len]
        scores = queries[:, h * g : (h + 1) * g] @ k.transpose(1, 2) * SCALING
        scores = scores.masked_fill(~allowed[:, None, :kv_len], float("-inf"))
        outs.append((scores.softmax(-1) @ values[:, :kv_len, vo : vo + rv].double()).reshape(batch, g * rv))
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("ranks", LATENT_LAYOUTS, ids=["gqa3-rank0", "mha-uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", SPLITS)
def test_latent_matches_reference(ranks, dtype, splits):
    layout = PackedLayout(*ranks)
    n_kv = len(layout.key_ranks)
    gen = torch.Generator().manual_seed(hash((ranks, splits, 1)) % 2**31)
    ks, vs = sum(layout.key_ranks), sum(layout.value_ranks)
    buffer = _cache_buffer(ks + vs, dtype, gen)
    latents, values = buffer[:, 0, :, :ks], buffer[:, 0, :, ks : ks + vs]
    k_up = (torch.randn(n_kv, HEAD_DIM, HEAD_DIM, generator=gen) / HEAD_DIM**0.5).to(dtype)
    query = torch.randn(BATCH, n_kv * layout.group_size * HEAD_DIM, generator=gen).to(dtype)
    cos, sin = _rope_tables(S_CAP, HEAD_DIM)
    cos, sin = cos.to(dtype), sin.to(dtype)
    allowed = _allowed()
    ref = _latent_reference(query, latents, values, allowed, layout, k_up, cos.double(), sin.double(), KV_LEN)
    _poison(buffer)
    cos[KV_LEN:] = float("nan")  # positions past the live length are never read either
    sin[KV_LEN:] = float("nan")
    out = latent_flash_decode(
        query, latents, values, allowed, torch.tensor([KV_LEN]), SCALING, layout, k_up, cos, sin, splits
    )
    _check(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_reads_both_rope_halves_when_told(dtype):
    """Tables whose halves differ (not HF's, which repeat the frequencies): rope_halves_equal=False reads both."""
    layout = PackedLayout((12, 20), (8, 16), 3)
    gen = torch.Generator().manual_seed(11)
    ks, vs = sum(layout.key_ranks), sum(layout.value_ranks)
    latents = torch.randn(BATCH, S_CAP, ks, generator=gen).to(dtype)
    values = torch.randn(BATCH, S_CAP, vs, generator=gen).to(dtype)
    k_up = (torch.randn(2, HEAD_DIM, HEAD_DIM, generator=gen) / HEAD_DIM**0.5).to(dtype)
    query = torch.randn(BATCH, 2 * 3 * HEAD_DIM, generator=gen).to(dtype)
    angles = torch.rand(S_CAP, HEAD_DIM, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    allowed = _allowed()
    ref = _latent_reference(query, latents, values, allowed, layout, k_up, cos.double(), sin.double(), KV_LEN)
    out = latent_flash_decode(
        query,
        latents,
        values,
        allowed,
        torch.tensor([KV_LEN]),
        SCALING,
        layout,
        k_up,
        cos,
        sin,
        2,
        rope_halves_equal=False,
    )
    _check(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_window_mode_on_padded_rows(dtype):
    """Unaligned latent / value offsets over rows padded to 16 bytes (window mode), NaN in the row padding."""
    layout = PackedLayout((5, 11, 6), (3, 9, 7), 3)
    n_kv = 3
    gen = torch.Generator().manual_seed(29)
    ks, vs, padded = sum(layout.key_ranks), sum(layout.value_ranks), 24
    latent_rows = torch.randn(BATCH, S_CAP, padded, generator=gen).to(dtype)
    value_rows = torch.randn(BATCH, S_CAP, padded, generator=gen).to(dtype)
    latents, values = latent_rows[..., :ks], value_rows[..., :vs]
    k_up = (torch.randn(n_kv, HEAD_DIM, HEAD_DIM, generator=gen) / HEAD_DIM**0.5).to(dtype)
    query = torch.randn(BATCH, n_kv * 3 * HEAD_DIM, generator=gen).to(dtype)
    cos, sin = (t.to(dtype) for t in _rope_tables(S_CAP, HEAD_DIM))
    allowed = _allowed()
    ref = _latent_reference(query, latents, values, allowed, layout, k_up, cos.double(), sin.double(), KV_LEN)
    latent_rows[..., ks:] = float("nan")
    value_rows[..., vs:] = float("nan")
    assert tile_columns(layout.key_offsets, latents)[1] and tile_columns(layout.value_offsets, values)[1]
    out = latent_flash_decode(
        query, latents, values, allowed, torch.tensor([KV_LEN]), SCALING, layout, k_up, cos, sin, 2
    )
    _check(out, ref, dtype)


# ---- absorbed MLA ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,rank,rope_dim", [(5, 24, 8), (1, 16, 16)], ids=["h5-r24", "h1-r16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", SPLITS)
def test_mla_matches_reference(heads, rank, rope_dim, dtype, splits):
    gen = torch.Generator().manual_seed(hash((heads, splits, 2)) % 2**31)
    buffer = _cache_buffer(rank + rope_dim, dtype, gen)
    rows = buffer[:, 0, :, : rank + rope_dim]
    # Queries as a view too: [B, H, r + d_r] inside a wider per-head buffer.
    q_rows = torch.randn(BATCH, heads, rank + rope_dim + 5, generator=gen).to(dtype)[..., : rank + rope_dim]
    allowed = _allowed()
    scores = q_rows.double() @ rows[:, :KV_LEN].double().transpose(1, 2) * SCALING
    scores = scores.masked_fill(~allowed[:, None, :KV_LEN], float("-inf"))
    ref = scores.softmax(-1) @ rows[:, :KV_LEN, :rank].double()
    _poison(buffer)
    out = mla_flash_decode(q_rows, rows, allowed, torch.tensor(KV_LEN), SCALING, rank, splits)
    _check(out, ref, dtype)


# ---- the split plan -----------------------------------------------------------------------------------------------


def test_heavy_heads_get_more_splits_and_no_chosen_split_is_empty():
    work = (129, 65, 33, 1)  # rk + rv + 1 of ranks 64+64, 32+32, 16+16, 0+0
    plan = plan_splits(work, 1, 4096, 64, "cpu", splits=8)
    assert plan.splits == (8, 4, 2, 1)
    assert [c * n >= 4096 for c, n in zip(plan.chunks, plan.splits)] == [True] * 4
    per_program = [plan.chunks[h] * work[h] for h, _ in plan.tasks(work)]
    assert per_program == sorted(per_program, reverse=True)  # heaviest programs launch first
    split_heads = [plan.chunks[h] * work[h] for h, n in enumerate(plan.splits) if n > 1]
    assert max(split_heads) < 1.1 * min(split_heads)  # every split head's programs carry about the same bytes
    assert max(per_program) == max(split_heads)  # ... and no unsplit light head carries more
    chosen = plan_splits(work, 2, 8192, 64, "cpu")
    for chunk, n in zip(chosen.chunks, chosen.splits):
        assert (n - 1) * chunk < 8192 <= n * chunk  # every split of a chosen plan starts inside the cache
    assert chosen.splits[0] > chosen.splits[-1]


def test_split_count_fills_the_device_in_whole_waves():
    """Without partial costs the best count fills one wave of the device's resident slots exactly; programs that
    already fill it are not split; no split is shorter than the minimum; partial costs stop splitting early."""
    assert choose_splits(64, 8192, 32, slots=132, partial_share=0.0) == 2  # 128 of 132 slots, one wave
    assert choose_splits(128, 8192, 64, slots=528, partial_share=0.0) == 4
    assert choose_splits(512, 8192, 64, slots=528, partial_share=0.0) == 1
    assert choose_splits(1, 1024, 16, slots=132, partial_share=0.0) == 4  # 256-slot minimum
    assert choose_splits(1, 1024, 16, slots=132, partial_share=0.0, min_split_tokens=16) == 64
    assert choose_splits(1, 1 << 20, 64, slots=132, partial_share=0.0) == 128  # the cap
    # A split that costs as much as a tenth of the task: fewer splits than the slots would take.
    assert choose_splits(4, 8192, 64, slots=132, partial_share=0.1) < 33


# ---- CUDA graphs (GPU only: the capture needs a device) -----------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("form", ["packed", "latent", "mla"])
def test_captured_step_replays_as_the_cache_grows(form):
    """One decode call captured in a CUDA graph, replayed after a new slot is written and kv_len bumped in place:
    the replay attends the new slot (the kernels read kv_len from memory and sync nothing with the host)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(13)
    s_cap, start = 4096, 1000
    # latent keys are rebuilt through k_up's HEAD_DIM rows: ranks at most HEAD_DIM there
    layout = PackedLayout((32, 16), (16, 32), 4) if form == "latent" else PackedLayout((64, 32), (32, 64), 4)
    ks, vs = sum(layout.key_ranks), sum(layout.value_ranks)
    rank, heads = 64, 8
    width = {"packed": ks + vs, "latent": ks + vs, "mla": rank + 16}[form]
    cache = torch.randn(BATCH, s_cap, width, generator=gen).to(device, dtype)
    allowed = torch.zeros(BATCH, s_cap, dtype=torch.bool, device=device)
    allowed[:, :start] = True
    kv_len = torch.tensor([start], device=device)
    k_up = (torch.randn(2, HEAD_DIM, HEAD_DIM, generator=gen) / HEAD_DIM**0.5).to(device, dtype)
    cos, sin = (t.to(device, dtype) for t in _rope_tables(s_cap, HEAD_DIM))
    if form == "packed":
        query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen).to(device, dtype)

        def step():
            return packed_flash_decode(query, cache[..., :ks], cache[..., ks:], allowed, kv_len, SCALING, layout)
    elif form == "latent":
        query = torch.randn(BATCH, 2 * layout.group_size * HEAD_DIM, generator=gen).to(device, dtype)

        def step():
            return latent_flash_decode(
                query, cache[..., :ks], cache[..., ks:], allowed, kv_len, SCALING, layout, k_up, cos, sin
            )
    else:
        query = torch.randn(BATCH, heads, width, generator=gen).to(device, dtype)

        def step():
            return mla_flash_decode(query, cache, allowed, kv_len, SCALING, rank)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels and builds the tables before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):  # a decode step: the new token's slot written in place, then the captured attention
        cache[:, kv_len.item()] = torch.randn(BATCH, width, generator=gen).to(device, dtype)
        allowed[:, kv_len.item()] = True
        kv_len += 1
        graph.replay()
        expected = step()
        torch.testing.assert_close(captured, expected, rtol=0, atol=0)
    n = start + 3
    if form == "packed":
        ref = packed_attention(
            query[:, None].double(),
            cache[:, None, :n, :ks].double(),
            cache[:, None, :n, ks:].double(),
            allowed[:, None, None, :n],
            SCALING,
            layout,
        )[:, 0]
    elif form == "latent":
        ref = _latent_reference(
            query, cache[..., :ks], cache[..., ks:], allowed, layout, k_up, cos.double(), sin.double(), n
        )
    else:
        scores = query.double() @ cache[:, :n].double().transpose(1, 2) * SCALING
        ref = scores.softmax(-1) @ cache[:, :n, :rank].double()
    _check(captured, ref, dtype)


def test_the_mask_argument_is_a_view_in_eager_mode_and_a_conversion_in_a_compiled_graph():
    """A compiled decode step must not bitcast bool to int8 (the likely cause of the H200 run's inductor failures,
    mask_argument); eager steps must not copy the mask."""
    allowed = torch.rand(3, 37) > 0.4
    eager = mask_argument(allowed)
    assert eager.dtype == torch.int8 and eager.data_ptr() == allowed.data_ptr()
    assert torch.equal(eager, allowed.to(torch.int8))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(scores: torch.Tensor) -> torch.Tensor:
        return mask_argument(scores > 0.4)

    torch._dynamo.reset()
    scores = torch.rand(3, 37)
    compiled = torch.compile(step, backend=record, fullgraph=True)(scores)
    assert torch.equal(compiled, (scores > 0.4).to(torch.int8))
    calls = [
        (node.target, node.args[1:]) for node in graphs[0].graph.nodes if node.op in ("call_method", "call_function")
    ]
    assert not any(target == "view" for target, _ in calls), calls
    assert any(target == "to" and torch.int8 in args for target, args in calls), calls
