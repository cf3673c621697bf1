"""Our absorbed runtime for the MLA form (kvrewrite.runtime.mla) against stock DeepseekV3, on tiny random models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

import kvrewrite
from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
from kvrewrite.runtime.mla.attention import AbsorbedMLAAttention, expansion_is_cheaper
from kvrewrite.runtime.mla.checkpoint import MLA_MARKER, absorb_attention
from kvrewrite.runtime.mla.latent_cache import latent_cache_bytes

VOCAB = 101


def tiny_config(rope_interleave: bool = True, q_lora_rank: int | None = None, attn: str = "sdpa") -> DeepseekV3Config:
    # Uneven widths (r = 24, d_r = 8, d_nope = 12, d_v = 10) so that a mixed-up split cannot pass by symmetry.
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        first_k_dense_replace=2,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        rope_interleave=rope_interleave,
        initializer_range=0.2,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,  # no early stop: compare whole runs
    )
    config._attn_implementation = attn
    return config


def stock_and_ours(config: DeepseekV3Config, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    stock = DeepseekV3ForCausalLM(config).to(dtype).eval()
    return stock, absorb_attention(copy.deepcopy(stock)).eval()


def set_path(model, path: str) -> None:
    for layer in model.model.layers:
        layer.self_attn.path = path


def ids(batch: int = 2, length: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rope_interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [None, 16])
@pytest.mark.parametrize("path", ["absorbed", "expanded"])
def test_one_shot_logits_equal_stock(rope_interleave, q_lora_rank, path):
    stock, ours = stock_and_ours(tiny_config(rope_interleave, q_lora_rank))
    assert all(isinstance(layer.self_attn, AbsorbedMLAAttention) for layer in ours.model.layers)
    set_path(ours, path)
    x = ids()
    with torch.no_grad():
        want, got = stock(x).logits, ours(x).logits
    assert want.abs().max() > 1.0  # logits far from uniform: the comparison means something
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_eager_stock_agrees_too():
    stock, ours = stock_and_ours(tiny_config(attn="eager"))
    set_path(ours, "absorbed")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, stock(x).logits, atol=2e-5, rtol=1e-5)


def test_state_dict_is_the_stock_one():
    stock, ours = stock_and_ours(tiny_config())
    assert list(ours.state_dict()) == list(stock.state_dict())


def test_cached_decoding_equals_one_shot_and_cache_holds_only_latent_rows():
    config = tiny_config()
    _, ours = stock_and_ours(config)
    x = ids(batch=3, length=24)
    with torch.no_grad():
        one_shot = ours(x).logits
        cache = DynamicCache(config=config)
        steps = [ours(x[:, :10], past_key_values=cache, use_cache=True).logits]
        for t in range(10, 24):
            steps.append(ours(x[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), one_shot, atol=2e-5, rtol=1e-5)
    r, dr = config.kv_lora_rank, config.qk_rope_head_dim
    for layer in cache.layers:
        assert layer.keys.shape == (3, 1, 24, r + dr)
        assert layer.values.numel() == 0
    assert cache_tensor_bytes(cache) == (r + dr) * 24 * 3 * config.num_hidden_layers * 4
    assert cache_tensor_bytes(cache) == latent_cache_bytes(3, 24, config.num_hidden_layers, r, dr, torch.float32)


def test_cached_latents_equal_stock_caches():
    """The cached row is exactly stock's cached (normed latent, rotated k_pe), concatenated."""
    config = tiny_config()
    stock, ours = stock_and_ours(config)
    x = ids()
    with torch.no_grad():
        stock_cache, our_cache = DynamicCache(config=config), DynamicCache(config=config)
        stock(x, past_key_values=stock_cache, use_cache=True)
        ours(x, past_key_values=our_cache, use_cache=True)
    for theirs, mine in zip(stock_cache.layers, our_cache.layers):
        torch.testing.assert_close(mine.keys, torch.cat([theirs.keys, theirs.values], dim=-1))


def left_padded(config, length: int, row: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of two whose `row` starts with `pad` pad tokens, and its attention mask."""
    x = ids(batch=2, length=length)
    mask = torch.ones_like(x)
    mask[row, :pad] = 0
    x[row, :pad] = config.pad_token_id
    return x, mask


def test_left_padded_batch_decodes_like_each_sequence_alone():
    config = tiny_config()
    stock, ours = stock_and_ours(config, dtype=torch.float64)
    x, mask = left_padded(config, length=16, row=0, pad=5)
    with torch.no_grad():
        got = ours.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False)
        want = stock.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False)
        alone = ours.generate(x[:1, 5:], attention_mask=mask[:1, 5:], max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert torch.equal(got[0, 16:], alone[0, 11:])


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_greedy_generate_equals_stock(rope_interleave):
    stock, ours = stock_and_ours(tiny_config(rope_interleave), dtype=torch.float64)
    x = ids(batch=2, length=12)
    with torch.no_grad():
        got = ours.generate(x, max_new_tokens=12, do_sample=False)
        want = stock.generate(x, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


def test_beam_search_on_left_padded_batch_equals_stock():
    config = tiny_config()
    stock, ours = stock_and_ours(config, dtype=torch.float64)
    x, mask = left_padded(config, length=10, row=1, pad=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        got = ours.generate(x, **kwargs)
        want = stock.generate(x, **kwargs)
    assert torch.equal(got, want)


def test_decode_takes_the_absorbed_path_and_long_prefill_expands():
    # SmolLM2-shaped MLA at 50% of its K+V values: r = 128, d_r = 64, d_nope = d_v = 64, 9 heads.
    shape = dict(heads=9, rank=128, nope_dim=64, rope_dim=64, value_dim=64)
    assert not expansion_is_cheaper(1, 8192, **shape)
    assert not expansion_is_cheaper(8, 8192, **shape)
    assert expansion_is_cheaper(512, 512, **shape)


def test_decode_never_calls_kv_b_proj():
    """The absorbed path reads kv_b_proj's weight but never runs it over the cached latents."""
    config = tiny_config()
    _, ours = stock_and_ours(config)
    calls = []
    for layer in ours.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda m, a, o: calls.append(a[0].shape))
    x = ids()
    with torch.no_grad():
        cache = DynamicCache(config=config)
        ours(x[:, :4], past_key_values=cache, use_cache=True)
        calls.clear()
        ours(x[:, 4:5], past_key_values=cache, use_cache=True)
    assert calls == []


# ---- loading -------------------------------------------------------------------------------------
def save_export(tmp_path, marker: dict | None = None):
    config = tiny_config()
    stock, _ = stock_and_ours(config)
    stock.config.__dict__[MLA_MARKER] = marker if marker is not None else {"format_version": 1}
    stock.save_pretrained(tmp_path)
    return stock


def test_kvrewrite_load_gives_absorbed_model_and_auto_gives_stock(tmp_path):
    stock = save_export(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())[MLA_MARKER] == {"format_version": 1}
    ours = kvrewrite.load(tmp_path, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert all(isinstance(layer.self_attn, AbsorbedMLAAttention) for layer in ours.model.layers)
    assert type(plain.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"
    x = ids()
    with torch.no_grad():
        want = stock(x).logits
        set_path(ours, "absorbed")
        torch.testing.assert_close(ours(x).logits, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(plain(x).logits, want, atol=2e-5, rtol=1e-5)


def test_load_refuses_rate_and_unknown_format(tmp_path):
    save_export(tmp_path / "ok")
    with pytest.raises(CorruptCheckpointError, match="no rate table"):
        kvrewrite.load(tmp_path / "ok", rate=0.5)
    save_export(tmp_path / "future", marker={"format_version": 99})
    with pytest.raises(CorruptCheckpointError, match="format_version 99"):
        kvrewrite.load(tmp_path / "future")


@pytest.mark.parametrize(
    "keywords, named",
    [
        ({"recent_window": 16}, "recent_window="),
        ({"recent_window": 16, "evict": {"keep": 0.5}}, "recent_window=, evict="),
        ({"kv_codec": "int4"}, "kv_codec="),
        ({"token_policy": False}, "token_policy="),
    ],
)
def test_load_refuses_the_per_head_cache_keywords_on_an_export_naming_them(tmp_path, keywords, named):
    """The token tiers, codecs and budget policy are the per-head checkpoints': on an MLA export they are refused,
    named, instead of being handed to transformers' from_pretrained."""
    from kvrewrite.errors import InvalidArgumentError

    save_export(tmp_path)
    with pytest.raises(InvalidArgumentError, match="is an MLA export") as refused:
        kvrewrite.load(tmp_path, **keywords)
    assert str(refused.value).startswith(named + ":")


def test_load_refuses_a_policy_whose_fields_an_export_cannot_honour(tmp_path):
    """The same refusal for a CachePolicy passed whole: every field but rate is named; rate reaches the rate table."""
    from kvrewrite.errors import InvalidArgumentError

    save_export(tmp_path)
    policy = kvrewrite.CachePolicy(rate=0.5, recent_window=16, kv_codec="int4")
    with pytest.raises(InvalidArgumentError, match="is an MLA export") as refused:
        kvrewrite.load(tmp_path, policy=policy)
    assert str(refused.value).startswith("recent_window=, kv_codec=:")
    with pytest.raises(CorruptCheckpointError, match="no rate table"):
        kvrewrite.load(tmp_path, policy=kvrewrite.CachePolicy(rate=0.5))


def test_plain_deepseek_checkpoint_is_not_taken_for_an_export(tmp_path):
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="not a kvrewrite checkpoint"):
        kvrewrite.load(tmp_path)


def test_the_latent_rows_append_in_place_and_hold_what_torch_cat_would():
    """Reference: stock DynamicLayer (torch.cat on every append), fed the same rows, cropped and batch-selected alike."""
    from transformers.cache_utils import DynamicCache as StockCache

    from kvrewrite.runtime.inplace_cache import InPlaceLayer, grown_capacity
    from kvrewrite.runtime.mla.latent_cache import cache_latent_rows

    torch.manual_seed(0)
    ours, stock = StockCache(), StockCache()
    prefill = torch.randn(2, 1, 300, 12)
    cache_latent_rows(ours, 0, prefill)
    stock.update(prefill, prefill[..., :0], 0)
    layer = ours.layers[0]
    assert isinstance(layer, InPlaceLayer) and type(stock.layers[0]) is not InPlaceLayer
    assert layer._buffers["keys"].shape[-2] == 300  # a prefill holds exactly its rows
    for step in range(20):
        row = torch.randn(2, 1, 1, 12)
        cache_latent_rows(ours, 0, row)
        stock.update(row, row[..., :0], 0)
        if step == 0:  # the first append reallocates in one large step ...
            assert layer._buffers["keys"].shape[-2] == grown_capacity(301) == 557
            buffer = layer._buffers["keys"].data_ptr()
        assert layer._buffers["keys"].data_ptr() == buffer  # ... and the next ones write in place
        assert torch.equal(layer.keys, stock.layers[0].keys) and layer.values.shape[-2] == layer.keys.shape[-2]
    # The room is held memory and counted as such.
    assert cache_tensor_bytes(ours) == layer._buffers["keys"].numel() * 4 > layer.keys.numel() * 4
    for cache in (ours, stock):
        cache.crop(-10)
        cache.batch_select_indices(torch.tensor([1]))
    row = torch.randn(1, 1, 1, 12)
    cache_latent_rows(ours, 0, row)
    stock.update(row, row[..., :0], 0)
    assert torch.equal(ours.layers[0].keys, stock.layers[0].keys) and ours.get_seq_length() == 311
