"""The adapter test matrix: every supported family x (full-rank equivalence, cached decoding, cache shrink, Auto loading).

Each family is a tiny random model built from its transformers config class (tests/tiny_families.py),
with random biases and norm weights so that folding them wrongly shows up in the logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_families import TINY_CONFIGS, save_tiny_family
from tiny_models import one_shot_and_cached_logits, random_windows, tiny_pipeline
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import kvrewrite  # noqa: F401  (registers the kvrewrite_<family> model types)
from kvrewrite.adapters import adapter_for, supported_model_types
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import UnsupportedModelError
from kvrewrite.key_modes import allowed_key_modes
from kvrewrite.runtime.kernels.cache_layout import packed_view

FAMILIES = list(TINY_CONFIGS)
COMPRESSED_TYPE = {
    "llama": "kvrewrite_llama",
    "mistral": "kvrewrite_llama",
    "qwen2": "kvrewrite_qwen2",
    "qwen2-sliding": "kvrewrite_qwen2",
    "qwen3": "kvrewrite_qwen3",
    "phi3": "kvrewrite_phi3",
    "gemma3": "kvrewrite_gemma3",
    "opt": "kvrewrite_opt",
    "gpt2": "kvrewrite_gpt2",
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: save_tiny_family(root / family, family, seed=i) for i, family in enumerate(FAMILIES)}


def compile_family(src, out, **options):
    plan = Plan(model=str(src), output=out, progress=False, **{"target_rate": 0.5, "allocation": "greedy", **options})
    return run_pipeline(plan, tiny_pipeline())


def stock(src):
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def allowed_modes(family):
    config = TINY_CONFIGS[family]()
    return allowed_key_modes(adapter_for(config), config)


# Every allowed key mode where the layout changes how the key side folds (biases, fused qkv, sliding layers);
# the Llama modes are covered in test_compile_tiny.py, so the other families run their auto mode (for
# Qwen3/Gemma3/OPT/GPT-2 the only mode there is).
FAMILY_MODES = [
    (family, mode)
    for family in FAMILIES
    for mode in (allowed_modes(family) if family in ("qwen2", "qwen2-sliding", "phi3") else ("auto",))
]


@pytest.mark.parametrize("family,mode", FAMILY_MODES)
def test_full_rank_rewrite_keeps_logits(sources, tmp_path, family, mode):
    src = sources[family]
    ctx = compile_family(src, tmp_path / "out", target_rate=0.0, rope_mode=mode)
    assert ctx.spec.achieved_rate == 0.0
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-6  # float64 check inside the compile
    # Loads through the Auto classes after `import kvrewrite`, as the family's own compressed type.
    rewritten = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert rewritten.config.model_type == COMPRESSED_TYPE[family]
    tokens = random_windows(2, 40, seed=11)  # not the calibration tokens; longer than qwen2-sliding's window
    with torch.no_grad():
        diff = (rewritten(tokens).logits - stock(src)(tokens).logits).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_matches_one_shot_and_cache_shrinks(sources, tmp_path, family):
    src = sources[family]
    ctx = compile_family(src, tmp_path / "out")
    assert abs(ctx.spec.achieved_rate - 0.5) <= 0.05
    assert_checkpoint_declares_family(tmp_path / "out", family)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    original = stock(src)
    tokens = random_windows(2, 36, seed=3)
    one_shot, cached, cache = one_shot_and_cached_logits(model, tokens)
    with torch.no_grad():
        stock_cache = DynamicCache(config=original.config)
        original(tokens, past_key_values=stock_cache, use_cache=True)
    assert (cached - one_shot).abs().max().item() < 1e-4

    # The cache really holds the reduced latents, layer by layer, against the stock model's own cache
    # (a sliding-window layer keeps as many positions as the stock one does).
    baseline_per_layer = 2 * ctx.spec.num_key_value_heads * ctx.spec.head_dim
    total, stock_total = 0, 0
    for layer, stock_layer, layer_spec in zip(cache.layers, stock_cache.layers, ctx.spec.layers):
        positions = stock_layer.keys.shape[-2]
        assert packed_view(layer.keys).shape == (2, 1, positions, sum(layer_spec.key_ranks))
        assert packed_view(layer.values).shape == (2, 1, positions, sum(layer_spec.value_ranks))
        assert stock_layer.keys.numel() + stock_layer.values.numel() == 2 * positions * baseline_per_layer
        total += layer.keys.numel() + layer.values.numel()
        stock_total += stock_layer.keys.numel() + stock_layer.values.numel()
    if family not in ("qwen2-sliding", "gemma3"):  # all layers full attention: the ratio is exactly the achieved rate
        assert total / stock_total == pytest.approx(1 - ctx.spec.achieved_rate)


def assert_checkpoint_declares_family(out, family):
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == COMPRESSED_TYPE[family]
    model_class = config["architectures"][0]
    assert config["auto_map"]["AutoModelForCausalLM"] == f"modeling_kvrewrite.{model_class}"
    assert model_class in (out / "modeling_kvrewrite.py").read_text()
    # A stricter load than from_pretrained's default: nothing missing, nothing unexpected.
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize(
    "family,mode",
    [
        ("qwen3", "latent"),
        ("gemma3", "freq"),
        ("opt", "post-rope"),
        ("gpt2", "latent"),
        ("llama", "folded"),
        ("qwen2-sliding", "latent"),
    ],
)
def test_impossible_key_mode_fails_before_statistics(sources, tmp_path, family, mode):
    plan = Plan(model=str(sources[family]), output=tmp_path / "out", progress=False, rope_mode=mode)
    started = []
    with pytest.raises(UnsupportedModelError, match=f"`rope_mode={mode}` is not possible for model type"):
        run_pipeline(plan, tiny_pipeline(), on_pass=lambda step: started.append(step.name))
    assert started == ["load_checkpoint"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["gpt_neox", "falcon"])
def test_unsupported_architecture_names_type_and_supported_ones(tmp_path, model_type):
    config = AutoConfig.for_model(model_type, vocab_size=64, num_hidden_layers=1)
    with pytest.raises(UnsupportedModelError) as err:
        adapter_for(config)
    message = str(err.value)
    assert repr(model_type) in message
    for supported in supported_model_types():
        assert supported in message
    assert supported_model_types() == ["gemma3_text", "gpt2", "llama", "mistral", "opt", "phi3", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_output_refit_lowers_kl_on_every_family(sources, tmp_path, family):
    """--refit output goes through every family's adapter (o_proj / out_proj / c_proj, biases, fused qkv) and, on
    the windows it was fitted on, does not raise the next-token KL against the stock model."""
    windows = random_windows(12, 48, seed=5)
    original = stock(sources[family])
    kls = {}
    for refit in ("none", "output"):
        out = tmp_path / refit
        plan = Plan(
            model=str(sources[family]),
            output=out,
            progress=False,
            target_rate=0.5,
            allocation="greedy",
            refit=refit,
            refit_tokens=int(windows.numel()),
        )
        run_pipeline(plan, tiny_pipeline(windows))
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            ref, new = original(windows[:6]).logits.log_softmax(-1), model(windows[:6]).logits.log_softmax(-1)
        kls[refit] = (ref.exp() * (ref - new)).sum(-1).mean().item()
    if kls["none"] < 1e-6:  # the no-RoPE tiny models lose almost nothing at p = 0.5; the refit must keep that
        assert kls["output"] < 1e-6, kls
    else:
        assert kls["output"] < kls["none"], kls


def check_distillation(src, out, **options) -> None:
    """Compile src with --distill at p = 0.75: the emitted checkpoint, loaded by stock transformers at its compiled
    ranks, reproduces the validation KL the training measured with its full-rank probe model, and that KL is no
    higher than before (lower wherever there is loss to recover)."""
    windows = random_windows(48, 48, seed=5)
    plan = Plan(
        model=str(src),
        output=out,
        progress=False,
        target_rate=0.75,
        allocation="greedy",
        distill=True,
        distill_tokens=int(windows.numel()),
        distill_epochs=3,
        distill_lr=3e-5,
        **options,
    )
    report = run_pipeline(plan, tiny_pipeline(windows)).report["distill"]
    validation = windows[-3:]  # the last 1/16 of the 48 windows are held back
    original = stock(src)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref, new = (
            original(validation).logits.double().log_softmax(-1),
            model(validation).logits.double().log_softmax(-1),
        )
    kl = (ref.exp() * (ref - new)).sum(-1).mean().item()
    assert kl == pytest.approx(report["validation_kl_after"], rel=1e-3, abs=1e-7)
    assert report["validation_kl_after"] <= report["validation_kl_before"]
    if report["validation_kl_before"] > 1e-4:  # the tiny no-RoPE / full-width models lose almost nothing here
        assert report["kept_epoch"] >= 1 and report["validation_kl_after"] < report["validation_kl_before"], report


@pytest.mark.parametrize("family", FAMILIES)
def test_distillation_trains_through_every_family(sources, tmp_path, family):
    """--distill through every family's attention at its default key mode (latent, post-rope or folded; fused qkv,
    biases, q/k norms, sliding windows)."""
    check_distillation(sources[family], tmp_path / "d")


@pytest.mark.parametrize(("family", "rope_mode"), [("llama", "freq"), ("mistral", "crosshead")])
def test_distillation_trains_the_other_key_modes(sources, tmp_path, family, rope_mode):
    """The key modes no family defaults to: frequency-pair selection and the cross-head mode."""
    check_distillation(sources[family], tmp_path / "d", rope_mode=rope_mode)
