"""MLA latent widths per layer from measured sensitivity (compile/mla/allocation.py), exported zero-padded and run at
their true widths by our runtime (runtime/mla). References: the maths' own forward at the same widths, stock
DeepseekV3 on the same files, and the form computed directly at a narrower width."""

from __future__ import annotations

import json

import pytest
import torch

from kvrewrite.compile.mla.allocation import RANK_MULTIPLE, allocate_latent_ranks
from kvrewrite.compile.mla.export import export_at_share, mla_layers_allocated
from kvrewrite.compile.mla.form import MLAWidths, compute_mla_layers, mla_reference_model, widths_for_share
from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError
from kvrewrite.method.mla import full_latent_rank, truncate_latent
from tests.test_mla_export import _logits, _prepared, _stock_logits_in_fresh_process
from tests.tiny_models import random_windows


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return _prepared(tmp_path_factory.mktemp("deep"), layers=4)  # 4 layers, 2 KV heads, head_dim 16


@pytest.fixture(scope="module")
def allocated(deep):
    return mla_layers_allocated(deep, 0.5)


def test_a_narrower_latent_is_a_prefix_of_the_full_one(deep):
    """truncate_latent(full, r) is the form computed at r: the same weights, so the same logits."""
    geo = deep.ctx.geometry
    full = compute_mla_layers(deep.ctx, deep.inputs, MLAWidths(1, geo.head_dim, full_latent_rank(geo, 1), 1.0))
    direct = compute_mla_layers(deep.ctx, deep.inputs, widths_for_share(geo, 0.5))
    for cut, made in zip((truncate_latent(layer, direct[0].kv_lora_rank) for layer in full), direct):
        for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert torch.allclose(getattr(cut, name), getattr(made, name), atol=1e-10, rtol=0), name
    with pytest.raises(InvalidArgumentError):
        truncate_latent(full[0], full[0].kv_lora_rank + 1)


def test_the_allocation_keeps_the_uniform_budget_and_moves_it_by_measured_kl(deep, allocated):
    layers = deep.ctx.geometry.num_layers
    ranks = allocated.allocation.ranks
    assert sum(ranks) <= allocated.widths.kv_lora_rank * layers
    assert sum(ranks) > allocated.widths.kv_lora_rank * layers - RANK_MULTIPLE
    assert all(r % RANK_MULTIPLE == 0 and r >= RANK_MULTIPLE for r in ranks)
    assert len(set(ranks)) > 1  # the random layers differ in sensitivity
    # The probes measured something, and a layer given more width is one whose narrow probes cost more KL.
    probes = allocated.sensitivity.probes
    assert all(p.kl == p.kl for p in probes) and max(p.kl for p in probes) > 0
    narrowest = {p.layer: p.kl for p in probes if p.rank == RANK_MULTIPLE}
    widest, thinnest = max(range(layers), key=lambda i: ranks[i]), min(range(layers), key=lambda i: ranks[i])
    assert narrowest[widest] > narrowest[thinnest]


def test_every_share_is_a_prefix_of_one_removal_order(deep, allocated):
    """A smaller share never widens a layer (one order serves every share, as the per-head rate table)."""
    geo = deep.ctx.geometry
    base = compute_mla_layers(deep.ctx, deep.inputs, MLAWidths(1, geo.head_dim, full_latent_rank(geo, 1), 1.0))
    small = allocate_latent_ranks(base, allocated.sensitivity, 8).ranks
    large = allocate_latent_ranks(base, allocated.sensitivity, 24).ranks
    assert all(s <= l for s, l in zip(small, large)) and sum(small) < sum(large)


def test_the_allocated_export_runs_in_stock_transformers_padded_and_in_ours_at_its_widths(deep, allocated, tmp_path):
    from transformers import AutoModelForCausalLM

    import kvrewrite
    from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

    out = tmp_path / "mla"
    export_at_share(deep, allocated.layers, out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    ranks = list(allocated.allocation.ranks)
    assert config["kv_lora_rank"] == max(ranks) and config["kvrewrite_mla"]["kv_lora_ranks"] == ranks
    tokens = random_windows(2, 40, seed=5)
    stock, info = _stock_logits_in_fresh_process(out, tokens, tmp_path)
    assert info["class"] == "DeepseekV3ForCausalLM"
    maths = _logits(mla_reference_model(deep.ctx.original_model(), allocated.layers), tokens)
    assert (stock - maths).abs().max() < 1e-4

    ours = kvrewrite.load(out).eval()
    stock_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    one = tokens[:1, :24]
    with torch.no_grad():
        reference = stock_model(one).logits
        assert (ours(one).logits - reference).abs().max() < 1e-5
        prefill = ours(one[:, :16], use_cache=True)
        step = ours(one[:, 16:17], past_key_values=prefill.past_key_values, use_cache=True).logits
    assert (step[:, -1] - reference[:, 16]).abs().max() < 1e-5
    d_r = config["qk_rope_head_dim"]
    for idx, layer_cache in enumerate(prefill.past_key_values.layers):
        assert layer_cache.keys.shape[-1] == ranks[idx] + d_r  # the true width, not the padded one
    assert cache_tensor_bytes(prefill.past_key_values) == 17 * sum(r + d_r for r in ranks) * 4


def test_absorbed_decode_equals_expanded_attention_at_allocated_widths(deep, allocated, tmp_path):
    import kvrewrite

    out = tmp_path / "mla"
    export_at_share(deep, allocated.layers, out, dtype=torch.float32)
    model = kvrewrite.load(out).eval()
    tokens = random_windows(1, 20, seed=9)
    results = {}
    for path in ("absorbed", "expanded"):
        for layer in model.model.layers:
            layer.self_attn.path = path
        with torch.no_grad():
            prefill = model(tokens[:, :12], use_cache=True)
            results[path] = model(tokens[:, 12:], past_key_values=prefill.past_key_values, use_cache=True).logits
    assert (results["absorbed"] - results["expanded"]).abs().max() < 1e-5


def test_nonzero_weights_beyond_a_recorded_width_are_refused(deep, allocated, tmp_path):
    from safetensors.torch import load_file, save_file

    import kvrewrite
    from kvrewrite.io.manifest import write_manifest

    out = tmp_path / "mla"
    export_at_share(deep, allocated.layers, out, dtype=torch.float32)
    ranks = allocated.allocation.ranks
    narrow = min(range(len(ranks)), key=lambda i: ranks[i])
    [shard] = sorted(out.glob("*.safetensors"))
    state = load_file(shard)
    state[f"model.layers.{narrow}.self_attn.kv_b_proj.weight"][:, -1] = 1.0
    save_file(state, shard, metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match="corrupt or modified"):  # the manifest sees the edit first
        kvrewrite.load(out)
    write_manifest(out)  # re-signed, as whoever edited it would: the width check still refuses the weights
    with pytest.raises(CorruptCheckpointError, match="not zero"):
        kvrewrite.load(out)


def test_a_malformed_width_list_is_refused(deep, allocated, tmp_path):
    import kvrewrite
    from kvrewrite.io.manifest import write_manifest

    out = tmp_path / "mla"
    export_at_share(deep, allocated.layers, out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    config["kvrewrite_mla"]["kv_lora_ranks"] = [config["kv_lora_rank"] + 1] * config["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError, match="corrupt or modified"):  # the manifest sees the edit first
        kvrewrite.load(out)
    write_manifest(out)  # re-signed, as whoever edited it would: the marker's own check still refuses it
    with pytest.raises(CorruptCheckpointError, match="kv_lora_ranks"):
        kvrewrite.load(out)


def test_the_cli_allocates_per_layer_widths(tmp_path):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app
    from tests.tiny_models import save_tiny_llama

    src = save_tiny_llama(tmp_path / "src", layers=4)
    out = tmp_path / "mla"
    result = CliRunner().invoke(
        app,
        [
            "export-mla",
            str(src),
            "--kv-share",
            "0.5",
            "--layer-widths",
            "sensitivity",
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
    marker = json.loads((out / "config.json").read_text())["kvrewrite_mla"]
    assert sum(marker["kv_lora_ranks"]) <= 4 * 16 and marker["allocation"]["method"] == "sensitivity"
    assert (
        "mean over layers" in result.output and "rate table: kvrewrite.load(DIR, rate=p) serves p = " in result.output
    )
    assert set(marker["rate_table"]) >= {"0.50", "0.60"}

    refused = CliRunner().invoke(
        app,
        ["export-mla", str(src), "--kv-lora-rank", "16", "--layer-widths", "sensitivity", "-o", str(tmp_path / "no")],
    )
    assert refused.exit_code == 2 and "--layer-widths sensitivity" in refused.output and not (tmp_path / "no").exists()


def test_one_allocated_export_serves_narrower_rates_as_exports_made_for_them(deep, tmp_path):
    """Export at 75% of K+V with its rate table; loaded at rate 0.5 it runs the widths an export made for 50% has,
    with the same logits (up to the latent-norm neutralisation's bound), and caches those widths."""
    import kvrewrite
    from kvrewrite.compile.mla.export import allocated_at_share, probe_full_form

    probed = probe_full_form(deep)
    wide, narrow = allocated_at_share(deep, probed, 0.75), allocated_at_share(deep, probed, 0.5)
    assert wide.rate_table["0.50"] == list(narrow.allocation.ranks)
    assert all(
        set(widths) and all(w <= r for w, r in zip(widths, wide.allocation.ranks))
        for widths in wide.rate_table.values()
    )
    export_at_share(deep, wide.layers, tmp_path / "wide", dtype=torch.float32, rate_table=wide.rate_table)
    export_at_share(deep, narrow.layers, tmp_path / "narrow", dtype=torch.float32)
    tokens = random_windows(1, 24, seed=3)
    at_rate, made = kvrewrite.load(tmp_path / "wide", rate=0.5).eval(), kvrewrite.load(tmp_path / "narrow").eval()
    with torch.no_grad():
        got, want = at_rate(tokens, use_cache=True), made(tokens).logits
        full = kvrewrite.load(tmp_path / "wide")(tokens).logits
    assert (got.logits - want).abs().max() < 1e-4 < (full - want).abs().max()
    d_r = deep.ctx.geometry.head_dim
    assert [layer.keys.shape[-1] - d_r for layer in got.past_key_values.layers] == list(narrow.allocation.ranks)
    with pytest.raises(CorruptCheckpointError, match="rates: "):
        kvrewrite.load(tmp_path / "wide", rate=0.05)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--distill-rates", "0.5,0.6"], "add --distill and --layer-widths sensitivity"),
        (["--distill", "--distill-rates", "0.5,0.6"], "add --distill and --layer-widths sensitivity"),
        (["--distill", "--layer-widths", "sensitivity", "--distill-rates", "0.3,0.6"], "--kv-share 0.7"),
        (["--distill", "--layer-widths", "sensitivity", "--distill-rates", "0.5,0.9"], "leaves a mean latent of"),
    ],
)
def test_nested_mla_distillation_settings_that_cannot_work_are_refused_before_any_work(tmp_path, extra, says):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app
    from tests.tiny_models import save_tiny_llama

    src = save_tiny_llama(tmp_path / "src")
    result = CliRunner().invoke(app, ["export-mla", str(src), "--kv-share", "0.5", "-o", str(tmp_path / "out"), *extra])
    assert result.exit_code == 2 and says in " ".join(result.output.split()) and not (tmp_path / "out").exists(), (
        result.output
    )


def test_kvrewrite_eval_scores_an_mla_export_at_the_rates_of_its_table(deep, allocated, tmp_path, monkeypatch):
    """The eval rows of an allocated export equal a direct evaluation of kvrewrite.load(dir, rate=p) against the
    source the export records; codecs and unknown rates are refused."""
    import kvrewrite
    from kvrewrite.io import calibration_data
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.publish.checkpoint_eval import evaluate_checkpoint
    from kvrewrite.publish.evaluation import evaluate_many

    out = tmp_path / "mla"
    export_at_share(deep, allocated.layers, out, dtype=torch.float32, rate_table=allocated.rate_table)
    assert json.loads((out / "config.json").read_text())["kvrewrite_mla"]["source_model"] == deep.ctx.plan.model
    windows = random_windows(4, 32, seed=11)
    # The tiny model's word tokenizer cannot read the held-out articles: evaluate on random ids instead.
    monkeypatch.setattr(calibration_data, "evaluation_token_sequences", lambda *args, **kwargs: windows)
    rows = evaluate_checkpoint(out, rates=[0.5, 0.6], tokens=windows.numel(), seq_len=32, progress=False)
    with pytest.raises(InvalidArgumentError, match="no rate 0.05"):
        evaluate_checkpoint(out, rates=[0.05], progress=False)
    with pytest.raises(InvalidArgumentError, match="per-head forms only"):
        evaluate_checkpoint(out, kv_codecs=["int4"], progress=False)
    reference = evaluate_many(
        {"r": kvrewrite.load(out, rate=0.5).eval()},
        windows,
        baseline=load_fp32_model(deep.ctx.plan.model),
        progress=False,
    )["r"]
    row = next(r for r in rows if r["name"].endswith("p=0.50"))
    assert row["perplexity"] == pytest.approx(reference.perplexity, rel=1e-6)
    assert row["kv_bytes_per_token"] == reference.kv_bytes_per_token
