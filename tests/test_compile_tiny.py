"""End-to-end compiles of tiny random Llamas (GQA and MHA): equivalence, cached decoding, cache size, loading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import one_shot_and_cached_logits, random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoModelForCausalLM

import kvrewrite
from kvrewrite.compile import probes
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.io.checkpoint_io import write_checksums
from kvrewrite.publish.evaluation import kv_cache_bytes_per_token
from kvrewrite.runtime.kernels.cache_layout import COLUMNS, ROWS, packed_view

MODES = ["freq", "post-rope", "latent", "crosshead"]
OBJECTIVES = ["zack", "optimal"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {
        "gqa": save_tiny_llama(root / "gqa", seed=0, num_kv_heads=2, num_heads=4),
        "mha": save_tiny_llama(root / "mha", seed=1, num_kv_heads=4, num_heads=4),
    }


def compile_tiny(src, out, **options):
    plan = Plan(model=str(src), output=out, progress=False, **{"target_rate": 0.5, **options})
    return run_pipeline(plan, tiny_pipeline())


def original(src):
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


@pytest.mark.parametrize("geometry", ["gqa", "mha"])
@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("mode", MODES)
def test_full_rank_rewrite_keeps_logits(sources, tmp_path, geometry, objective, mode):
    src = sources[geometry]
    ctx = compile_tiny(src, tmp_path / "out", target_rate=0.0, objective=objective, rope_mode=mode)
    assert ctx.spec.achieved_rate == 0.0
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-4
    rewritten = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(rewritten).__name__ == "KVRewriteLlamaForCausalLM"
    tokens = random_windows(2, 40, seed=11)  # not the calibration tokens
    with torch.no_grad():
        diff = (rewritten(tokens).logits - original(src)(tokens).logits).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("geometry", ["gqa", "mha"])
@pytest.mark.parametrize("mode", MODES)
def test_cached_decoding_matches_one_shot_and_cache_shrinks(sources, tmp_path, geometry, mode):
    src = sources[geometry]
    ctx = compile_tiny(src, tmp_path / "out", rope_mode=mode, allocation="greedy")
    model = kvrewrite.load(tmp_path / "out")
    tokens = random_windows(2, 36, seed=3)
    one_shot, cached, cache = one_shot_and_cached_logits(model, tokens)
    assert (cached - one_shot).abs().max().item() < 1e-4

    # The cache really holds the reduced latents: one packed pseudo-head per layer, stored column-major
    # ([B, C, S, 1]) for the CPU rank-bucket runner and the tiled latent decode, token-major rows for crosshead keys.
    kept = ctx.spec.kept_elements_per_token
    order = ROWS if mode == "crosshead" else COLUMNS
    for layer, layer_spec in zip(cache.layers, ctx.spec.layers):
        rk, rv = sum(layer_spec.key_ranks), sum(layer_spec.value_ranks)
        assert packed_view(layer.keys).shape == (2, 1, 36, rk)
        assert packed_view(layer.values).shape == (2, 1, 36, rv)
        assert layer.keys.shape == ((2, rk, 36, 1) if order == COLUMNS else (2, 1, 36, rk))
    measured = kv_cache_bytes_per_token(model, seq_len=32)
    baseline = kv_cache_bytes_per_token(original(src), seq_len=32)
    assert measured == kept * 4
    assert abs(measured / baseline - (1 - 0.5)) <= 0.02  # within one rotary pair of 128 elements


def test_rate_table_slice_equals_direct_compile(sources, tmp_path):
    src = sources["gqa"]
    compile_tiny(src, tmp_path / "p50", target_rate=0.5)
    compile_tiny(src, tmp_path / "p30", target_rate=0.3)
    sliced = kvrewrite.load(tmp_path / "p50", rate=0.3)
    direct = kvrewrite.load(tmp_path / "p30")
    assert sliced.compression_spec.layers == direct.compression_spec.layers
    tokens = random_windows(1, 30, seed=4)
    with torch.no_grad():
        assert torch.equal(sliced(tokens).logits, direct(tokens).logits)
    with pytest.raises(kvrewrite.errors.InvalidArgumentError, match="rate table"):
        kvrewrite.load(tmp_path / "p50", rate=0.33)


@pytest.mark.parametrize("mode", MODES)
def test_left_padded_batch_generation_matches_single(sources, tmp_path, mode):
    src = sources["gqa"]
    compile_tiny(src, tmp_path / "out", rope_mode=mode)
    model = kvrewrite.load(tmp_path / "out")
    short, long = [5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]
    batch = torch.tensor([[0] * 3 + short, long])
    mask = torch.tensor([[0] * 3 + [1] * 4, [1] * 7])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    together = model.generate(input_ids=batch, attention_mask=mask, **kwargs)
    for row, prompt in enumerate((short, long)):
        alone = model.generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs
        )
        assert together[row, -6:].tolist() == alone[0, -6:].tolist()


def test_beam_search_with_cache_matches_without(sources, tmp_path):
    src = sources["gqa"]
    compile_tiny(src, tmp_path / "out", rope_mode="latent")
    model = kvrewrite.load(tmp_path / "out")
    prompt = torch.tensor([[5, 17, 33, 8, 41]])
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.tolist() == uncached.tolist()


def test_corrupted_shard_is_refused(sources, tmp_path):
    compile_tiny(sources["gqa"], tmp_path / "out")
    shard = tmp_path / "out" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in tensor data: the header still parses
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_missing_weight_raises_instead_of_reinitialising(sources, tmp_path):
    compile_tiny(sources["gqa"], tmp_path / "out", rope_mode="latent")
    shard = tmp_path / "out" / "model.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.1.self_attn.k_up"]
    save_file(tensors, shard, metadata={"format": "pt"})
    write_checksums(tmp_path / "out", ["model.safetensors"])  # consistent checksums: only the tensor is missing
    with pytest.raises(CorruptCheckpointError, match="k_up"):
        kvrewrite.load(tmp_path / "out")


def test_mismatched_spec_raises(sources, tmp_path):
    compile_tiny(sources["gqa"], tmp_path / "out", rope_mode="latent")
    config_path = tmp_path / "out" / "config.json"
    config = json.loads(config_path.read_text())
    config["kvrewrite"]["layers"][0]["key_mode"] = "post-rope"  # spec no longer matches the tensors
    config_path.write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError):
        kvrewrite.load(tmp_path / "out")


def test_checkpoint_layout(sources, tmp_path):
    ctx = compile_tiny(sources["gqa"], tmp_path / "out")
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kvrewrite_llama"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kvrewrite.KVRewriteLlamaForCausalLM"
    assert "quantization_config" not in config
    from kvrewrite.io.checkpoint_io import read_safetensors_metadata

    assert json.loads(read_safetensors_metadata(out)["kvrewrite_spec"]) == config["kvrewrite"]
    metadata = json.loads((out / "kernel_metadata.json").read_text())
    assert metadata["kept_elements_per_token"] == ctx.spec.kept_elements_per_token
    assert set(metadata["rate_table"]) >= {"0.30", "0.50", "0.60"}
    report = json.loads((out / "compress_report.json").read_text())
    assert report["verification"]["full_rank_max_abs_logit_diff"] < 1e-4
    for name in ("tokenizer.json", "modeling_kvrewrite.py", "kvrewrite_checksums.json"):
        assert (out / name).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


@pytest.mark.parametrize("mode", MODES)
def test_sensitivity_probe_equals_real_truncation(sources, tmp_path, mode):
    compile_tiny(sources["gqa"], tmp_path / "out", rope_mode=mode)
    probed = kvrewrite.load(tmp_path / "out", rate=0.0)  # full rank
    truncated = kvrewrite.load(tmp_path / "out", rate=0.0)
    keys, values = ([10, 0] if mode == "crosshead" else [6, 4]), [10, 2]  # crosshead: one shared key block
    truncated.model.layers[1].self_attn.set_ranks(keys, values)
    tokens = random_windows(2, 24, seed=8)
    with torch.no_grad(), probes.truncated(probed.model.layers[1].self_attn, keys, values):
        assert (probed(tokens).logits - truncated(tokens).logits).abs().max().item() < 1e-5


def test_sensitivity_allocation_weights_layers_by_measured_kl(sources, tmp_path):
    ctx = compile_tiny(sources["gqa"], tmp_path / "out", allocation="sensitivity")
    weights = ctx.report["sensitivity"]["weights"]
    assert set(weights) == {"0.key", "0.value", "1.key", "1.value"}
    assert sum(weights.values()) / 4 == pytest.approx(1.0)
    assert all(p["kl"] > 0 for points in ctx.report["sensitivity"]["probes"].values() for p in points)
    assert ctx.spec.allocation == "sensitivity" and abs(ctx.spec.achieved_rate - 0.5) < 0.02
    # Other allocations skip the probe entirely.
    assert "sensitivity" not in compile_tiny(sources["gqa"], tmp_path / "g", allocation="greedy").report
