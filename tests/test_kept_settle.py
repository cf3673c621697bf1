"""The decode-step settle kernel (runtime.tiers.kept_settle) against the torch settle, under TRITON_INTERPRET=1.

- Whole decodes: a latent-key model with re-scored eviction decodes teacher-forced tokens, once settling in the
  kernel and once in torch (attention in torch both times, so the same evidence), the requests
  swapped midway as beam search does. After every step each layer's kept store is the same row for row: positions,
  codes, scales and minimums.
- Where it must not apply (a floor, a held context, no evidence, groups that split a byte), the torch settle runs.
- The kernel alone, against tiers.eviction's own functions: the moving token's codes against encode_tokens of its
  code space (with values halfway between two codes, and a constant group), and the row it frees against the top mask over the kept rows and the moving token, with ties among
  the kept rows and a moving token tied with the lowest, or below it (then nothing is written).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed")

from test_tiers import compiled  # noqa: E402, F401  (compiled: the fixture)
from tiny_models import random_windows  # noqa: E402

import kvrewrite  # noqa: E402
from kvrewrite.runtime.tiers import eviction, kept_settle  # noqa: E402
from kvrewrite.runtime.tiers.cache import prefix_columns  # noqa: E402

PROMPT, STEPS, PAD, REORDER_AT = 23, 14, 3, 9


def _stores_by_step(
    model, tokens, in_kernel: bool, monkeypatch, capacity: int | None = None
) -> tuple[list[list[dict]], int]:
    """Each layer's kept store (a copy) after every decode step, and how many layer steps settled in the kernel.
    capacity: as generate() sizes the cache (the stores' buffers allocated once), or None (they hold their rows).

    Attention runs in torch in both runs (the same evidence; the kernels' attention against torch's is
    tests/test_kept_decode.py's), the settle kernel as on CUDA."""
    monkeypatch.setenv("KVREWRITE_ATTENTION", "torch")
    monkeypatch.setattr(kept_settle, "resolve_backend", lambda device: "triton")
    calls = []

    def settle(layer, beyond):
        done = kept_settle.settle_in_kernel(layer, beyond) if in_kernel else False
        calls.append(done)
        return done

    monkeypatch.setattr(eviction, "settle_in_kernel", settle)
    prompt, forced = tokens[:, :PROMPT], tokens[:, PROMPT:]
    mask = torch.ones(prompt.shape, dtype=torch.long)
    mask[1, :PAD] = 0  # request 1 left-padded
    cache = model.make_kv_cache(capacity)
    steps = []
    with torch.no_grad():
        model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
        for step in range(forced.shape[1]):
            if step == REORDER_AT:  # beam search swaps the requests: the stores and channel statistics reordered
                cache.reorder_cache(torch.tensor([1, 0]))
                mask, forced = mask[[1, 0]], forced[[1, 0]]
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], dim=1)
            model(forced[:, step : step + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            steps.append([{n: t.clone() for n, t in layer._store("kept").items()} for layer in cache.layers])
    return steps, sum(calls)


@pytest.mark.parametrize(
    "rate, evict, capacity",
    [
        (0.0, {"keep": 0.5, "bits": (8, 4)}, None),  # the frontier's recipe form
        (0.0, {"keep": 0.5, "bits": (8, 4)}, PROMPT + STEPS),  # its buffers allocated once, as generate() does
        (0.5, {"keep": 0.4, "bits": (4, 2), "group_size": 8}, None),  # cut ranks, several groups per head
        (0.0, {"keep": 0.3, "bits": 8, "observed_queries": 1}, None),
        (0.0, {"keep": 0.5, "bits": (8, 4), "sinks": 5}, None),  # the first 5 cache positions kept (pads too)
    ],
)
def test_the_kernel_settles_as_the_torch_settle(compiled, monkeypatch, rate, evict, capacity):
    model = kvrewrite.load(compiled["latent"], rate=rate, recent_window=4, kv_codec="none", evict=evict).eval()
    tokens = random_windows(n=2, length=PROMPT + STEPS, seed=53)
    fast, kernel_steps = _stores_by_step(model, tokens, True, monkeypatch, capacity)
    slow, _ = _stores_by_step(model, tokens, False, monkeypatch, capacity)
    layers = len(fast[0])
    # Every decode step of every layer (the prefill's settle, in torch, set the channel statistics).
    assert kernel_steps == STEPS * layers
    evicting_steps = 0
    for step, (mine, theirs) in enumerate(zip(fast, slow)):
        for layer, (a, b) in enumerate(zip(mine, theirs)):
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), (step, layer, name)
            if step and a["positions"].shape[-1] == fast[step - 1][layer]["positions"].shape[-1]:
                evicting_steps += 1
    assert evicting_steps >= STEPS  # the runs exercise both kinds of step


def _layer(ranks=(6, 4), value_ranks=(4, 4), bits=(8, 4), group_size=4, n_old=9, batch=2, seed=0):
    """An evicting layer with a window of 2 + the moving token, n_old kept rows and its channel statistics set."""
    gen = torch.Generator().manual_seed(seed)
    d = 8
    layer = eviction.EvictingLayer(2, d, ranks, value_ranks, keep=0.5, bits=bits, group_size=group_size)
    window = torch.randn(batch, 1, 3, len(ranks) * d, generator=gen) * 3 + 1
    layer.lazy_initialization(window, window)
    layer.keys, layer.values = window, torch.randn(batch, 1, 3, len(ranks) * d, generator=gen)
    stats = {}
    for side, side_ranks in (("key", ranks), ("value", value_ranks)):
        channels = sum(side_ranks)
        stats[side + "_mean"] = torch.randn(batch, channels, generator=gen).half()
        stats[side + "_rms"] = (torch.rand(batch, channels, generator=gen) + 0.5).half()
    layer.channel_stats = stats
    moving = torch.randn(batch, n_old, sum(ranks), generator=gen)
    coded = [
        eviction.encode_tokens(moving[..., : sum(r)], b, group_size)
        for r, b in ((ranks, bits[0]), (value_ranks, bits[1]))
    ]
    layer._set_store(
        "kept", eviction._flat(*coded, torch.randperm(40, generator=gen)[:n_old].int()[None].repeat(batch, 1))
    )
    layer.cumulative_length = 50
    return layer


def _code_space_row(layer, side: str) -> dict[str, torch.Tensor]:
    """What the torch settle stores for the window's oldest token: its code space, encoded."""
    ranks = layer.kept_key_ranks if side == "key" else layer.kept_value_ranks
    window = layer.keys if side == "key" else layer.values
    columns = torch.tensor(prefix_columns(layer.head_dim, ranks))
    x = layer._to_code_space(window[:, 0, :1][..., columns], side)
    return eviction.encode_tokens(x, layer.side_bits[side], layer.group_size)


def _settle(layer, scores=None, moving=None) -> None:
    from kvrewrite.runtime.kernels.kept_settle_kernel import settle_moving_token

    store = layer._store("kept")
    n_old = store["positions"].shape[-1]
    if scores is None:  # a row past the end
        store = {n: torch.cat([t, t[:, :1]], dim=1) for n, t in store.items()}
        layer._set_store("kept", store)
    settle_moving_token(
        layer.keys[:, 0, 0], layer.values[:, 0, 0], kept_settle._tables(layer), layer.channel_stats, layer.side_bits,
        layer.group_size, store, n_old, 47, scores, moving,
    )  # fmt: skip


@pytest.mark.parametrize("bits, group_size", [((8, 4), 4), ((4, 2), 8), ((2, 8), 16)])
def test_the_moving_token_is_coded_as_encode_tokens_codes_it(bits, group_size):
    """Groups that span heads and a last group shorter than the others (10 key channels in groups of 4, 8, 16)."""
    layer = _layer(bits=bits, group_size=group_size)
    expected = {side: _code_space_row(layer, side) for side in ("key", "value")}
    _settle(layer)
    store = layer._store("kept")
    assert store["positions"][:, -1].tolist() == [47, 47]
    for side in ("key", "value"):
        for name, want in expected[side].items():
            torch.testing.assert_close(store[f"{side}.{name}"][:, -1:], want, rtol=0, atol=0)


@pytest.mark.parametrize("rows_block", [256, 4])
def test_the_row_freed_is_the_one_the_top_mask_drops(monkeypatch, rows_block):
    """Against tiers.eviction._top_mask over the kept rows and the moving token (the newest): ties among the kept
    rows (within one block of the scan and across blocks), the moving token tied with the lowest, and below it."""
    from kvrewrite.runtime.kernels import kept_settle_kernel

    monkeypatch.setattr(kept_settle_kernel, "ROWS_BLOCK", rows_block)
    for case in range(4):
        layer = _layer(seed=case)
        store = {n: t.clone() for n, t in layer._store("kept").items()}
        positions = store["positions"]
        n_old = positions.shape[-1]
        gen = torch.Generator().manual_seed(10 + case)
        scores = torch.randint(0, 3, (2, n_old), generator=gen).float()  # many ties
        moving = torch.tensor([[1.0, 0.0], [0.0, -1.0], [5.0, 5.0], [0.0, 0.0]][case])
        if case == 3:
            scores[1] = 2.0  # every kept row tied above the moving token's 0: the moving token goes
        expected_rows = {side: _code_space_row(layer, side) for side in ("key", "value")}
        _settle(layer, scores, moving)
        after = layer._store("kept")
        everyone = torch.cat([positions, torch.full((2, 1), 47, dtype=positions.dtype)], dim=1)
        stays = eviction._top_mask(torch.cat([scores, moving[:, None]], dim=1), everyone, n_old)
        for b in range(2):
            dropped = (~stays[b]).nonzero()[:, 0].tolist()
            assert len(dropped) == 1
            if dropped[0] == n_old:  # the moving token: the store is unchanged
                for name in store:
                    assert torch.equal(after[name][b], store[name][b]), (case, b, name)
                continue
            row = dropped[0]
            assert after["positions"][b, row] == 47
            for name in store:
                keep = [r for r in range(n_old) if r != row]
                assert torch.equal(after[name][b, keep], store[name][b, keep])
            for side in ("key", "value"):
                for name, want in expected_rows[side].items():
                    assert torch.equal(after[f"{side}.{name}"][b, row], want[b, 0]), (case, b, side, name)


def test_halfway_values_and_a_constant_group_are_coded_as_torch_codes_them():
    """Identity maps (no centring, no turn), so the quantizer meets chosen values: a group spanning 0..15 at 4 bits
    (scale 1) holding 0.5, 1.5, 2.5 and 14.5 (torch rounds half to even: 0, 2, 2, 14) and a constant group (the
    scale's floor)."""
    layer = _layer(ranks=(8, 8), value_ranks=(8, 8), bits=(4, 4), group_size=8)
    layer.rotations = {8: torch.eye(8)}
    layer.settle_tables = None
    for side in ("key", "value"):
        layer.channel_stats[side + "_mean"].zero_()
        layer.channel_stats[side + "_rms"].fill_(1.0)
    d = layer.head_dim
    halfway = torch.tensor([0.0, 15.0, 0.5, 1.5, 2.5, 14.5, 7.0, 3.0])
    for window in (layer.keys, layer.values):
        window[:, 0, 0, :8] = halfway  # head 0's kept channels: group 0
        window[:, 0, 0, d : d + 8] = 0.25  # head 1's: group 1, constant
    expected = {side: _code_space_row(layer, side) for side in ("key", "value")}
    assert expected["key"]["codes"][0, 0, 1] == 2 << 4  # 0.5 -> 0 and 1.5 -> 2, packed lowest first
    _settle(layer)
    store = layer._store("kept")
    for side in ("key", "value"):
        for name, want in expected[side].items():
            assert torch.equal(store[f"{side}.{name}"][:, -1:], want), (side, name)


def test_the_kernel_settle_declines_where_it_does_not_apply(monkeypatch):
    monkeypatch.setenv("KVREWRITE_ATTENTION", "triton")

    def ready(**changes):
        layer = _layer()  # a window of 2 holding 3 rows: one token leaves
        layer._received_kept = torch.zeros(2, layer.kept_positions.shape[-1])
        layer._received_recent = torch.zeros(2, 3)
        layer.keep = 1.0  # no eviction: one more row
        for name, value in changes.items():
            setattr(layer, name, value)
        return layer

    assert kept_settle._applies(ready(), 1)
    assert not kept_settle._applies(ready(), 2)  # more than one token leaves (a prefill chunk)
    assert not kept_settle._applies(ready(holding=True), 1)
    assert not kept_settle._applies(ready(floor_key_ranks=(2, 2)), 1)
    assert not kept_settle._applies(ready(channel_stats=None), 1)  # the first settle sets the statistics
    assert not kept_settle._applies(ready(group_size=3), 1)  # 3 channels x 8 bits: fine; x 4 bits splits a byte
    monkeypatch.setenv("KVREWRITE_ATTENTION", "torch")
    assert not kept_settle._applies(ready(), 1)
    # An evicting step without the evidence to choose its row by: the torch settle decides.
    monkeypatch.setenv("KVREWRITE_ATTENTION", "triton")
    layer = ready(keep=9 / 48, _received_kept=None)  # the budget round(keep x 48 beyond) = the 9 rows held
    assert not kept_settle.settle_in_kernel(layer, 1)
