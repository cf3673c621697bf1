"""The tiered cache's stored tiers written in place (kvrewrite.runtime.tiers.cache.TieredLayer), against the layer as
it was when every settle concatenated.

`ConcatenatingLayer` below keeps that layer's writes verbatim: the aged tier, the important tier and both position
arrays grown with a torch.cat over the whole tier, the codec's blocks coded from the aged tier and appended with a
cat, no buffers; what moves where is the layer's own. Every forward of a prefill and single-token or chunked decoding must leave both caches holding the
same tiers (compared sorted by cache position), the same codes, and give the same logits; greedy generate() must
agree token for token; plain tiers, token-adaptive ones (important share) and an int4-coded aged tier, with crop,
reset and beam reorder. Without a capacity the bytes held equal the concatenating layer's at every step.
"""

from __future__ import annotations

import pytest
import torch
from test_tiers import RATE, adaptive_model, compiled, tiered_model  # noqa: F401  (compiled: the fixture)
from tiny_models import random_windows

from kvrewrite.runtime.batch_first_layer import BatchFirstLayer
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
from kvrewrite.runtime.codecs.cache import encode_append
from kvrewrite.runtime.tiers.build import make_tiered_cache
from kvrewrite.runtime.tiers.cache import TieredLayer

SMALL_BLOCKS = "int4:group_size=8"  # blocks of 8 tokens: several are coded within a short sequence


class ConcatenatingLayer(TieredLayer):
    """TieredLayer with its writes as they were before they were in place: every append concatenates onto the whole
    tier, and the codec's blocks are coded from the aged tier after the concatenation. Which tokens move where, and
    when, is TieredLayer's own (settle, _classify): only the writes differ."""

    reorder_cache = BatchFirstLayer.reorder_cache
    _map_batch = BatchFirstLayer._map_batch

    def _append(self, name: str, rows: torch.Tensor, dim: int, capacity: int | None) -> None:
        setattr(self, name, torch.cat([getattr(self, name), rows], dim=dim))

    def _append_aged(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.aged_keys = torch.cat([self.aged_keys, keys], dim=-2)
        self.aged_values = torch.cat([self.aged_values, values], dim=-2)
        if self.codec is not None:
            self._code_full_blocks()

    def _code_full_blocks(self) -> None:
        g = self.codec.block_tokens
        n_blocks = self.aged_keys.shape[-2] // g
        if not n_blocks:
            return
        self.coded_keys = encode_append(self.codec, self.coded_keys, self.aged_keys, n_blocks, "key")
        self.coded_values = encode_append(self.codec, self.coded_values, self.aged_values, n_blocks, "value")
        self.aged_keys = self.aged_keys[..., n_blocks * g :, :].contiguous()
        self.aged_values = self.aged_values[..., n_blocks * g :, :].contiguous()
        self.coded_length += n_blocks * g


def concatenating(cache):
    for layer in cache.layers:
        layer.__class__ = ConcatenatingLayer
    return cache


def cache_pair(model, capacity: int | None = None, storage_dtype=torch.float32):
    """(in-place cache, concatenating reference) built alike."""
    ours = make_tiered_cache(model, model.tier_policy, storage_dtype=storage_dtype, capacity=capacity)
    return ours, concatenating(make_tiered_cache(model, model.tier_policy, storage_dtype=storage_dtype))


def model_for(compiled, kind: str, mode: str, window: int = 4):
    if kind == "plain":
        return tiered_model(compiled[mode], window)
    if kind == "int4":
        return tiered_model(compiled[mode], window, codec=SMALL_BLOCKS)
    return adaptive_model(compiled[mode], window, score=kind.split("-")[1])  # adaptive-attention / -denominator


def sorted_tier(keys, values, positions):
    """Per batch row, a tier's keys, values and positions sorted by position (None positions: in order already)."""
    if positions is None:
        return [(keys[b], values[b], None) for b in range(keys.shape[0])]
    rows = []
    for b in range(keys.shape[0]):
        order = positions[b].argsort()
        rows.append((keys[b, :, order], values[b, :, order], positions[b, order]))
    return rows


def assert_same_tiers(ours, reference) -> None:
    """The same tiers, token for token (sorted by position), and the same codes. Layer 0 reads the embeddings, so it
    holds exactly the same numbers; later layers' inputs went through attention over strided buffer views instead
    of whole tensors, equal up to float summation order (their codes are compared decoded)."""
    for i, (mine, theirs) in enumerate(zip(ours.layers, reference.layers)):

        def same(a, b, what):
            if i == 0 or not a.is_floating_point():
                assert torch.equal(a, b), what
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)

        assert mine.get_seq_length() == theirs.get_seq_length()
        same(mine.keys, theirs.keys, "keys")
        same(mine.values, theirs.values, "values")
        if mine.adaptive:
            torch.testing.assert_close(mine.recent_scores, theirs.recent_scores, rtol=1e-5, atol=1e-6)
        tiers = [("aged_keys", "aged_values", "aged_positions")]
        if mine.adaptive:
            tiers.append(("important_keys", "important_values", "important_positions"))
        for names in tiers:
            a = sorted_tier(*(getattr(mine, name) for name in names))
            b = sorted_tier(*(getattr(theirs, name) for name in names))
            for (ka, va, pa), (kb, vb, pb) in zip(a, b):
                assert (pa is None and pb is None) or torch.equal(pa, pb), names[2]
                same(ka, kb, names[0])
                same(va, vb, names[1])
        assert mine.coded_length == theirs.coded_length
        for name in ("coded_keys", "coded_values"):
            a, b = getattr(mine, name), getattr(theirs, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.keys() == b.keys()
                for key in a:
                    assert a[key].shape == b[key].shape, (name, key)
                    if i == 0:
                        assert torch.equal(a[key], b[key]), (name, key)
        if mine.coded_keys is not None:
            for x, y, what in zip(mine.aged_latents(torch.float32), theirs.aged_latents(torch.float32), "kv"):
                same(x, y, f"decoded aged {what}")


def step_through(model, tokens: torch.Tensor, caches, prefill: int, check=None, chunk: int = 1):
    """Prefill `prefill` tokens in one forward, then `chunk` tokens per forward, through every cache; `check` after
    each forward. Returns each cache's logits."""
    logits = [[] for _ in caches]
    n = tokens.shape[1]
    with torch.no_grad():
        for start, stop in [(0, prefill)] + [(t, min(t + chunk, n)) for t in range(prefill, n, chunk)]:
            for i, cache in enumerate(caches):
                logits[i].append(model(tokens[:, start:stop], past_key_values=cache, use_cache=True).logits)
            if check is not None:
                check(*caches)
    return [torch.cat(chunks, dim=1) for chunks in logits]


def buffer_pointers(cache) -> dict:
    pointers = {}
    for i, layer in enumerate(cache.layers):
        for group in ("tier_buffers", "coded_key_buffers", "coded_value_buffers"):
            for name, buffer in getattr(layer, group).items():
                pointers[i, group, name] = buffer.data_ptr()
    return pointers


KINDS = ["plain", "adaptive-attention", "adaptive-denominator", "int4"]


# ---- every forward against the concatenating layer ------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "mode,chunk,capacity", [("latent", 1, 64), ("freq", 1, None), ("latent", 5, None), ("freq", 5, 64)]
)
def test_every_forward_holds_the_same_tiers_as_the_concatenating_layer(compiled, kind, mode, chunk, capacity):
    model = model_for(compiled, kind, mode)
    tokens = random_windows(n=2, length=52, seed=61)
    ours, reference = cache_pair(model, capacity=capacity)
    out, expected = step_through(model, tokens, (ours, reference), prefill=13, check=assert_same_tiers, chunk=chunk)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    layer = ours.layers[0]
    assert layer.aged_keys.shape[-2] + layer.coded_length > 0
    if kind == "int4":
        assert layer.coded_length >= 32
    if kind.startswith("adaptive"):
        assert layer.important_positions.shape[-1] > 0
    if capacity is not None:  # the tiers are views of buffers allocated once at their largest size
        beyond = capacity - layer.window
        buffer = layer.tier_buffers["aged_keys"]
        if kind == "plain":
            assert buffer.shape[-2] == beyond
        elif kind == "int4":
            assert layer.coded_key_buffers["codes"].shape[1] == beyond // 8 and buffer.shape[-2] == 7


@pytest.mark.parametrize("kind", KINDS)
def test_generate_sizes_the_tiers_once_and_matches_the_concatenating_layer(compiled, kind):
    """generate() passes its max length: every tier's buffer is allocated once and decoding writes into it; the greedy
    tokens (left padding) equal those of a cache without a capacity and of the concatenating layer."""
    model = model_for(compiled, kind, "latent")
    ids = random_windows(n=2, length=18, seed=62)
    ids[0, :4] = 0
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    sized, seen = [], []
    make_kv_cache, settle = model.make_kv_cache, TieredLayer.settle

    def make(capacity=None):  # what generate() builds: a cache sized to its max length
        assert capacity == ids.shape[1] + 40 - 1  # the last token is never cached
        sized.append(make_kv_cache(capacity=capacity))
        return sized[-1]

    def recording(self):
        settle(self)
        seen.append(buffer_pointers(sized[-1]))

    def generate(**extra):
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0, **extra
        )

    with torch.no_grad():
        outputs = {
            "concatenating": generate(past_key_values=concatenating(model.make_kv_cache())),
            "unsized": generate(past_key_values=model.make_kv_cache()),
        }
        model.make_kv_cache, TieredLayer.settle = make, recording
        try:
            outputs["generate"] = generate()
        finally:
            TieredLayer.settle = settle
            del model.make_kv_cache
    assert torch.equal(outputs["generate"], outputs["concatenating"])
    assert torch.equal(outputs["unsized"], outputs["concatenating"])
    # Every buffer, once allocated, is the same buffer at every later settle: never reallocated.
    first = {}
    for pointers in seen:
        for key, pointer in pointers.items():
            assert first.setdefault(key, pointer) == pointer, key
    assert first


# ---- crop, reset, beam search, a capacity too small --------------------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "adaptive-attention", "int4"])
def test_crop_reset_and_beam_reorder(compiled, kind):
    model = model_for(compiled, kind, "freq", window=6)
    first, second = random_windows(n=2, length=40, seed=63), random_windows(n=2, length=40, seed=64)
    ours, reference = cache_pair(model, capacity=48)
    step_through(model, first[:, :30], (ours, reference), prefill=12, check=assert_same_tiers)
    for cache in (ours, reference):
        cache.crop(28)  # inside the recent window
    assert_same_tiers(ours, reference)
    out, expected = step_through(model, first[:, 28:], (ours, reference), prefill=1, check=assert_same_tiers)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for cache in (ours, reference):
        cache.reset()
    assert all(not layer.tier_buffers and not layer.coded_key_buffers for layer in ours.layers)
    out, expected = step_through(model, second[:, :36], (ours, reference), prefill=10, check=assert_same_tiers)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    before = buffer_pointers(ours)
    for cache in (ours, reference):
        cache.reorder_cache(torch.tensor([1, 1]))
    assert_same_tiers(ours, reference)
    assert buffer_pointers(ours) == before  # the chosen rows written back into the same buffers
    out, expected = step_through(model, second[:, 36:], (ours, reference), prefill=1, check=assert_same_tiers)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for cache in (ours, reference):
        cache.batch_select_indices(torch.tensor([0]))
    assert_same_tiers(ours, reference)
    more = random_windows(n=1, length=10, seed=65)
    out, expected = step_through(model, more, (ours, reference), prefill=1, check=assert_same_tiers)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "adaptive-denominator", "int4"])
def test_beam_search_equals_the_concatenating_layer(compiled, kind):
    model = model_for(compiled, kind, "latent")
    ids = random_windows(n=2, length=14, seed=66)
    outputs = []
    with torch.no_grad():
        for cache in (None, concatenating(model.make_kv_cache())):
            extra = {} if cache is None else {"past_key_values": cache}
            outputs.append(
                model.generate(input_ids=ids, max_new_tokens=24, num_beams=3, do_sample=False, pad_token_id=0, **extra)
            )
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("kind", ["plain", "adaptive-attention", "int4"])
def test_a_capacity_too_small_grows_and_reads_the_same(compiled, kind):
    model = model_for(compiled, kind, "latent")
    tokens = random_windows(n=2, length=50, seed=67)
    ours, reference = cache_pair(model, capacity=20)
    out, expected = step_through(model, tokens, (ours, reference), prefill=9, check=assert_same_tiers, chunk=3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ---- bytes -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS + ["int4-default"])
@pytest.mark.parametrize("chunk", [1, 4])
def test_without_a_capacity_the_bytes_held_equal_the_concatenating_layers(compiled, kind, chunk):
    """The frontier builds its caches with make_kv_cache() and counts the bytes they hold (buffers included): without
    a capacity every buffer holds exactly its tier's rows, as the concatenation did, after every forward."""
    model = (
        tiered_model(compiled["latent"], 4, codec="int4")
        if kind == "int4-default"
        else model_for(compiled, kind, "latent")
    )
    tokens = random_windows(n=2, length=90, seed=68)
    ours, reference = model.make_kv_cache(), concatenating(model.make_kv_cache())  # float16, as served and measured

    def same_bytes(mine, theirs):
        assert_same_tiers(mine, theirs)
        assert cache_tensor_bytes(mine) == cache_tensor_bytes(theirs)
        assert cache_tensor_bytes(mine, float_bytes=2) == cache_tensor_bytes(theirs, float_bytes=2)
        for layer in mine.layers:
            for name, buffer in layer.tier_buffers.items():
                assert buffer.shape == getattr(layer, name).shape, name

    step_through(model, tokens, (ours, reference), prefill=11, check=same_bytes, chunk=chunk)
    assert ours.layers[0].aged_keys.shape[-2] + ours.layers[0].coded_length == 90 - 4 or kind.startswith("adaptive")


def test_a_capacity_holds_its_buffers_and_no_more(compiled):
    """With a capacity the bytes are those of the full-length tiers from the first settle on (a StaticCache's
    accounting): plain tiers hold capacity - window aged rows per layer."""
    model = model_for(compiled, "plain", "latent")
    tokens = random_windows(n=1, length=20, seed=69)
    cache = make_tiered_cache(model, model.tier_policy, capacity=64)
    step_through(model, tokens, (cache,), prefill=10)
    spec = model.compression_spec
    key_ranks, value_ranks = spec.ranks_for_rate(RATE)
    full = 2 * spec.num_key_value_heads * spec.head_dim
    expected = sum(
        2 * (4 * full + (64 - 4) * (sum(key_ranks[i]) + sum(value_ranks[i]))) for i in range(spec.num_layers)
    )
    assert cache_tensor_bytes(cache) == expected


def test_a_view_of_no_rows_is_still_the_start_of_its_buffer():
    """A staging run emptied in place is a view of no rows (data_ptr() 0): the next append still writes into its
    buffer rather than allocating a new one."""
    from kvrewrite.runtime.inplace_cache import append_in_place, is_prefix_view

    buffer = torch.zeros(2, 1, 7, 3)
    empty = buffer.narrow(-2, 0, 0)
    assert is_prefix_view(empty, buffer, 2) and not is_prefix_view(torch.zeros(2, 1, 0, 3), buffer, 2)
    new = torch.ones(2, 1, 2, 3)
    same, view = append_in_place(buffer, empty, new, -2, grow=False)
    assert same is buffer and torch.equal(view, new) and view.data_ptr() == buffer.data_ptr()
