"""The kept-tier decode kernels (runtime.tiers.kept_decode) against the torch tiered path, under TRITON_INTERPRET=1.

A latent-key model with re-scored eviction is prefilled (the torch path: several queries per sequence), then decodes
teacher-forced tokens one at a time, once with the kernels (KVREWRITE_ATTENTION=triton) and once with torch buckets:
every step's logits agree, and so do the tokens each layer keeps, which the kernels' probabilities decide. Batch 2
with request 1 left-padded; full rank and cut ranks; 8/4, 4/2 and 8/8 bits; one group per token and several.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed")

from test_tiers import compiled  # noqa: E402, F401  (compiled: the fixture)
from tiny_models import random_windows  # noqa: E402

import kvrewrite  # noqa: E402
from kvrewrite.runtime.tiers import attention as tiered  # noqa: E402  (where tiered_attention finds the kernel path)

PROMPT, STEPS, PAD = 29, 7, 3


def _decode(model, prompt, forced, backend, monkeypatch) -> tuple[list[torch.Tensor], object, int]:
    """Logits of the prefill's last token and of every forced step, the cache, and how many layer steps the
    kept-tier kernels ran."""
    monkeypatch.setenv("KVREWRITE_ATTENTION", backend)
    calls = []
    original = tiered.kept_decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tiered, "kept_decode_attention", counted)
    mask = torch.ones(prompt.shape, dtype=torch.long)
    mask[1, :PAD] = 0
    cache = model.make_kv_cache()
    logits = []
    with torch.no_grad():
        out = model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        for step in range(forced.shape[1]):
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], dim=1)
            out = model(forced[:, step : step + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    monkeypatch.setattr(tiered, "kept_decode_attention", original)
    return logits, cache, len(calls)


@pytest.mark.parametrize(
    "rate, evict",
    [
        (0.0, {"keep": 0.5, "bits": (8, 4)}),  # the frontier's recipe form: full rank, 8-bit keys, 4-bit values
        (0.5, {"keep": 0.4, "bits": (4, 2), "group_size": 8}),  # cut ranks, several groups per head
        (0.0, {"keep": 0.3, "bits": 8, "observed_queries": 1}),
    ],
)
def test_kept_tier_kernels_decode_as_the_torch_path(compiled, monkeypatch, rate, evict):
    model = kvrewrite.load(compiled["latent"], rate=rate, recent_window=4, kv_codec="none", evict=evict).eval()
    tokens = random_windows(n=2, length=PROMPT + STEPS, seed=51)
    prompt, forced = tokens[:, :PROMPT], tokens[:, PROMPT:]
    fast, fast_cache, kernel_steps = _decode(model, prompt, forced, "triton", monkeypatch)
    slow, slow_cache, torch_steps = _decode(model, prompt, forced, "torch", monkeypatch)
    layers = len(fast_cache.layers)
    assert kernel_steps == STEPS * layers and torch_steps == 0  # every decode step of every layer, prefill none
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for fast_layer, slow_layer in zip(fast_cache.layers, slow_cache.layers):
        for row in range(2):
            assert sorted(fast_layer.kept_positions[row].tolist()) == sorted(slow_layer.kept_positions[row].tolist())
        assert fast_layer.kept_positions.shape[-1] > 0


def test_the_kernels_are_not_used_where_they_do_not_apply(compiled, monkeypatch):
    """A floor, keys that are not rebuilt (freq) and float16 kept tokens take the torch path."""
    tokens = random_windows(n=2, length=PROMPT + 2, seed=52)
    cases = [
        ("latent", {"keep": 0.3, "bits": (8, 4), "floor": {"key": 2, "value": 2, "bits": 4}}),
        ("freq", {"keep": 0.3, "bits": (8, 4)}),
        ("latent", {"keep": 0.3, "bits": None}),
    ]
    for mode, evict in cases:
        model = kvrewrite.load(compiled[mode], rate=0.0, recent_window=4, kv_codec="none", evict=evict).eval()
        _, _, kernel_steps = _decode(model, tokens[:, :PROMPT], tokens[:, PROMPT:], "triton", monkeypatch)
        assert kernel_steps == 0, (mode, evict)


def _packed(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., C] packed 8 // bits to a byte, lowest bits first (the kept tier's layout)."""
    per = 8 // bits
    grouped = codes.view(*codes.shape[:-1], -1, per).to(torch.int32)
    return sum(grouped[..., k] << (bits * k) for k in range(per)).to(torch.uint8)


@pytest.mark.parametrize("bits, group_size, rows_per_program", [(8, 16, 1024), (4, 8, 16), (2, 32, 16)])
def test_kernels_against_a_dense_reference(monkeypatch, bits, group_size, rows_per_program):
    """Random codes, scales and positions in no order, some positions not allowed, one chunk of rows per program or
    several: logits, softmax statistics, value sums and evidence against float64 torch."""
    from kvrewrite.runtime.kernels import kept_tier_kernels
    from kvrewrite.runtime.kernels.kept_tier_kernels import kept_key_logits, kept_weighted_values

    monkeypatch.setattr(kept_tier_kernels, "ROWS_PER_PROGRAM", rows_per_program)
    gen = torch.Generator().manual_seed(3)
    batch, rows, d, ranks, group = 2, 37, 16, (16, 8, 8), 2
    channels, heads, length = sum(ranks), group * len(ranks), 50
    codes = torch.randint(0, 1 << bits, (batch, rows, channels), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(batch, rows, channels // group_size, generator=gen) * 0.1).half()
    low = (torch.randn(batch, rows, channels // group_size, generator=gen) * 0.2).half()
    coded = {"codes": _packed(codes, bits), "scale": scale, "low": low}
    positions = torch.randperm(length, generator=gen)[:rows].int()[None].repeat(batch, 1)
    positions[1] = positions[1].flip(0)
    allowed = torch.rand(batch, length, generator=gen) > 0.2
    up = torch.randn(batch, len(ranks), max(ranks), d, generator=gen) * 0.3
    shift = torch.randn(batch, len(ranks), d, generator=gen)
    angles = torch.arange(length)[:, None] * (0.3 ** torch.arange(d // 2))[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    queries = torch.randn(batch, heads, d, generator=gen)

    latents = (codes.double() * scale.double().repeat_interleave(group_size, -1)) + low.double().repeat_interleave(
        group_size, -1
    )
    expected = torch.empty(batch, heads, rows, dtype=torch.float64)
    start = 0
    for g, r in enumerate(ranks):
        keys = latents[..., start : start + r] @ up[:, g, :r].double() + shift[:, g, None].double()  # [B, S, d]
        c, s = cos[positions.long()].double(), sin[positions.long()].double()
        rotated = keys * c + torch.cat([-keys[..., d // 2 :], keys[..., : d // 2]], -1) * s
        expected[:, g * group : (g + 1) * group] = queries[:, g * group : (g + 1) * group].double() @ rotated.mT * 0.7
        start += r
    logits, maxima, sums = kept_key_logits(
        queries, coded, positions, allowed, ranks, bits, group_size, up, shift, cos, sin, 0.7
    )
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-4)
    kept_allowed = allowed.gather(1, positions.long())[:, None]  # [B, 1, S]
    masked = expected.masked_fill(~kept_allowed, float("-inf"))
    assert maxima.shape[-1] == -(-rows // rows_per_program)
    lse_kept = (maxima.double() + sums.double().log()).logsumexp(-1)
    torch.testing.assert_close(lse_kept, masked.logsumexp(-1), rtol=1e-5, atol=1e-4)

    lse = masked.logsumexp(-1) + 0.3  # as if the window held the rest of the weight
    weights = torch.tensor([1.0, 0.5])
    for evidence_max in (False, True):
        partial, evidence = kept_weighted_values(
            logits, lse.float(), positions, allowed, weights, coded, ranks, bits, group_size, evidence_max=evidence_max
        )
        assert partial.shape[2] == -(-rows // rows_per_program)
        values = partial.sum(dim=2)  # the chunks added, as kept_window_kernels.kept_finish adds them
        probs = (masked - lse[..., None]).exp()  # [B, H, S], 0 where not allowed
        start = 0
        for g, r in enumerate(ranks):
            block = probs[:, g * group : (g + 1) * group]
            want = block @ latents[..., start : start + r]
            torch.testing.assert_close(values[:, g * group : (g + 1) * group, :r].double(), want, rtol=1e-4, atol=1e-4)
            assert not values[:, g * group : (g + 1) * group, r:].any()
            reduced = block.amax(dim=1) if evidence_max else block.sum(dim=1)
            torch.testing.assert_close(
                evidence[:, g].double(), reduced * weights[:, None].double(), rtol=1e-5, atol=1e-6
            )
            start += r


def test_window_kernels_against_a_dense_reference():
    """The window's kernels alone: queries rotated, window keys rebuilt and rotated, some window positions not
    allowed, the kept tier's chunk statistics (one chunk empty) and value sums given: rotated queries, window
    logits, lse, the kept share, the window's evidence and the output against float64 torch."""
    from kvrewrite.runtime.kernels.kept_window_kernels import kept_finish, window_finish, window_logits

    gen = torch.Generator().manual_seed(4)
    batch, n_kv, group, d, n_window, chunks, width = 2, 2, 3, 16, 5, 3, 8
    heads, first, length = n_kv * group, 20, 25
    queries = torch.randn(batch, heads, d, generator=gen)
    keys = torch.randn(batch, n_window, n_kv * d, generator=gen)
    values = torch.randn(batch, n_window, n_kv * d, generator=gen)
    up = torch.randn(n_kv, d, d, generator=gen) * 0.3
    angles = torch.arange(length)[:, None] * (0.3 ** torch.arange(d // 2))[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    allowed = torch.ones(batch, length, dtype=torch.bool)
    allowed[1, first : first + 2] = False  # the window's first two positions masked for request 1

    def rope(x, pos):
        c, s = cos[pos].double(), sin[pos].double()
        return x * c + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * s

    rotated, logits, wmax, wsum = window_logits(queries, keys, up, cos, sin, allowed, first, 0.7, torch.float32)
    q_rot = rope(queries.double(), first + n_window - 1)
    torch.testing.assert_close(rotated.double(), q_rot, rtol=1e-5, atol=1e-5)
    pos = torch.arange(first, first + n_window)
    expected = torch.empty(batch, heads, n_window, dtype=torch.float64)
    for g in range(n_kv):
        k = rope(keys[..., g * d : (g + 1) * d].double() @ up[g].double(), pos)  # [B, W, d]
        expected[:, g * group : (g + 1) * group] = q_rot[:, g * group : (g + 1) * group] @ k.mT * 0.7
    expected = expected.masked_fill(~allowed[:, None, first : first + n_window], float("-inf"))
    masked = ~allowed[:, None, first : first + n_window]
    assert bool((logits[masked.expand_as(logits)] <= -1e29).all())  # a large negative number, not -inf
    torch.testing.assert_close(logits.double().masked_fill(masked, float("-inf")), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wmax.double(), expected.amax(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((wmax.double() + wsum.double().log()), expected.logsumexp(-1), rtol=1e-5, atol=1e-5)

    kept_max = torch.randn(batch, heads, chunks, generator=gen)
    kept_sum = torch.rand(batch, heads, chunks, generator=gen) * 5 + 0.5
    kept_max[:, :, 1], kept_sum[:, :, 1] = float("-inf"), 0.0  # a chunk with no row allowed
    weights = torch.tensor([1.0, 0.5])
    for evidence_max in (False, True):
        lse, mass, out, evidence = window_finish(
            kept_max, kept_sum, wmax, wsum, logits, values, weights, n_kv, evidence_max=evidence_max
        )
        kept_log = kept_max.double() + kept_sum.double().log()
        want_lse = torch.cat([kept_log, expected], -1).logsumexp(-1)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mass.double(), (kept_log - want_lse[..., None]).exp().sum(-1), rtol=1e-5, atol=1e-6)
        probs = (expected - want_lse[..., None]).exp()  # [B, H, W]
        for g in range(n_kv):
            block = probs[:, g * group : (g + 1) * group]
            reduced = block.amax(dim=1) if evidence_max else block.sum(dim=1)
            torch.testing.assert_close(
                evidence[:, g].double(), reduced * weights[:, None].double(), rtol=1e-5, atol=1e-6
            )
            want_out = block @ values[..., g * d : (g + 1) * d].double()
            torch.testing.assert_close(out[:, g * group : (g + 1) * group].double(), want_out, rtol=1e-5, atol=1e-5)

    partial = torch.randn(batch, heads, chunks, width, generator=gen)
    matrix = torch.randn(batch, n_kv, width, width, generator=gen)
    offset = torch.randn(batch, n_kv, width, generator=gen)
    final = kept_finish(partial, mass, matrix, offset, out, torch.float32).view(batch, heads, d)
    for g in range(n_kv):
        rows = slice(g * group, (g + 1) * group)
        kept = (
            partial[:, rows].double().sum(2) @ matrix[:, g].double()
            + mass[:, rows, None].double() * offset[:, g, None].double()
        )
        want = out[:, rows].double().clone()
        want[..., :width] += kept
        torch.testing.assert_close(final[:, rows].double(), want, rtol=1e-5, atol=1e-5)


def test_generate_gives_the_torch_paths_tokens(compiled, monkeypatch):
    """generate() on the kernels (attention and settle) against generate() on the torch path: the same greedy tokens,
    a left-padded request beside a full one, with the cache generate() sizes itself."""
    evict = {"keep": 0.5, "bits": (8, 4)}
    model = kvrewrite.load(compiled["latent"], rate=0.0, recent_window=4, kv_codec="none", evict=evict).eval()
    prompt = random_windows(n=2, length=PROMPT, seed=54)
    mask = torch.ones(prompt.shape, dtype=torch.long)
    mask[1, :PAD] = 0
    from kvrewrite.runtime.tiers import eviction

    calls = {"attention": 0, "settle": 0}
    attend, settle = tiered.kept_decode_attention, eviction.settle_in_kernel

    def counted_attention(*args, **kwargs):
        calls["attention"] += 1
        return attend(*args, **kwargs)

    def counted_settle(*args, **kwargs):
        done = settle(*args, **kwargs)
        calls["settle"] += done
        return done

    monkeypatch.setattr(tiered, "kept_decode_attention", counted_attention)
    monkeypatch.setattr(eviction, "settle_in_kernel", counted_settle)
    tokens = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("KVREWRITE_ATTENTION", backend)
        with torch.no_grad():
            tokens[backend] = model.generate(
                prompt, attention_mask=mask, max_new_tokens=STEPS + 1, do_sample=False, pad_token_id=0
            )
        if backend == "triton":  # every decode step of both layers ran on the kernels
            assert calls == {"attention": 2 * STEPS, "settle": 2 * STEPS}
    assert tokens["triton"].shape[1] == PROMPT + STEPS + 1
    assert torch.equal(tokens["triton"], tokens["torch"])
