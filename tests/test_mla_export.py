"""The MLA form (method/mla.py) and its DeepSeek-V3 export (compile/mla/deepseek_v3_export.py) on tiny random Llamas."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvrewrite.compile.mla.export import export_at_share, prepare_source
from kvrewrite.compile.mla.form import (
    MLAWidths,
    compute_mla_layers,
    latent_max_mean_square,
    mla_reference_model,
    widths_for_share,
)
from kvrewrite.compile.passes.collect_statistics import CollectStatistics
from kvrewrite.compile.passes.load_checkpoint import LoadCheckpoint
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError, UnsupportedModelError
from kvrewrite.method.latent_norm import dtype_holds_latent, neutralise_latent_norm, relative_error
from kvrewrite.method.mla import full_latent_rank
from tests.tiny_models import FixedCalibration, random_windows, save_tiny_llama, word_tokenizer


def _prepared(tmp_path, **config):
    src = save_tiny_llama(tmp_path / "src", **config)
    plan = Plan(model=str(src), progress=False)
    return prepared_from(plan)


def prepared_from(plan):
    return prepare_source(plan, [LoadCheckpoint(), FixedCalibration(random_windows()), CollectStatistics()])


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return _prepared(tmp_path_factory.mktemp("gqa"))  # 4 query heads, 2 KV heads, head_dim 16


def test_full_width_mla_equals_the_original(gqa):
    geo = gqa.ctx.geometry
    n_kv, d = geo.num_key_value_heads, geo.head_dim
    layers = compute_mla_layers(gqa.ctx, gqa.inputs, MLAWidths(n_kv, n_kv * d, full_latent_rank(geo, n_kv), 1.0))
    model = copy.deepcopy(gqa.ctx.original_model()).double()  # the shared float32 original stays as it is
    tokens = random_windows(2, 40, seed=5)
    assert (_logits(mla_reference_model(model, layers), tokens) - _logits(model, tokens)).abs().max() < 1e-9


def test_attention_input_sums_are_the_original_models(gqa):
    """The Grams and largest squared norms summed on the device during the layer-streamed statistics equal the ones
    a plain forward of the original model gives for the same windows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gqa.ctx.plan.model, dtype=torch.float32).eval()
    seen = {}

    def hook(idx):
        def record(_module, args):
            seen.setdefault(idx, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).double())

        return record

    for idx, layer in enumerate(model.model.layers):
        layer.self_attn.k_proj.register_forward_pre_hook(hook(idx))
    with torch.no_grad():
        model(random_windows())
    assert len(gqa.inputs.grams) == len(seen) == len(model.model.layers)
    for idx, xs in seen.items():
        x = torch.cat(xs)
        torch.testing.assert_close(gqa.inputs.grams[idx], x.T @ x, rtol=1e-5, atol=1e-6)
        assert gqa.inputs.max_square_norms[idx] == pytest.approx(float(x.square().sum(-1).max()), rel=1e-5)


def test_narrower_forms_cost_more(gqa):
    """Dropping RoPE from the second component, then narrowing the latent: each step moves the logits further."""
    geo = gqa.ctx.geometry
    model = gqa.ctx.original_model()
    tokens = random_windows(2, 40, seed=5)
    ref = _logits(model, tokens)
    diffs = []
    for widths in (MLAWidths(1, geo.head_dim, full_latent_rank(geo, 1), 1.0), widths_for_share(geo, 0.5)):
        layers = compute_mla_layers(gqa.ctx, gqa.inputs, widths)
        diffs.append(float((_logits(mla_reference_model(model, layers), tokens) - ref).abs().max()))
    assert 1e-4 < diffs[0] < diffs[1]


def _stock_logits_in_fresh_process(out, tokens, tmp_path) -> tuple[torch.Tensor, dict]:
    """Load `out` with AutoModelForCausalLM in a new interpreter that cannot import kvrewrite."""
    torch.save(tokens, tmp_path / "tokens.pt")
    code = (
        "import sys, json, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, dtype=torch.float32).eval()\n"
        "assert 'kvrewrite' not in sys.modules\n"
        f"logits = m(torch.load({str(tmp_path / 'tokens.pt')!r})).logits.detach()\n"
        f"torch.save(logits, {str(tmp_path / 'stock.pt')!r})\n"
        "print(json.dumps({'class': type(m).__name__, 'rms_norm_eps': m.config.rms_norm_eps}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    # Run from a directory without kvrewrite in it, so it cannot be imported by accident.
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, check=True
    )
    return torch.load(tmp_path / "stock.pt"), json.loads(done.stdout.strip().splitlines()[-1])


def test_export_loads_in_stock_transformers_with_the_logits_of_our_maths(gqa, tmp_path):
    widths = widths_for_share(gqa.ctx.geometry, 0.5)
    layers = compute_mla_layers(gqa.ctx, gqa.inputs, widths)
    out = tmp_path / "mla"
    export_at_share(gqa, layers, out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["q_lora_rank"] is None
    assert config["kv_lora_rank"] == widths.kv_lora_rank and config["qk_rope_head_dim"] == widths.qk_rope_head_dim
    assert config["first_k_dense_replace"] == config["num_hidden_layers"] and isinstance(
        config["n_routed_experts"], int
    )
    assert config["tie_word_embeddings"] is False and (out / "tokenizer.json").is_file()
    tokens = random_windows(2, 40, seed=5)
    stock, info = _stock_logits_in_fresh_process(out, tokens, tmp_path)
    assert info["class"] == "DeepseekV3ForCausalLM" and info["rms_norm_eps"] == 1e-6
    ours = _logits(mla_reference_model(gqa.ctx.original_model(), layers), tokens)
    assert (stock - ours).abs().max() < 1e-4


def test_our_export_runs_in_our_absorbed_runtime_as_in_stock_transformers(gqa, tmp_path):
    """The export carries the kvrewrite_mla marker, so kvrewrite.load runs it with the absorbed attention (cache:
    latent + k_pe only); its logits, one-shot and through its own cache, equal stock DeepseekV3's on the same files."""
    from transformers import AutoModelForCausalLM

    import kvrewrite
    from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

    layers = compute_mla_layers(gqa.ctx, gqa.inputs, widths_for_share(gqa.ctx.geometry, 0.5))
    out = tmp_path / "mla"
    export_at_share(gqa, layers, out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["kvrewrite_mla"]["format_version"] == 1
    tokens = random_windows(1, 24, seed=7)
    stock = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = kvrewrite.load(out).eval()
    assert type(ours.model.layers[0].self_attn).__name__ != type(stock.model.layers[0].self_attn).__name__
    with torch.no_grad():
        reference = stock(tokens).logits
        assert (ours(tokens).logits - reference).abs().max() < 1e-4
        prefill = ours(tokens[:, :16], use_cache=True)
        step = ours(tokens[:, 16:17], past_key_values=prefill.past_key_values, use_cache=True).logits
    assert (step[:, -1] - reference[:, 16]).abs().max() < 1e-4
    # 17 cached tokens of (kv_lora_rank + qk_rope_head_dim) fp32 values per layer, nothing else.
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert cache_tensor_bytes(prefill.past_key_values) == 17 * width * 4 * config["num_hidden_layers"]


def test_mqa_export_at_full_width_reproduces_the_original(tmp_path):
    """With one KV head, d_r = head_dim keeps every RoPE component: the stock DeepSeek-V3 load is the original."""
    prepared = _prepared(tmp_path, num_kv_heads=1)
    layers = compute_mla_layers(prepared.ctx, prepared.inputs, widths_for_share(prepared.ctx.geometry, 1.0))
    export_at_share(prepared, layers, tmp_path / "mla", dtype=torch.float32)
    tokens = random_windows(2, 40, seed=5)
    stock, _ = _stock_logits_in_fresh_process(tmp_path / "mla", tokens, tmp_path)
    assert (stock - _logits(prepared.ctx.original_model(), tokens)).abs().max() < 1e-4


def test_latent_norm_neutralisation_stays_within_its_bound(gqa):
    eps, tolerance = 1e-6, 1e-6
    layer = compute_mla_layers(gqa.ctx, gqa.inputs, widths_for_share(gqa.ctx.geometry, 0.5))[0]
    bound_input = latent_max_mean_square(layer, gqa.inputs.max_square_norms[0])
    norm = neutralise_latent_norm(bound_input, eps, tolerance)
    # Through the real norm: latents of random hidden states up to the calibration's largest norm.
    x = torch.randn(256, gqa.ctx.geometry.hidden_size, dtype=torch.float64)
    x *= (
        (gqa.inputs.max_square_norms[0] ** 0.5) * torch.rand(256, 1, dtype=torch.float64) / x.norm(dim=-1, keepdim=True)
    )
    c = x @ layer.kv_a_proj_with_mqa[: layer.kv_lora_rank].T
    scaled = norm.scale * c
    normed = norm.norm_weight * scaled / (scaled.square().mean(-1, keepdim=True) + eps).sqrt()
    error = ((normed - c).norm(dim=-1) / c.norm(dim=-1)).max()
    assert float(error) <= tolerance * (1 + 1e-6)
    assert float(relative_error(c.square().mean(-1), norm, eps).max()) <= tolerance * (1 + 1e-6)
    # The neutralised latent is tiny: bfloat16 and float32 hold it, float16 would make it subnormal.
    assert dtype_holds_latent(norm, torch.bfloat16) and dtype_holds_latent(norm, torch.float32)
    assert not dtype_holds_latent(norm, torch.float16)


def test_float16_export_is_refused_before_writing(gqa, tmp_path):
    layers = compute_mla_layers(gqa.ctx, gqa.inputs, widths_for_share(gqa.ctx.geometry, 0.5))
    with pytest.raises(InvalidArgumentError, match="float16 cannot hold"):
        export_at_share(gqa, layers, tmp_path / "mla", dtype=torch.float16)
    assert not (tmp_path / "mla").exists()


def test_a_share_below_the_rope_key_is_refused(gqa):
    # The library names the parameter; the command line prints it as its flag (test_cli_and_errors).
    with pytest.raises(InvalidArgumentError, match="`kv_share=0.2` keeps 13 values per token, not more than the 16"):
        widths_for_share(gqa.ctx.geometry, 0.2)  # 12 of 64 values, below d_r = 16


def test_an_unsupported_family_fails_before_any_work(tmp_path, monkeypatch):
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen")
    word_tokenizer().save_pretrained(tmp_path / "qwen")

    def no_work(*_args, **_kwargs):
        raise AssertionError("work started before the family check")

    monkeypatch.setattr(LoadCheckpoint, "run", no_work)
    with pytest.raises(UnsupportedModelError, match="biases"):
        prepared_from(Plan(model=str(tmp_path / "qwen"), progress=False))


def test_the_cli_exports_and_verifies(tmp_path):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app

    src = save_tiny_llama(tmp_path / "src")
    out = tmp_path / "mla"
    result = CliRunner().invoke(
        app,
        [
            "export-mla",
            str(src),
            "--kv-share",
            "0.5",
            "-o",
            str(out),
            "--calibration",
            "synthetic",
            "--calib-tokens",
            "512",
            "--verify-tokens",
            "32",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "full-width MLA" in result.output and json.loads((out / "config.json").read_text())["kv_lora_rank"] == 16


def test_the_cli_names_what_does_not_fit(tmp_path):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app

    config = Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen")
    result = CliRunner().invoke(app, ["export-mla", str(tmp_path / "qwen"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "biases" in result.output and not (tmp_path / "out").exists()


def test_exact_widths_with_a_narrower_rope_key_export_with_the_logits_of_our_maths(gqa, tmp_path):
    """--kv-lora-rank/--qk-rope-head-dim: d_r = head_dim / 2 keeps frequencies 0, 2, 4, ... (pair p = frequency 2p),
    which DeepSeek's schedule base^(-2p/d_r) rotates exactly as the source did; stock transformers equals our maths."""
    from kvrewrite.compile.mla.export import export_matches_maths
    from kvrewrite.compile.mla.form import widths_for_ranks

    geo = gqa.ctx.geometry  # head_dim 16, 2 KV heads: 64 K+V values per token
    widths = widths_for_ranks(geo, 20, geo.head_dim // 2)
    assert (widths.kv_lora_rank, widths.qk_rope_head_dim, widths.rope_frequency_stride) == (20, 8, 2)
    assert widths.share == (20 + 8) / 64
    layers = compute_mla_layers(gqa.ctx, gqa.inputs, widths)
    assert layers[0].pair_frequency.tolist() == [0, 2, 4, 6]
    assert layers[0].kv_a_proj_with_mqa.shape[0] == 28 and layers[0].q_proj.shape[0] == 4 * (16 + 8)
    out = tmp_path / "mla"
    export_at_share(gqa, layers, out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]) == (20, 8, 16)
    assert export_matches_maths(gqa, layers, out, random_windows(2, 40, seed=5)) < 1e-4


def test_the_default_rope_key_is_unchanged_by_the_stride_option(gqa):
    """widths_for_ranks at qk_rope_head_dim = head_dim gives the same layers, float for float, as the share path."""
    from kvrewrite.compile.mla.form import widths_for_ranks

    geo = gqa.ctx.geometry
    by_share = widths_for_share(geo, 0.5)
    by_ranks = widths_for_ranks(geo, by_share.kv_lora_rank)
    assert by_ranks == by_share
    a = compute_mla_layers(gqa.ctx, gqa.inputs, by_share)[0]
    b = compute_mla_layers(gqa.ctx, gqa.inputs, by_ranks)[0]
    assert torch.equal(a.kv_a_proj_with_mqa, b.kv_a_proj_with_mqa) and torch.equal(a.q_proj, b.q_proj)


def test_exact_widths_that_do_not_fit_are_refused(gqa):
    from kvrewrite.compile.mla.form import widths_for_ranks

    geo = gqa.ctx.geometry
    with pytest.raises(InvalidArgumentError, match="`qk_rope_head_dim` must be head_dim"):
        widths_for_ranks(geo, 8, 6)  # 16 / 6 is not an integer
    with pytest.raises(InvalidArgumentError, match="`qk_rope_head_dim` must be head_dim"):
        widths_for_ranks(geo, 8, 32)  # wider than head_dim
    with pytest.raises(InvalidArgumentError, match="`kv_lora_rank` must be within 1..56"):
        widths_for_ranks(geo, 64 - 8 + 1, 8)  # above the full latent at d_r = 8


def test_the_cli_exports_exact_widths(tmp_path):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app

    src = save_tiny_llama(tmp_path / "src")
    out = tmp_path / "mla"
    result = CliRunner().invoke(
        app,
        [
            "export-mla",
            str(src),
            "--kv-lora-rank",
            "20",
            "--qk-rope-head-dim",
            "8",
            "-o",
            str(out),
            "--calibration",
            "synthetic",
            "--calib-tokens",
            "512",
            "--verify-tokens",
            "32",
        ],
    )
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (20, 8)
    refused = CliRunner().invoke(
        app, ["export-mla", str(src), "--kv-lora-rank", "20", "--qk-rope-head-dim", "6", "-o", str(tmp_path / "bad")]
    )
    assert refused.exit_code == 2 and "--qk-rope-head-dim" in refused.output and not (tmp_path / "bad").exists()
