"""The static codec cache (codecs.static_cache) against the CodecCache it stands in for (codecs.cache), which codes
with torch.cat-grown stores and host-side lengths: same blocks coded, same tokens read, same generated tokens; its
decode step traced as one graph; the refusals."""

from __future__ import annotations

import pytest
import torch
from tiny_models import compile_tiny_modes
from transformers import CompileConfig

import kvrewrite
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
from kvrewrite.runtime.codecs import build_layer_codecs
from kvrewrite.runtime.codecs.cache import CodecLayer
from kvrewrite.runtime.codecs.config import parse_codec
from kvrewrite.runtime.codecs.static_cache import CountedReadout, StaticCodecCache, StaticCodecLayer

IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
CODEC = "int4:residual=4,group_size=16"  # 31 new tokens: 37 held, two blocks coded while decoding


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("static_codec")
    return compile_tiny_modes(root, ("latent", "post-rope"), seed=5, num_kv_heads=2, num_heads=6, head_dim=16)


def generate(directory, codec: str = CODEC, device: str = "cpu", **kwargs):
    model = kvrewrite.load(directory, rate=0.5, kv_codec=codec).eval().to(device)
    with torch.no_grad():
        out = model.generate(
            input_ids=IDS.to(device),
            attention_mask=MASK.to(device),
            do_sample=False,
            pad_token_id=0,
            max_new_tokens=31,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out.sequences, torch.stack(out.logits, dim=1), out.past_key_values


def live_store(layer) -> dict[str, dict[str, torch.Tensor]]:
    """A layer's coded blocks (the live ones) and window, as one dict per side, for either cache."""
    if isinstance(layer, StaticCodecLayer):
        n, w = int(layer.n_coded), int(layer.window_len)
        sides = (layer.coded_keys, layer.keys), (layer.coded_values, layer.values)
        return {
            side: {**{name: t[:, :n] for name, t in store.items()}, "window": window[:, :, :w]}
            for side, (store, window) in zip(("key", "value"), sides)
        }
    sides = (layer.coded_keys, layer.keys), (layer.coded_values, layer.values)
    return {side: {**store, "window": window} for side, (store, window) in zip(("key", "value"), sides)}


@pytest.mark.parametrize("mode", ["latent", "post-rope"])
def test_static_generate_codes_and_reads_what_the_codec_cache_does(compiled, mode):
    """generate(cache_implementation="static") builds a StaticCodecCache; after prefill + 30 steps (two blocks coded
    while decoding) its coded blocks equal the CodecCache's bit for bit, and so does the first layer's window; the
    deeper layers' windows are projections of hidden states that passed through each cache's own attention (another
    summation order), so they are held to one float16 ulp (one value was one ulp apart on an AVX-512 EPYC). The
    tokens are equal."""
    ids, logits, cache = generate(compiled[mode])
    static_ids, static_logits, static_cache = generate(compiled[mode], cache_implementation="static")
    assert isinstance(static_cache, StaticCodecCache) and not isinstance(cache, StaticCodecCache)
    assert torch.equal(static_ids, ids)
    assert (static_logits - logits).abs().max().item() < 1e-4 and logits.abs().max().item() > 0.1
    for index, (ours, theirs) in enumerate(zip(static_cache.layers, cache.layers)):
        assert int(ours.n_coded) == theirs.coded_keys["codes"].shape[1] == 2  # 37 tokens: 2 blocks of 16, 5 window
        assert int(ours.get_seq_length()) == theirs.get_seq_length() == IDS.shape[1] + 30
        got, want = live_store(ours), live_store(theirs)
        for side in want:
            for name in want[side]:
                if name == "window" and index > 0:
                    # one float16 ulp: 2**-10 of a normal value, 2**-24 below the normal range
                    torch.testing.assert_close(got[side][name], want[side][name], rtol=2**-10, atol=2**-24)
                else:
                    assert torch.equal(got[side][name], want[side][name]), (index, side, name)


def test_layer_reads_what_the_codec_layer_decodes_through_chunked_prefills():
    """Layer level, random latents: a prefill, steps up to a block due (coded at the next update), a prefill then,
    70 decode steps, another prefill, more steps. Every readout, decoded, equals the decode path of a CodecLayer fed
    the same tokens (decode(store) + window); held bytes are the preallocated buffers'; after reset() the layer
    reads as a fresh one."""
    codec = build_layer_codecs(parse_codec("int4:residual=8,group_size=16"), [[6, 4]], [[4, 6]])[0]
    ours, reference = StaticCodecLayer(codec, residual=8, max_cache_len=200), CodecLayer(codec, residual=8)
    torch.manual_seed(4)
    steps = [21, 1, 1, 1, 16, *[1] * 70, 16, *[1] * 40]
    tokens = [(torch.randn(2, 1, t, 10), torch.randn(2, 1, t, 10)) for t in steps]
    for i, (k, v) in enumerate(tokens):
        if i == 4:
            assert int(ours.window_len) == 8 + 16 and int(ours.n_coded) == 0  # a block due, not coded yet
        assert_reads_alike(ours.update_coded(k, v), reference.update(k, v), codec)
    assert int(ours.get_seq_length()) == sum(steps)
    blocks, window = (200 - 8) // 16 + 1, 8 + 16  # the live blocks' room and one scratch block
    per_row = blocks * (codec.block_bytes("key") + codec.block_bytes("value")) + window * 2 * (10 + 10)
    assert cache_tensor_bytes(StaticCacheOf(ours)) == 2 * per_row  # two sequences; the 0-dim counts are not bytes
    ours.reset()
    assert int(ours.n_coded) == int(ours.window_len) == int(ours.get_seq_length()) == 0
    fresh = CodecLayer(codec, residual=8)
    for k, v in tokens[:6]:
        assert_reads_alike(ours.update_coded(k, v), fresh.update(k, v), codec)


def assert_reads_alike(readout, decoded: tuple[torch.Tensor, torch.Tensor], codec) -> None:
    """A static layer's readout, decoded, equals what CodecLayer.update() returned (every token, decoded)."""
    want_k, want_v = decoded
    if isinstance(readout, CountedReadout):
        held = int(readout.n_coded) * 16 + int(readout.window_len)
        assert bool(readout.live()[held - 1]) and not bool(readout.live()[held])
        got_k = readout.dense("key", torch.float32)[..., :held, :]
        got_v = readout.dense("value", torch.float32)[..., :held, :]
    else:  # a prefill: the store coded so far, then the staged window, as the CodecLayer's fused path reads them
        stores = [readout.keys, readout.values] if readout.keys is not None else [None, None]
        got_k, got_v = (
            torch.cat(
                ([codec.decode(store, side).reshape(2, 1, -1, window.shape[-1])] if store is not None else [])
                + [window.float()],
                dim=-2,
            )
            for store, window, side in zip(stores, (readout.key_window, readout.value_window), ("key", "value"))
        )
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


class StaticCacheOf:
    """A one-layer stand-in with a `layers` list, for cache_tensor_bytes."""

    def __init__(self, layer):
        self.layers = [layer]


@pytest.mark.parametrize("mode", ["post-rope"])
def test_decode_step_compiles_as_one_graph_and_equals_eager(compiled, mode):
    """generate() compiles the decode step itself when the cache is compileable (forced on CPU here): fullgraph,
    one graph for all 30 steps (blocks due and not), the same tokens as eager. Inductor may round a code at a
    quantization boundary the other way, so the logits agree to what one code step moves them."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    ids, logits, cache = generate(compiled[mode], cache_implementation="static")
    graph_ids, graph_logits, graph_cache = generate(
        compiled[mode], cache_implementation="static", compile_config=config
    )
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(graph_ids, ids)
    assert (graph_logits - logits).abs().max().item() < 2e-2 * logits.abs().max().item()
    codes, graph_codes = cache.layers[0].coded_keys["codes"], graph_cache.layers[0].coded_keys["codes"]
    assert int(graph_cache.layers[0].n_coded) == 2 and (codes == graph_codes).float().mean().item() > 0.98


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_captured_decode_steps_generate_what_eager_steps_do(compiled):
    """On CUDA, generate() compiles the decode step of a compileable cache by itself (mode reduce-overhead: CUDA
    graphs, the coded flash-decoding kernel inside them): the same tokens as the eager static steps."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    ids, logits, _ = generate(compiled["post-rope"], device="cuda", cache_implementation="static", disable_compile=True)
    graph_ids, graph_logits, cache = generate(
        compiled["post-rope"], device="cuda", cache_implementation="static", compile_config=config
    )
    assert torch.equal(graph_ids, ids) and int(cache.layers[0].n_coded) == 2
    assert counters["inductor"]["cudagraph_skips"] == 0  # replayed as graphs, not run eagerly
    assert (graph_logits - logits).abs().max().item() < 2e-2 * logits.abs().max().item()


def test_triton_flash_decoding_reads_the_counts_on_the_device(compiled, monkeypatch):
    """KVREWRITE_ATTENTION=triton (the interpreter here): each decode step goes to the coded flash-decoding kernel
    with n_coded / window_len as device tensors, and generates what the torch codec cache does."""
    pytest.importorskip("triton")
    from kvrewrite.runtime.kernels import flash_decode_coded

    ids, logits, _ = generate(compiled["post-rope"])
    counted = []
    kernel = flash_decode_coded.coded_flash_decode

    def watched(*args, **kwargs):
        counted.append(isinstance(args[7], torch.Tensor) and isinstance(args[8], torch.Tensor))
        return kernel(*args, **kwargs)

    monkeypatch.setenv("KVREWRITE_ATTENTION", "triton")
    monkeypatch.setattr(flash_decode_coded, "coded_flash_decode", watched)
    static_ids, static_logits, _ = generate(compiled["post-rope"], cache_implementation="static")
    assert counted == [True] * (2 * 30)  # two layers, 30 decode steps
    assert torch.equal(static_ids, ids)
    assert (static_logits - logits).abs().max().item() < 1e-4


def test_dynamic_keeps_the_codec_and_static_lengths_hold_across_calls(compiled):
    """cache_implementation="dynamic" gets the codec cache, not a DynamicCache that drops the codec; a static call
    after a longer one keeps the longer length (its compiled step keeps its shapes, as transformers does)."""
    ids, _, cache = generate(compiled["post-rope"])
    dynamic_ids, _, dynamic_cache = generate(compiled["post-rope"], cache_implementation="dynamic")
    assert type(dynamic_cache) is type(cache) and torch.equal(dynamic_ids, ids)
    model = kvrewrite.load(compiled["post-rope"], rate=0.5, kv_codec=CODEC).eval()
    lengths = []
    for new in (20, 5):
        with torch.no_grad():
            out = model.generate(
                input_ids=IDS, attention_mask=MASK, max_new_tokens=new, pad_token_id=0, do_sample=False,
                cache_implementation="static", return_dict_in_generate=True,
            )  # fmt: skip
        lengths.append(out.past_key_values.max_cache_len)
    assert lengths == [IDS.shape[1] + 20 - 1] * 2  # the last token is never cached


def test_beam_search_reorders_the_buffers_in_place(compiled):
    beams = {"num_beams": 4, "num_return_sequences": 4}
    ids, _, _ = generate(compiled["post-rope"], **beams)
    static_ids, _, cache = generate(compiled["post-rope"], cache_implementation="static", **beams)
    assert torch.equal(static_ids, ids) and isinstance(cache, StaticCodecCache)
    # A reorder keeps every buffer where it was (the addresses a captured graph reads) and moves its rows.
    before = [[t.clone() for t in layer._batch_buffers()] for layer in cache.layers]
    addresses = [[t.data_ptr() for t in layer._batch_buffers()] for layer in cache.layers]
    beam_idx = torch.arange(before[0][0].shape[0]).flip(0)
    cache.reorder_cache(beam_idx)
    for layer, old, where in zip(cache.layers, before, addresses):
        now = layer._batch_buffers()
        assert [t.data_ptr() for t in now] == where
        assert all(torch.equal(t, o.index_select(0, beam_idx)) for t, o in zip(now, old))


def test_refusals_name_the_way_out(compiled):
    with pytest.raises(InvalidArgumentError, match="no static cache"):
        generate(compiled["post-rope"], codec="gear", cache_implementation="static")
    for implementation in ("offloaded_static", "quantized", "offloaded"):  # caches without the codec
        with pytest.raises(InvalidArgumentError, match="without this model's int4"):
            generate(compiled["post-rope"], cache_implementation=implementation)
    model = kvrewrite.load(compiled["post-rope"], recent_window=4, evict={"keep": 0.5}).eval()
    with pytest.raises(InvalidArgumentError, match="token tiers"):
        model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, cache_implementation="static")
    codec = build_layer_codecs(parse_codec("int4:residual=4,group_size=16"), [[4, 4]], [[4, 4]])[0]
    layer = StaticCodecLayer(codec, residual=4, max_cache_len=40)
    layer.update_coded(torch.randn(2, 1, 30, 8), torch.randn(2, 1, 30, 8))
    with pytest.raises(InvalidArgumentError, match="holds 40 tokens"):
        layer.update_coded(torch.randn(2, 1, 11, 8), torch.randn(2, 1, 11, 8))
    layer.update_coded(torch.randn(2, 1, 10, 8), torch.randn(2, 1, 10, 8))  # exactly full
    with pytest.raises(RuntimeError, match="static codec cache is full"):  # a step past it: the device's assert
        layer.update_coded(torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8))
    with pytest.raises(InvalidArgumentError, match="batches of 2"):
        layer.update_coded(torch.randn(3, 1, 1, 8), torch.randn(3, 1, 1, 8))
    with pytest.raises(InvalidArgumentError, match="cannot be cropped"):
        layer.crop(10)
    gear = build_layer_codecs(parse_codec("gear"), [[4, 4]], [[4, 4]])[0]
    with pytest.raises(InvalidArgumentError, match="no static cache"):
        StaticCodecLayer(gear, residual=4, max_cache_len=40)
