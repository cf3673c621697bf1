"""The in-place cache and the tiled latent decode against the slow path they replace (torch.cat, whole-cache rebuild).

References: stock DynamicLayer appends (torch.cat), the per-head reference attention (`KVREWRITE_ATTENTION=reference`)
and, for latent layers, the prefill path that rebuilds every key at once (`_latent_attention` above
LATENT_DECODE_ROWS), and a dense computation written here.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import compile_tiny_modes
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import kvrewrite
from kvrewrite.runtime import inplace_cache
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
from kvrewrite.runtime.inplace_cache import InPlaceLayer, grown_capacity, in_place_cache
from kvrewrite.runtime.kernels import latent_decode
from kvrewrite.runtime.kernels.cache_layout import COLUMNS, ROWS, packed_view, to_storage
from kvrewrite.runtime.kernels.latent_decode import latent_decode_attention
from kvrewrite.runtime.kernels.reference import grouped_attention
from kvrewrite.runtime.modeling import attention as attention_module

IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_tiny_modes(
        tmp_path_factory.mktemp("inplace"), ("latent", "post-rope"), seed=5, num_kv_heads=2, num_heads=6, head_dim=16
    )


def slow_path(monkeypatch) -> None:
    """What decoding did before: torch.cat appends, the reference attention, latent keys rebuilt all at once."""
    monkeypatch.setenv("KVREWRITE_ATTENTION", "reference")
    monkeypatch.setattr(attention_module, "in_place_layer", lambda cache, layer_idx: None)
    monkeypatch.setattr(attention_module, "LATENT_DECODE_ROWS", 0)


def generate(directory, rate: float, **kwargs):
    model = kvrewrite.load(directory, rate=rate).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=IDS,
            attention_mask=MASK,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("mode", ["latent", "post-rope"])
@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["full-rank", "mixed-ranks"])
def test_default_generate_equals_the_slow_path_token_for_token(compiled, monkeypatch, mode, rate):
    monkeypatch.setattr(latent_decode, "TILE", 5)  # several tiles and an odd last one at these lengths
    monkeypatch.delenv("KVREWRITE_ATTENTION", raising=False)
    fast_ids, fast_logits = generate(compiled[mode], rate, max_new_tokens=12)
    with monkeypatch.context() as patch:
        slow_path(patch)
        slow_ids, slow_logits = generate(compiled[mode], rate, max_new_tokens=12)
    assert torch.equal(fast_ids, slow_ids)
    assert (fast_logits - slow_logits).abs().max().item() < 1e-4
    assert fast_logits.abs().max().item() > 0.5  # not a degenerate model


def test_default_generate_uses_an_in_place_cache_sized_for_the_call(compiled, monkeypatch):
    monkeypatch.delenv("KVREWRITE_ATTENTION", raising=False)
    model = kvrewrite.load(compiled["latent"], rate=0.5).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=IDS,
            attention_mask=MASK,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
    cache = out.past_key_values
    for layer, attn in zip(cache.layers, model.compressed_attentions()):
        assert type(layer) is InPlaceLayer
        # Sized at the prefill for every token that is ever cached (7 + 6 - 1: the last token is never fed back),
        # so nothing is reallocated and nothing is spare; keys column-major for the tiles.
        assert layer._buffers["keys"].shape[-2] == 12 and layer.keys.shape[-2] == 12
        assert layer.keys.shape[1] == sum(attn.key_ranks) and layer.keys.shape[-1] == 1


@pytest.mark.parametrize("mode", ["latent", "post-rope"])
def test_beam_search_and_a_cache_that_outgrows_its_buffer_equal_the_slow_path(compiled, monkeypatch, mode):
    monkeypatch.setattr(latent_decode, "TILE", 4)
    monkeypatch.delenv("KVREWRITE_ATTENTION", raising=False)
    model = kvrewrite.load(compiled[mode], rate=0.5).eval()
    monkeypatch.setattr(inplace_cache, "GROW_FROM", 0)  # grow in steps even this small ...
    monkeypatch.setattr(inplace_cache, "GROW_MIN", 3)  # ... of a few rows, not 256
    grown = in_place_cache(model.config)  # no capacity: the prefill holds exactly its rows, then grows
    kwargs = dict(
        input_ids=IDS,
        attention_mask=MASK,
        max_new_tokens=9,
        do_sample=False,
        pad_token_id=0,
        num_beams=3,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        fast = model.generate(past_key_values=grown, **kwargs)
        with monkeypatch.context() as patch:
            slow_path(patch)
            slow = model.generate(past_key_values=DynamicCache(config=model.config), **kwargs)
    assert torch.equal(fast.sequences, slow.sequences)
    assert (fast.sequences_scores - slow.sequences_scores).abs().max().item() < 1e-4
    assert all(type(layer) is InPlaceLayer for layer in grown.layers)


def test_in_place_layer_holds_what_torch_cat_holds_through_crop_reorder_and_selection():
    torch.manual_seed(0)
    ours, stock = InPlaceLayer(), DynamicLayer()
    keys, values = torch.randn(3, 4, 300, 1), torch.randn(3, 5, 300, 1)  # column-major packed: [B, C, S, 1]
    for layer in (ours, stock):
        layer.update(keys, values)
    assert ours._buffers["keys"].shape[-2] == 300  # a prefill holds exactly its rows
    for step in range(30):
        k, v = torch.randn(3, 4, 1, 1), torch.randn(3, 5, 1, 1)
        for layer in (ours, stock):
            layer.update(k, v)
        if step == 0:  # the first append grows in one large step ...
            assert ours._buffers["keys"].shape[-2] == grown_capacity(301) == 301 + 256
            pointer = ours._buffers["keys"].data_ptr()
        assert ours._buffers["keys"].data_ptr() == pointer  # ... and every later append writes in place
        assert torch.equal(ours.keys, stock.keys) and torch.equal(ours.values, stock.values)
    assert ours.keys.data_ptr() == pointer
    beams = torch.tensor([2, 0, 0])
    for layer in (ours, stock):
        layer.crop(-7)
        layer.reorder_cache(beams)
        layer.update(torch.randn(3, 4, 1, 1).fill_(1.0), torch.randn(3, 5, 1, 1).fill_(2.0))
    assert ours.keys.data_ptr() == pointer  # crop and beam reordering kept the buffer
    assert torch.equal(ours.keys, stock.keys) and torch.equal(ours.values, stock.values)
    for layer in (ours, stock):
        layer.batch_select_indices(torch.tensor([1]))
        layer.update(torch.ones(1, 4, 2, 1), torch.ones(1, 5, 2, 1))
    assert torch.equal(ours.keys, stock.keys) and ours.get_seq_length() == stock.get_seq_length() == 326


def test_a_set_capacity_is_allocated_once_and_counted_as_held():
    cache = in_place_cache(kvrewrite_config(), capacity=40)
    cache.update(torch.randn(2, 1, 10, 6), torch.randn(2, 1, 10, 3), 0)
    for _ in range(30):
        cache.update(torch.randn(2, 1, 1, 6), torch.randn(2, 1, 1, 3), 0)
    layer = cache.layers[0]
    assert layer._buffers["keys"].shape[-2] == 40 and layer.get_seq_length() == 40
    assert cache_tensor_bytes(cache) == 2 * 40 * (6 + 3) * 4  # the room is held memory
    cache.update(torch.randn(2, 1, 1, 6), torch.randn(2, 1, 1, 3), 0)  # past the capacity: grows, keeps every row
    assert layer.get_seq_length() == 41 and layer._buffers["keys"].shape[-2] == grown_capacity(41)


def kvrewrite_config():
    from tiny_models import tiny_llama_config

    return tiny_llama_config(layers=1)


def dense_latent_attention(queries, keys, values, allowed, scaling, key_ranks, value_ranks, up, cos, sin):
    """Every key rebuilt and rotated at once ([B, 1, S, d] per head), then plain grouped attention."""
    batch, heads, q_len, d = queries.shape
    group = heads // len(key_ranks)
    outs, ko, vo = [], 0, 0
    for g, (rk, rv) in enumerate(zip(key_ranks, value_ranks)):
        k = keys[..., ko : ko + rk] @ up[g, :rk]  # [B, 1, S, d]
        k = k * cos + torch.cat([-k[..., d // 2 :], k[..., : d // 2]], dim=-1) * sin
        out = grouped_attention(queries[:, g * group : (g + 1) * group], k, values[..., vo : vo + rv], allowed, scaling)
        outs.append(out.transpose(1, 2).reshape(batch, q_len, group * rv))
        ko, vo = ko + rk, vo + rv
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("paired", [True, False], ids=["pairs", "rotate-half"])
@pytest.mark.parametrize("order", [COLUMNS, ROWS])
@pytest.mark.parametrize("q_len", [1, 3])
def test_tiled_latent_decode_equals_dense_rebuild(monkeypatch, order, q_len, paired):
    monkeypatch.setattr(latent_decode, "TILE", 7)
    g = torch.Generator().manual_seed(1)
    batch, n_kv, group, d, kv_len = 2, 3, 2, 8, 23
    key_ranks, value_ranks = [8, 3, 0], [5, 8, 2]  # uneven, one head with no key dims at all
    queries = torch.randn(batch, n_kv * group, q_len, d, generator=g, dtype=torch.float64)
    keys = packed_view(to_storage(torch.randn(batch, kv_len, sum(key_ranks), generator=g, dtype=torch.float64), order))
    values = packed_view(
        to_storage(torch.randn(batch, kv_len, sum(value_ranks), generator=g, dtype=torch.float64), order)
    )
    up = torch.randn(n_kv, d, d, generator=g, dtype=torch.float64)
    angles = torch.arange(kv_len, dtype=torch.float64)[:, None] * torch.rand(d // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [S, d]
    allowed = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    allowed[0, ..., :4] = False  # left padding
    allowed[1, :, :, kv_len - q_len + 1 :] = torch.ones(q_len, q_len - 1, dtype=torch.bool).tril()  # causal tail
    got = latent_decode_attention(
        queries,
        keys,
        values,
        allowed,
        0.3,
        key_ranks,
        value_ranks,
        up,
        cos.T.contiguous(),
        sin.T.contiguous(),
        torch.complex(cos[:, : d // 2], sin[:, : d // 2]) if paired else None,
    )
    want = dense_latent_attention(queries, keys, values, allowed, 0.3, key_ranks, value_ranks, up, cos, sin)
    assert (got - want).abs().max().item() < 1e-10


def static_decode_logits(model, forward, steps: int = 4) -> torch.Tensor:
    """Prefill eagerly into a StaticCache, then `steps` single-token steps through `forward` (what generate() does
    with cache_implementation="static" and a compiled forward)."""
    from transformers import StaticCache

    capacity = IDS.shape[1] + steps + 2
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    # One mask of the cache's length for every step (slots not yet written are masked causally): the compiled step
    # then sees the same shapes every time and is compiled once.
    mask = torch.cat([MASK, torch.ones(2, capacity - MASK.shape[1], dtype=MASK.dtype)], dim=1)
    logits = []
    with torch.no_grad():
        out = model(input_ids=IDS, attention_mask=mask[:, : IDS.shape[1]], past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = forward(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, dim=1)


def tiny_mla_model():
    """The MLA runtime tests' tiny DeepSeek-V3 (uneven widths) with kvrewrite's absorbed attention."""
    from test_mla_runtime import stock_and_ours, tiny_config

    return stock_and_ours(tiny_config())[1]


@pytest.mark.parametrize("form", ["latent", "post-rope", "mla"])
def test_decode_step_compiles_as_one_graph_on_a_static_cache_and_equals_eager(compiled, monkeypatch, form):
    """fullgraph=True: no graph break, no data-dependent shape or host sync in the step (what CUDA graphs need)."""
    monkeypatch.delenv("KVREWRITE_ATTENTION", raising=False)
    torch._dynamo.reset()
    model = tiny_mla_model() if form == "mla" else kvrewrite.load(compiled[form], rate=0.5).eval()
    eager = static_decode_logits(model, model.forward)
    graph = static_decode_logits(model, torch.compile(model.forward, fullgraph=True, dynamic=False))
    assert (graph - eager).abs().max().item() < 1e-4 and eager.abs().max().item() > 0.1


@pytest.mark.parametrize("mode", ["latent", "post-rope"])
def test_triton_flash_decoding_generate_equals_the_slow_path(compiled, monkeypatch, mode):
    """The CUDA decode path (kernels.flash_decode_*), run by Triton's interpreter on CPU tensors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("KVREWRITE_ATTENTION", "triton")
    fast_ids, fast_logits = generate(compiled[mode], 0.5, max_new_tokens=5)
    with monkeypatch.context() as patch:
        slow_path(patch)
        slow_ids, slow_logits = generate(compiled[mode], 0.5, max_new_tokens=5)
    assert torch.equal(fast_ids, slow_ids)
    assert (fast_logits - slow_logits).abs().max().item() < 1e-4


def test_triton_flash_decoding_of_the_absorbed_mla_equals_torch(monkeypatch):
    pytest.importorskip("triton")
    model = tiny_mla_model()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVREWRITE_ATTENTION", backend)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=5,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        runs[backend] = out.sequences, torch.stack(out.logits, dim=1)
    assert torch.equal(runs["torch"][0], runs["triton"][0])
    assert (runs["torch"][1] - runs["triton"][1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("mode", ["latent", "post-rope"])
def test_generate_on_a_static_cache_equals_the_default_in_place_cache(compiled, monkeypatch, mode):
    monkeypatch.delenv("KVREWRITE_ATTENTION", raising=False)
    default_ids, default_logits = generate(compiled[mode], 0.5, max_new_tokens=6)
    static_ids, static_logits = generate(compiled[mode], 0.5, max_new_tokens=6, cache_implementation="static")
    assert torch.equal(default_ids, static_ids)
    assert (default_logits - static_logits).abs().max().item() < 1e-4


def test_a_codec_store_grows_in_place_and_reads_what_the_concatenated_store_reads(monkeypatch):
    """The coded blocks of an int4 cache appended into a buffer with room, against torch.cat appends (the
    reference layer below codes exactly as before: encode_append without buffers)."""
    from kvrewrite.runtime.codecs import build_layer_codecs
    from kvrewrite.runtime.codecs.cache import CodecLayer, encode_append
    from kvrewrite.runtime.codecs.config import parse_codec

    class ConcatenatingLayer(CodecLayer):
        def _code_overflow(self) -> None:
            g = self.codec.block_tokens
            n = max(0, self.keys.shape[-2] - self.residual_length) // g
            if n:
                self.coded_keys = encode_append(self.codec, self.coded_keys, self.keys, n, "key")
                self.coded_values = encode_append(self.codec, self.coded_values, self.values, n, "value")
                self.keys, self.values = (
                    self.keys[..., n * g :, :].contiguous(),
                    self.values[..., n * g :, :].contiguous(),
                )

    monkeypatch.setattr(inplace_cache, "GROW_FROM", 0)  # grow in steps at this small size too
    codec = build_layer_codecs(parse_codec("int4"), [[4, 4]], [[4, 4]])[0]
    ours, reference = CodecLayer(codec, residual=16), ConcatenatingLayer(codec, residual=16)
    torch.manual_seed(3)
    prefill = torch.randn(2, 1, 300, 8), torch.randn(2, 1, 300, 8)
    for layer in (ours, reference):
        layer.update(*prefill)
    buffers = set()
    for _ in range(300):
        k, v = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)
        got, want = ours.update(k, v), reference.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        buffers.add(next(iter(ours.coded_key_buffers.values())).data_ptr())
    blocks = 300 // codec.block_tokens
    assert len(buffers) < blocks  # the store was not copied on every coded block
    assert all(torch.equal(ours.coded_keys[name], reference.coded_keys[name]) for name in reference.coded_keys)
