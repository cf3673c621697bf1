"""Layer streaming: the same numbers as whole-model references, one layer of weights at a time, shards written as they fill."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from sharded_random_llama import write_random_llama
from tiny_families import TINY_CONFIGS, save_tiny_family
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import kvrewrite
from kvrewrite.adapters import adapter_for
from kvrewrite.compile.layer_streaming import SourceModel
from kvrewrite.compile.passes.collect_statistics import collect_statistics
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.compile.probes import truncated
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.io.checkpoint_io import SAFETENSORS_INDEX_FILE, ShardWriter


def sharded_config(layers: int = 3) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module")
def sharded_source(tmp_path_factory):
    """An untied 3-layer Llama in fp32, split into many small shards by the streaming writer."""
    return write_random_llama(
        tmp_path_factory.mktemp("sharded") / "src", sharded_config(), dtype=torch.float32, max_shard_size=40_000
    )


def open_source(path) -> SourceModel:
    config = AutoConfig.from_pretrained(path)
    return SourceModel.open(path, config, adapter_for(config))


def dense_reference_grams(path, windows):
    """Grams from the whole model in float64 with every activation kept (no streaming, no accumulation)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    config = model.config
    d, n_q, n_kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    acts = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            handles.append(
                getattr(attn, name).register_forward_hook(
                    lambda _m, _i, out, i=i, name=name: acts.setdefault((i, name), []).append(out)
                )
            )
        handles.append(
            attn.o_proj.register_forward_pre_hook(lambda _m, inp, i=i: acts.setdefault((i, "o"), []).append(inp[0]))
        )
    with torch.no_grad():
        model(input_ids=windows)
    for h in handles:
        h.remove()
    grams = []
    for i in range(config.num_hidden_layers):
        q = torch.cat(acts[(i, "q_proj")]).reshape(-1, n_q, d)
        k = torch.cat(acts[(i, "k_proj")]).reshape(-1, n_kv, d)
        v = torch.cat(acts[(i, "v_proj")]).reshape(-1, n_kv, d)
        o = torch.cat(acts[(i, "o")]).reshape(-1, n_q, d)
        group = n_q // n_kv
        grams.append(
            {
                "query_pre": torch.stack(
                    [
                        torch.einsum(
                            "thd,the->de", q[:, g * group : (g + 1) * group], q[:, g * group : (g + 1) * group]
                        )
                        for g in range(n_kv)
                    ]
                ),
                "key_pre": torch.einsum("thd,the->hde", k, k),
                "value": torch.einsum("thd,the->hde", v, v),
                "output": torch.einsum("thd,the->hde", o, o),
            }
        )
    return grams


def test_streamed_statistics_equal_dense_whole_model_grams(sharded_source):
    windows = random_windows(6, 32, seed=5)
    source = open_source(sharded_source)
    stats = collect_statistics(source.streamed(torch.float64), windows, batch_size=4, progress=False)
    reference = dense_reference_grams(sharded_source, windows)
    for layer, ref in zip(stats.layers, reference):
        assert layer.tokens == windows.numel()
        for kind, expected in ref.items():
            got = layer.grams[kind]
            assert (got - expected).abs().max() <= 1e-10 * expected.abs().max(), kind


def test_runner_holds_one_layer_of_weights_at_a_time(sharded_source):
    source = open_source(sharded_source)
    model = source.streamed(torch.float32)
    collect_statistics(model, random_windows(4, 24), batch_size=2, progress=False)
    layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    embedding = source.skeleton.get_input_embeddings().weight.numel()
    total = source.num_parameters()
    assert model.peak_resident_params == max(layer_params, embedding)
    assert model.peak_resident_params < total / 3
    assert model.resident_params == 0  # everything is back on the meta device
    assert all(p.device.type == "meta" for p in source.skeleton.parameters())
    # Every tensor statistics needs was read exactly once: the embedding and each layer (not the norm or LM head).
    layer_tensors = sum(len(layer.state_dict()) for layer in model.layers)
    assert source.checkpoint.tensors_read == 1 + layer_tensors


def test_random_llama_is_written_in_shards_and_loads(sharded_source):
    index = json.loads((sharded_source / SAFETENSORS_INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 3
    model = AutoModelForCausalLM.from_pretrained(sharded_source)
    assert model.config.num_hidden_layers == 3
    assert model.model.layers[2].mlp.up_proj.weight.abs().sum() > 0  # real data, not re-initialised zeros


def test_shard_writer_writes_before_finish(tmp_path):
    writer = ShardWriter(tmp_path, {"note": "x"}, max_shard_size=1000)
    for i in range(5):
        writer.add(f"t{i}", torch.full((100,), float(i)))  # 400 bytes each: two per shard
    assert writer.shards_written == 2 and len(list(tmp_path.glob(".part-*"))) == 2  # on disk already
    names = writer.finish()
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with safe_open(str(tmp_path / names[2]), framework="pt") as f:
        assert f.metadata()["note"] == "x" and torch.equal(f.get_tensor("t4"), torch.full((100,), 4.0))
    again = ShardWriter(tmp_path, {}, 1000)
    again.add("a", torch.ones(1))
    with pytest.raises(InvalidArgumentError, match="twice"):
        again.add("a", torch.ones(1))


def compile_source(src, out, **options):
    plan = Plan(model=str(src), output=out, progress=False, **{"target_rate": 0.5, **options})
    return run_pipeline(plan, tiny_pipeline())


def test_sharded_output_equals_single_shard_and_is_equivalent_at_full_rank(sharded_source, tmp_path):
    many = compile_source(sharded_source, tmp_path / "many", max_shard_size="30KB", allocation="greedy")
    compile_source(sharded_source, tmp_path / "one", max_shard_size="1GB", allocation="greedy")
    shards = json.loads((tmp_path / "many" / SAFETENSORS_INDEX_FILE).read_text())["weight_map"].values()
    assert len(set(shards)) >= 4 and (tmp_path / "one" / "model.safetensors").is_file()
    assert many.verification["full_rank_max_abs_logit_diff"] < 1e-6  # float64, layer-streamed (fp32 noise is ~1e-4)
    assert max(many.verification["full_rank_layer_max_abs_hidden_diff"]) < 1e-6
    tokens = random_windows(2, 30, seed=9)
    with torch.no_grad():
        a, b = kvrewrite.load(tmp_path / "many")(tokens).logits, kvrewrite.load(tmp_path / "one")(tokens).logits
        assert torch.equal(a, b)
        full = kvrewrite.load(tmp_path / "many", rate=0.0)(tokens).logits
        original = AutoModelForCausalLM.from_pretrained(sharded_source, dtype=torch.float32)(tokens).logits
    assert (full - original).abs().max().item() < 1e-4


def test_streamed_sensitivity_equals_whole_model_probe(tmp_path):
    src = save_tiny_llama(tmp_path / "src", seed=2, layers=3)
    tokens = random_windows(8, 48)
    ctx = compile_source(src, tmp_path / "out", allocation="sensitivity", rope_mode="latent", probe_rates=(0.5, 0.75))
    probe_tokens = tokens[:2, :256]
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = kvrewrite.load(tmp_path / "out", rate=0.0)
    checks = [
        (idx, side, probe)
        for idx, side in ((0, "value"), (1, "key"), (2, "value"))
        for probe in ctx.report["sensitivity"]["probes"][f"{idx}.{side}"]
    ]
    assert len(checks) == 6  # two probe rates per layer side (a KL curve), all from one streamed pass
    for idx, side, probe in checks:
        r, d = probe["rank"], model.config.head_dim
        keep = [r] * model.config.num_key_value_heads
        full = [d] * len(keep)
        with (
            torch.no_grad(),
            truncated(model.model.layers[idx].self_attn, *((keep, full) if side == "key" else (full, keep))),
        ):
            ref = F.log_softmax(original(probe_tokens).logits, -1)
            new = F.log_softmax(model(probe_tokens).logits, -1)
        kl = float((ref.exp() * (ref - new)).sum(-1).mean())
        assert probe["kl"] == pytest.approx(kl, rel=1e-3, abs=1e-8)  # fp32 rounding of tiny KLs


def test_bfloat16_compile_on_cpu(tmp_path):
    src = save_tiny_llama(tmp_path / "src", seed=3)
    ctx = compile_source(src, tmp_path / "out", target_rate=0.0, dtype="bf16", allocation="greedy")
    assert ctx.plan.dtype == "bfloat16" and ctx.verification["compute_dtype"] == "bfloat16"
    # The float64 check sees the exact fold, not the bf16-rounded output.
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-6
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    tokens = random_windows(2, 30, seed=9)
    with torch.no_grad():
        compressed = kvrewrite.load(tmp_path / "out").float()(tokens).logits
        original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(tokens).logits
    # bf16 rounding of the weights only: top-1 agrees, logits close.
    assert (compressed.argmax(-1) == original.argmax(-1)).float().mean() > 0.95
    assert (compressed - original).abs().max().item() < 0.1


@pytest.mark.parametrize(("source", "written"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_dtype_auto_computes_and_writes_in_the_sources_dtype(tmp_path, source, written):
    """No --dtype: auto, the source's dtype where it is float32 or bfloat16 (a bfloat16 source compiles and is written
    in bfloat16), else float32 (float16); the report records the dtype used."""
    src = write_random_llama(tmp_path / "src", sharded_config(layers=2), dtype=source)
    ctx = compile_source(src, tmp_path / "out", target_rate=0.0, allocation="greedy")
    name = str(written).removeprefix("torch.")
    assert ctx.plan.dtype == "auto" and ctx.verification["compute_dtype"] == name
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-6  # float64, whatever the compute dtype
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {written}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == name
    report = json.loads((tmp_path / "out" / "compress_report.json").read_text())
    assert report["verification"]["compute_dtype"] == name


def test_device_and_dtype_options_are_validated():
    assert Plan(model="x", dtype="fp32").dtype == "float32"
    with pytest.raises(InvalidArgumentError, match="`dtype`"):
        Plan(model="x", dtype="float16")
    with pytest.raises(InvalidArgumentError, match="`device`"):
        Plan(model="x", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="CUDA"):
            Plan(model="x", device="cuda")
    with pytest.raises(InvalidArgumentError, match="`max_shard_size`"):
        Plan(model="x", max_shard_size="lots")


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_streamed_forward_of_every_family_equals_the_stock_model(tmp_path, family):
    """Layer by layer (learned positions, sliding-window masks, Gemma's scaled embeddings and per-layer RoPE,
    fused qkv, q/k norms, biases) the runner reproduces the stock forward, holding one layer at a time."""
    src = save_tiny_family(tmp_path / family, family)
    tokens = random_windows(2, 20, seed=4)  # longer than the 12-token sliding windows
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64).eval()(tokens, use_cache=False).logits
    source = open_source(src)
    model = source.streamed(torch.float64)
    with torch.inference_mode():
        hidden = model.embed(tokens)
        inputs = model.layer_inputs(hidden)
        for idx in range(len(model.layers)):
            with model.layer(idx) as layer:
                hidden = model.run_layer(layer, hidden, inputs)
        logits = model.logits(hidden)
    assert (logits - expected).abs().max().item() < 1e-10
    biggest_layer = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    prelude = sum(p.numel() for m in model.prelude for p in m.parameters())
    head = source.skeleton.get_output_embeddings().weight.numel() + sum(
        p.numel() for m in model.final_modules for p in m.parameters()
    )
    assert model.peak_resident_params == max(biggest_layer, prelude, head) < source.num_parameters()
    assert model.resident_params == 0 and all(p.device.type == "meta" for p in source.skeleton.parameters())
