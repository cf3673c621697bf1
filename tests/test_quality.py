"""Quality levers: KL-curve allocation, Fisher-weighted values, the quality budget, and `kvrewrite sweep`."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoModelForCausalLM

import kvrewrite
from kvrewrite.compile.passes.collect_fisher import output_fisher, shrunk_sqrt
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.compile.sweep import pareto_front, parse_config, run_sweep
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.io.calibration_data import calibration_token_sequences
from kvrewrite.method.curve_allocation import curve_removal_order, curve_value, monotone_curve
from kvrewrite.method.linalg import whitened_projection
from kvrewrite.method.rank_allocation import RankItem, allocate_greedy
from kvrewrite.publish.evaluation import perplexity_and_agreement


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    src = save_tiny_llama(root / "src", seed=3, num_kv_heads=2, num_heads=4)
    rng = random.Random(0)
    text = root / "calib.txt"
    text.write_text(" ".join(f"w{rng.randrange(3, 96)}" for _ in range(6000)))
    return src, text


def _items(seed: int, layers: int = 2, heads: int = 2, d: int = 4) -> list[RankItem]:
    rng = np.random.default_rng(seed)
    items = []
    for layer in range(layers):
        for g in range(heads):
            for side in ("key", "value"):
                items.append(RankItem(layer, g, side, np.sort(rng.random(d) * rng.choice([0.1, 1, 10]))[::-1]))
    return items


def test_one_probe_curve_is_the_weighted_greedy():
    items = _items(0, layers=3, heads=2, d=8)
    weights = {
        (l, s): w for (l, s), w in zip(itertools.product(range(3), ("key", "value")), [0.5, 3.0, 1.0, 7.0, 0.2, 2.0])
    }
    # One probe point (e, KL) gives the line KL = (KL/e) * error through the origin.
    curves = {key: [(0.3, 0.3 * w)] for key, w in weights.items()}
    order = curve_removal_order(items, curves)
    weighted = [RankItem(it.layer, it.head, it.side, it.spectrum, weight=weights[(it.layer, it.side)]) for it in items]
    for rate in (0.1, 0.3, 0.5, 0.7):
        assert allocate_greedy(items, rate, order=order).ranks == allocate_greedy(weighted, rate).ranks


def test_curve_greedy_matches_brute_force_on_convex_curves():
    items = _items(1, layers=2, heads=2, d=4)
    curves = {
        (0, "key"): [(0.1, 0.01), (0.4, 0.2)],
        (0, "value"): [(0.1, 0.05), (0.3, 0.6)],
        (1, "key"): [(0.2, 0.02), (0.5, 0.1)],
        (1, "value"): [(0.05, 0.02), (0.2, 0.3)],
    }
    order = curve_removal_order(items, curves)

    def cost(ranks):
        total = 0.0
        for key in curves:
            members = [it for it in items if (it.layer, it.side) == key]
            errs = [
                float((it.spectrum[ranks[(it.layer, it.head, it.side)] :] ** 2).sum() / (it.spectrum**2).sum())
                for it in members
            ]
            total += curve_value(*monotone_curve(curves[key]), float(np.mean(errs)))
        return total

    keys = [(it.layer, it.head, it.side) for it in items]
    for kept in (4, 8, 12):
        best = min(cost(dict(zip(keys, r))) for r in itertools.product(range(5), repeat=len(items)) if sum(r) == kept)
        greedy = allocate_greedy(items, 1 - kept / 32, order=order)
        assert greedy.kept == kept
        assert cost(greedy.ranks) <= best + 1e-9


def test_fisher_weighted_values_minimise_the_weighted_error():
    torch.manual_seed(0)
    d, hidden = 6, 10
    x = torch.randn(200, d, dtype=torch.float64) @ torch.randn(d, d, dtype=torch.float64)
    w_o = torch.randn(d, hidden, dtype=torch.float64)
    g = torch.randn(300, hidden, dtype=torch.float64) * torch.linspace(0.1, 3, hidden, dtype=torch.float64)
    metric = shrunk_sqrt(g.T @ g, 0.0)
    assert torch.allclose(metric @ metric, (g.T @ g) * hidden / (g.T @ g).trace(), atol=1e-8)

    def weighted_error(pair, r):
        approx = x @ pair.down[:, :r] @ pair.up[:r] @ w_o
        return float(((x @ w_o - approx) @ metric).square().sum())

    fisher = whitened_projection(x.T @ x, w_o @ metric)
    plain = whitened_projection(x.T @ x, w_o)
    for r in range(1, d):
        # Eckart-Young in the weighted metric: the dense optimum is the sum of the trailing squared singular values.
        optimum = float((torch.linalg.svdvals((x @ w_o @ metric)) ** 2)[r:].sum())
        assert weighted_error(fisher, r) == pytest.approx(optimum, rel=1e-6)
        assert weighted_error(fisher, r) <= weighted_error(plain, r) + 1e-9


def test_output_fisher_equals_autograd_of_each_attention_output(tiny):
    src, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokens = random_windows(2, 24, seed=4)
    sums = output_fisher(model, [layer.self_attn.o_proj for layer in model.model.layers], tokens)
    # Reference: keep every o_proj output, take the loss gradient with respect to each in one autograd call.
    outputs = []
    handles = [
        layer.self_attn.o_proj.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        for layer in model.model.layers
    ]
    embeds = model.get_input_embeddings()(tokens).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum"
    )
    grads = torch.autograd.grad(loss, outputs)
    for handle in handles:
        handle.remove()
    for s, grad in zip(sums, grads):
        g = grad.reshape(-1, grad.shape[-1]).double()
        assert torch.allclose(s, g.T @ g, rtol=1e-5, atol=1e-10)


def test_fisher_compile_keeps_full_rank_equivalence(tiny, tmp_path):
    src, _ = tiny
    ctx = run_pipeline(
        Plan(
            model=str(src),
            output=tmp_path / "f",
            progress=False,
            value_metric="fisher",
            fisher_tokens=96,
            target_rate=0.5,
        ),
        tiny_pipeline(),
    )
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-4
    assert ctx.report["fisher"]["tokens"] == 96


def test_quality_budget_finds_the_largest_rate_within_budget(tiny, tmp_path):
    src, text = tiny
    fine_grid = tuple(round(0.01 * i, 2) for i in range(96))
    plan = Plan(
        model=str(src),
        output=tmp_path / "b",
        progress=False,
        calibration=str(text),
        calib_tokens=1024,
        seq_len=64,
        budget_tokens=256,
        max_kl=0.002,
        allocation="greedy",
        rate_grid=fine_grid,
    )
    ctx = run_pipeline(plan)
    budget = ctx.report["quality_budget"]
    chosen = budget["chosen_rate"]
    assert 0.0 < chosen < 0.95 and ctx.spec.target_rate == chosen
    # Independent check on the same held-back windows (the 17 windows drawn, minus the 16 calibration ones).
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    windows = calibration_token_sequences(str(text), ctx.tokenizer, 1024 + 256, 64, seed=0)[16:]
    assert torch.equal(windows, ctx.budget_tokens)
    at = perplexity_and_agreement(kvrewrite.load(tmp_path / "b", rate=chosen), windows, original, progress=False)
    above = perplexity_and_agreement(
        kvrewrite.load(tmp_path / "b", rate=round(chosen + 0.01, 2)), windows, original, progress=False
    )
    assert at.kl_mean == pytest.approx(budget["chosen"]["kl_mean"], rel=1e-3, abs=1e-6)
    assert at.kl_mean <= 0.002 < above.kl_mean
    # The statistics never saw the held-back windows.
    assert ctx.report["calibration"]["held_back_for_quality_budget"] == 256


def test_quality_budget_default_output_is_checked_before_any_work(tiny, tmp_path, monkeypatch):
    """With a quality budget and no output, the rate (and so a pNN name) is only known late in the run: the default
    directory names the budget instead, and an existing one is refused before the first pass, not at emit."""
    src, text = tiny
    monkeypatch.chdir(tmp_path)
    plan = Plan(
        model=str(src),
        progress=False,
        calibration=str(text),
        calib_tokens=256,
        seq_len=32,
        budget_tokens=64,
        max_kl=0.002,
    )
    ctx = run_pipeline(plan)
    assert ctx.output_dir == Path(f"{src.name}-kvrewrite-kl0.002")
    assert (tmp_path / ctx.output_dir / "config.json").is_file()
    ran = []
    with pytest.raises(InvalidArgumentError, match="already exists"):
        run_pipeline(plan, on_pass=ran.append)
    assert ran == []  # refused up front: not one pass ran


def test_budget_options_are_validated():
    with pytest.raises(InvalidArgumentError):
        Plan(model="x", max_ppl_increase=-0.05)
    with pytest.raises(InvalidArgumentError):
        Plan(model="x", max_kl=0.1, budget_tokens=10)


def test_pareto_front():
    points = [(10, 5.0), (8, 6.0), (8, 7.0), (12, 4.0), (12, 5.0), (6, 9.0)]
    assert pareto_front(points) == [0, 1, 3, 5]


def test_parse_config():
    assert parse_config("zack-faithful").overrides == {
        "objective": "zack",
        "allocation": "eps",
        "rope_mode": "post-rope",
    }
    cfg = parse_config("mine:base=latent-uniform,min_rank=4,probe_rates=0.25/0.5,fisher_shrink=25%")
    assert cfg.name == "mine"
    assert cfg.overrides == {
        "objective": "optimal",
        "allocation": "uniform",
        "rope_mode": "latent",
        "min_rank": 4,
        "probe_rates": (0.25, 0.5),
        "fisher_shrink": 0.25,
    }
    for bad in ("nope", "x:target_rate=0.3", "x:max_kl=0.1", "x:unknown=1", "x:min_rank=abc", "x:min_rank"):
        with pytest.raises(InvalidArgumentError):
            parse_config(bad)


def test_sweep_writes_table_and_plot_and_slices_equal_direct_compiles(tiny, tmp_path):
    src, text = tiny
    configs = [
        parse_config("zack-faithful"),
        parse_config("latent-sensitivity"),
        parse_config("mine:base=latent-uniform,min_rank=2"),
    ]
    windows = random_windows(4, 48, seed=9)
    summary = run_sweep(
        str(src),
        [0.3, 0.5],
        configs,
        tmp_path / "sweep",
        base_overrides={"calibration": str(text), "calib_tokens": 1024, "seq_len": 64},
        eval_windows=windows,
    )
    rows = summary["rows"]
    assert [r["config"] for r in rows] == ["original"] + [c.name for c in configs for _ in (0, 1)]
    for name in ("sweep_results.json", "sweep_results.csv", "sweep_results.md", "sweep_pareto.png"):
        assert (tmp_path / "sweep" / name).stat().st_size > 0
    assert json.loads((tmp_path / "sweep" / "sweep_results.json").read_text())["rows"] == json.loads(json.dumps(rows))
    for r in rows[1:]:
        assert r["kv_share"] == pytest.approx(1 - r["rate"], abs=0.02)
    # A rate sliced from the sweep's checkpoint (compiled at 0.5) is the model a direct compile at 0.3 gives.
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    direct = run_pipeline(
        Plan(
            model=str(src),
            output=tmp_path / "direct",
            progress=False,
            calibration=str(text),
            calib_tokens=1024,
            seq_len=64,
            target_rate=0.3,
            **configs[1].overrides,
        )
    )
    sliced = kvrewrite.load(tmp_path / "sweep" / "checkpoints" / "latent-sensitivity", rate=0.3)
    assert sliced.compression_spec.layers == kvrewrite.load(direct.output_dir).compression_spec.layers
    with torch.no_grad():
        assert torch.allclose(sliced(windows).logits, kvrewrite.load(direct.output_dir)(windows).logits, atol=1e-5)
    row = next(r for r in rows if r["config"] == "latent-sensitivity" and r["rate"] == 0.3)
    assert row["perplexity"] == pytest.approx(
        perplexity_and_agreement(sliced, windows, original, progress=False).perplexity, rel=1e-6
    )


def test_sweep_compiles_codec_configs_at_every_rate(tiny, tmp_path):
    src, text = tiny
    summary = run_sweep(
        str(src),
        [0.3, 0.5],
        [parse_config("q:base=latent-uniform,kv_codec=int4")],
        tmp_path / "sweep",
        base_overrides={"calibration": str(text), "calib_tokens": 512, "seq_len": 64},
        eval_windows=random_windows(2, 48, seed=9),
    )
    assert sorted(p.name for p in (tmp_path / "sweep" / "checkpoints").iterdir()) == ["q@0.30", "q@0.50"]
    uncoded = {r["rate"]: r["kv_bytes_per_token"] for r in summary["rows"] if r["config"] == "q"}
    assert uncoded[0.3] > uncoded[0.5]


def test_compress_variants_equals_compress_of_each_plan(tiny, tmp_path):
    """kvrewrite.compress_variants shares the statistics between variants; every variant's checkpoint is the one
    kvrewrite.compress writes for that variant's plan alone, tensor for tensor."""
    from safetensors.torch import load_file

    src, text = tiny
    plan = Plan(model=str(src), target_rate=0.5, calibration=str(text), calib_tokens=1024, seq_len=64, progress=False)
    variants = {"greedy": {"allocation": "greedy"}, "post": {"rope_mode": "post-rope", "target_rate": 0.3}}
    seen = []
    compiled = kvrewrite.compress_variants(plan, variants, tmp_path / "shared", on_pass=lambda v, s: seen.append(v))
    assert seen.count("shared") == 3 and {"greedy", "post"} <= set(seen)  # statistics passes once, then each variant
    assert compiled.statistics_report["calibration"]["tokens"] == compiled.calibration_tokens.numel() == 1024
    for name, overrides in variants.items():
        alone = kvrewrite.compress(Plan(**{**plan.__dict__, "output": tmp_path / "alone" / name, **overrides}))
        shared = compiled.results[name]
        assert shared.output_dir == tmp_path / "shared" / name and shared.spec == alone.spec
        ours, reference = (
            load_file(shared.output_dir / "model.safetensors"),
            load_file(alone.output_dir / "model.safetensors"),
        )
        assert ours.keys() == reference.keys()
        assert all(torch.equal(ours[k], reference[k]) for k in reference), name
    assert compiled.original_model() is compiled.original_model()  # loaded once
    with pytest.raises(InvalidArgumentError, match="no_such_field are not Plan fields"):
        kvrewrite.compress_variants(plan, {"bad": {"no_such_field": 1}}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_each_variant_compiles_its_own_key_mode(tiny, tmp_path):
    """Statistics are shared between variants, the key mode is not: each variant's --rope-mode decides it."""
    from kvrewrite.compile.passes.pipeline import compile_variants

    src, text = tiny
    plan = Plan(
        model=str(src),
        target_rate=0.5,
        allocation="greedy",
        calibration=str(text),
        calib_tokens=1024,
        seq_len=64,
        progress=False,
    )
    variants = {
        "freq": {"rope_mode": "freq"},
        "post": {"rope_mode": "post-rope"},
        "latent": {"rope_mode": "latent"},
        "zack": {"objective": "zack", "rope_mode": "default"},
    }
    expected = {"freq": "freq", "post": "post-rope", "latent": "latent", "zack": "post-rope"}
    compile_variants(plan, variants, tmp_path / "out")
    for name, mode in expected.items():
        config = json.loads((tmp_path / "out" / name / "config.json").read_text())
        modes = {layer["key_mode"] for layer in config["kvrewrite"]["layers"]}
        assert modes == {mode}, (name, modes)
