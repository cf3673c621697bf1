"""The KIVI (int4 / int2) flash-decoding kernel against the dense float64 reference, on CPU under TRITON_INTERPRET=1.

The store is a preallocated one: room for N_CAP coded blocks of which N_CODED are live, and a window buffer of
W_CAP float16 tokens of which WINDOW_LEN are live, both counts given as device tensors; the unused blocks hold
random codes and NaN scales, the unused window slots NaN, so a kernel that reads past either count fails. The
reference decodes the live blocks with the codec's own decode (codecs.kivi) and attends densely.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed")

from kvrewrite.runtime.codecs.kivi import kivi_decode, kivi_encode  # noqa: E402
from kvrewrite.runtime.codecs.readout import QuantizedBlocks  # noqa: E402
from kvrewrite.runtime.kernels.flash_decode_coded import coded_flash_decode  # noqa: E402
from kvrewrite.runtime.kernels.flash_decode_splits import interpreting  # noqa: E402
from kvrewrite.runtime.kernels.reference import PackedLayout, packed_attention  # noqa: E402

BATCH, G, N_CAP, N_CODED, W_CAP, WINDOW_LEN, PAD = 2, 16, 5, 3, 40, 21, 3
S_CAP = N_CAP * G + W_CAP
SCALING = 0.3
FP32_TOLERANCE = 1e-5 if interpreting() else 2e-3  # compiled fp32 dots run in tf32
# Even offsets (4-bit codes read a byte per column pair) and odd ones (a load per code), GQA 3 and MHA.
LAYOUTS = [((6, 12, 0), (10, 0, 4), 3), ((5, 16), (7, 4), 1)]


def _store(x: torch.Tensor, side: str, bits: int, value_group: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The live blocks coded by the codec, then N_CAP - N_CODED blocks of garbage (random codes, NaN scales)."""
    live = kivi_encode(x.float().reshape(BATCH, N_CODED, G, -1), side, bits, value_group)
    store = {}
    for name, t in live.items():
        spare_shape = (t.shape[0], N_CAP - N_CODED, *t.shape[2:])
        if t.dtype == torch.uint8:
            spare = torch.randint(0, 256, spare_shape, generator=gen, dtype=torch.uint8)
        else:
            spare = torch.full(spare_shape, float("nan"), dtype=t.dtype)
        store[name] = torch.cat([t, spare], dim=1).contiguous()
    return store


@pytest.mark.parametrize("ranks", LAYOUTS, ids=["gqa3-rank0-even", "mha-odd"])
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2, 7, None])
def test_coded_matches_reference(ranks, bits, dtype, splits):
    layout = PackedLayout(*ranks)
    gen = torch.Generator().manual_seed(hash((ranks, bits, splits)) % 2**31)
    ck, cv = sum(layout.key_ranks), sum(layout.value_ranks)
    value_group = 8  # groups cross KV-head boundaries
    blocks = QuantizedBlocks(bits, G, value_group)
    coded_keys = torch.randn(BATCH, N_CODED * G, ck, generator=gen)
    coded_values = torch.randn(BATCH, N_CODED * G, cv, generator=gen)
    keys = _store(coded_keys, "key", bits, value_group, gen)
    values = _store(coded_values, "value", bits, value_group, gen)
    key_window = torch.randn(BATCH, W_CAP, ck, generator=gen).half()
    value_window = torch.randn(BATCH, W_CAP, cv, generator=gen).half()
    query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen).to(dtype)
    length = N_CODED * G + WINDOW_LEN
    allowed = torch.zeros(BATCH, S_CAP, dtype=torch.bool)
    allowed[:, :length] = True
    allowed[1, :PAD] = False  # left padding

    live_keys = {n: t[:, :N_CODED] for n, t in keys.items()}
    live_values = {n: t[:, :N_CODED] for n, t in values.items()}
    dense_keys = torch.cat(
        [
            kivi_decode(live_keys, "key", bits, value_group, G, ck).reshape(BATCH, -1, ck).double(),
            key_window[:, :WINDOW_LEN].double(),
        ],
        dim=1,
    )
    dense_values = torch.cat(
        [
            kivi_decode(live_values, "value", bits, value_group, G, cv).reshape(BATCH, -1, cv).double(),
            value_window[:, :WINDOW_LEN].double(),
        ],
        dim=1,
    )
    ref = packed_attention(
        query[:, None].double(),
        dense_keys[:, None],
        dense_values[:, None],
        allowed[:, None, None, :length],
        SCALING,
        layout,
    )[:, 0]
    key_window[:, WINDOW_LEN:] = float("nan")
    value_window[:, WINDOW_LEN:] = float("nan")

    out = coded_flash_decode(
        query,
        blocks,
        keys,
        values,
        key_window,
        value_window,
        allowed,
        torch.tensor([N_CODED]),
        torch.tensor([WINDOW_LEN]),
        SCALING,
        layout,
        splits,
    )
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
    error = (out.double() - ref).norm() / ref.norm()
    assert error < (1.5e-2 if dtype == torch.bfloat16 else FP32_TOLERANCE), error


def test_coded_without_counts_reads_every_block_and_window_slot():
    """n_coded / window_len None: all N_CAP blocks and W_CAP window tokens are live."""
    layout = PackedLayout((8, 8), (8, 8), 3)
    gen = torch.Generator().manual_seed(17)
    blocks = QuantizedBlocks(4, G, 8)
    x_keys = torch.randn(BATCH, N_CAP * G, 16, generator=gen)
    x_values = torch.randn(BATCH, N_CAP * G, 16, generator=gen)
    keys = kivi_encode(x_keys.reshape(BATCH, N_CAP, G, 16), "key", 4, 8)
    values = kivi_encode(x_values.reshape(BATCH, N_CAP, G, 16), "value", 4, 8)
    key_window = torch.randn(BATCH, W_CAP, 16, generator=gen).half()
    value_window = torch.randn(BATCH, W_CAP, 16, generator=gen).half()
    query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen)
    allowed = torch.ones(BATCH, S_CAP, dtype=torch.bool)
    dense_keys = torch.cat(
        [kivi_decode(keys, "key", 4, 8, G, 16).reshape(BATCH, -1, 16).double(), key_window.double()], dim=1
    )
    dense_values = torch.cat(
        [kivi_decode(values, "value", 4, 8, G, 16).reshape(BATCH, -1, 16).double(), value_window.double()], dim=1
    )
    ref = packed_attention(query[:, None].double(), dense_keys[:, None], dense_values[:, None], None, SCALING, layout)[
        :, 0
    ]
    for splits in (1, 3):
        out = coded_flash_decode(
            query, blocks, keys, values, key_window, value_window, allowed, None, None, SCALING, layout, splits
        )
        assert ((out.double() - ref).norm() / ref.norm()) < FP32_TOLERANCE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_captured_coded_step_replays_as_the_window_and_store_grow():
    """One call captured in a CUDA graph; between replays a window token is written and window_len bumped, and once
    a block is coded (n_coded + 1, window_len one block shorter): each replay equals an eager call bit for bit."""
    device = torch.device("cuda")
    layout = PackedLayout((64, 32), (32, 64), 4)
    gen = torch.Generator().manual_seed(19)
    block = 32
    blocks = QuantizedBlocks(4, block, 32)
    n_cap, w_cap = 64, 96
    ck = cv = 96
    x = torch.randn(BATCH, n_cap, block, ck, generator=gen)
    keys = {n: t.to(device) for n, t in kivi_encode(x, "key", 4, 32).items()}
    values = {n: t.to(device) for n, t in kivi_encode(x.flip(-1), "value", 4, 32).items()}
    key_window = torch.randn(BATCH, w_cap, ck, generator=gen).half().to(device)
    value_window = torch.randn(BATCH, w_cap, cv, generator=gen).half().to(device)
    query = torch.randn(BATCH, layout.query_offsets[-1], generator=gen).to(device, torch.bfloat16)
    allowed = torch.ones(BATCH, n_cap * block + w_cap, dtype=torch.bool, device=device)
    n_coded = torch.tensor([40], device=device)
    window_len = torch.tensor([50], device=device)

    def step():
        return coded_flash_decode(
            query, blocks, keys, values, key_window, value_window, allowed, n_coded, window_len, SCALING, layout
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    first = step().clone()
    for grow in ("window", "window", "block"):
        if grow == "window":
            window_len += 1
        else:
            n_coded += 1
            window_len -= block
        graph.replay()
        torch.testing.assert_close(captured, step(), rtol=0, atol=0)
    assert not torch.equal(captured, first)
