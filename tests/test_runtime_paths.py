"""The runtime picks its attention path by device; every path gives the reference model's outputs."""

from __future__ import annotations

import pytest
import torch
from tiny_models import compile_tiny_modes
from transformers import DynamicCache, StaticCache

import kvrewrite
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.kernels.buckets import BucketedAttention
from kvrewrite.runtime.kernels.cache_layout import packed_view
from kvrewrite.runtime.kernels.dispatch import resolve_backend


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_tiny_modes(
        tmp_path_factory.mktemp("paths"), ("freq", "post-rope"), seed=3, num_kv_heads=2, num_heads=4
    )


def _generate_logits(directory, monkeypatch, backend: str) -> torch.Tensor:
    monkeypatch.setenv("KVREWRITE_ATTENTION", backend)
    model = kvrewrite.load(directory).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.stack(out.logits, dim=1)  # [B, new tokens, vocab]; prefill then 2 decode steps


def test_cpu_runs_rank_buckets_by_default(compiled, monkeypatch):
    monkeypatch.delenv("KVREWRITE_ATTENTION", raising=False)
    assert resolve_backend(torch.device("cpu")) == "torch"
    model = kvrewrite.load(compiled["freq"])
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    assert isinstance(model.model.layers[0].self_attn.packed_attention_runner(torch.device("cpu")), BucketedAttention)


def test_unknown_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KVREWRITE_ATTENTION", "cudnn")
    with pytest.raises(InvalidArgumentError, match="KVREWRITE_ATTENTION"):
        resolve_backend(torch.device("cpu"))


@pytest.mark.parametrize("mode", ["freq", "post-rope"])
def test_bucketed_and_triton_generation_match_reference(compiled, monkeypatch, mode):
    pytest.importorskip("triton")
    reference = _generate_logits(compiled[mode], monkeypatch, "reference")
    for backend in ("torch", "triton"):
        logits = _generate_logits(compiled[mode], monkeypatch, backend)
        assert (logits - reference).abs().max().item() < 1e-4, backend


def _decode_logits(directory, monkeypatch, backend: str, rate: float, cache_kind: str) -> tuple[torch.Tensor, object]:
    """Left-padded batch: prefill 6 tokens, then 4 single-token steps through the given cache class."""
    monkeypatch.setenv("KVREWRITE_ATTENTION", backend)
    model = kvrewrite.load(directory, rate=rate).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    cache = (
        DynamicCache(config=model.config)
        if cache_kind == "dynamic"
        else StaticCache(config=model.config, max_cache_len=16)
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
            past_key_values=cache,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.stack(out.logits, dim=1), cache


@pytest.mark.parametrize("rate", [0.0, 0.5], ids=["p0-equal-ranks", "p0.5-mixed-ranks"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_torch_path_stores_columns_in_stock_caches_and_matches_reference(compiled, monkeypatch, rate, cache_kind):
    """CPU decode gives the reference path's logits through transformers' own caches; the DynamicCache holds
    the packed latents column-major, the StaticCache (values sized by the keys' dim 1) token-major rows."""
    reference, ref_cache = _decode_logits(compiled["post-rope"], monkeypatch, "reference", rate, cache_kind)
    logits, cache = _decode_logits(compiled["post-rope"], monkeypatch, "torch", rate, cache_kind)
    assert (logits - reference).abs().max().item() < 1e-4
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        assert ref_layer.keys.shape[1] == 1  # reference: token-major [B, 1, S, C]
        if cache_kind == "dynamic":  # torch runner: column-major [B, C, S, 1]
            assert layer.keys.shape[1] > 1 and layer.keys.shape[-1] == 1 and layer.values.shape[-1] == 1
        else:
            assert layer.keys.shape[1] == 1 and layer.values.shape[1] == 1
        assert (packed_view(layer.keys) - ref_layer.keys).abs().max().item() < 1e-5
        assert (packed_view(layer.values) - ref_layer.values).abs().max().item() < 1e-5
