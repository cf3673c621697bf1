"""The MLA export's Python API: MLAPlan validates every option in one place, and kvrewrite.export_mla(source, plan)
writes a checkpoint whose logits match the original model where the form is exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvrewrite
from kvrewrite.compile.mla.plan import MLAPlan
from kvrewrite.compile.plan import DISTILL_EPOCHS, NESTED_DISTILL_EPOCHS, Plan
from kvrewrite.errors import InvalidArgumentError
from tests.tiny_models import random_windows, save_tiny_llama


@pytest.mark.parametrize(
    "options, message",
    [
        ({"distill_tokens": 512}, "`distill_tokens` only apply with `distill`"),
        ({"distill_rates": (0.5, 0.6)}, "add `distill` and `layer_widths=sensitivity`"),
        ({"distill": True, "layer_widths": "sensitivity", "distill_rates": (0.3, 0.6)}, "export at `kv_share=0.7`"),
        ({"refit_rates": (0.3, 0.5)}, "export at `kv_share=0.7`"),
        ({"kv_share": 0.7, "refit_rates": (0.3, 0.5), "distill": True}, "does not combine"),
        ({"kv_share": 0.7, "refit_rates": (0.3, 0.351)}, "in hundredths"),
        ({"kv_share": 0.7, "refit_rates": (0.3, 0.5), "refit": "none"}, "needs `refit=output`"),
        ({"refit": "none", "refit_tokens": 256}, "`refit_tokens` only applies"),
        ({"refit": "outputs"}, "`refit` must be one of"),
        ({"dtype": "int8"}, "`dtype` must be one of"),
        ({"device": "tpu"}, "`device` must be cpu or cuda"),
        ({"key_weight": -1.0}, "`key_weight=-1.0`: the key side's weight"),
        ({"verify_tokens": 0}, "`verify_tokens=0`: the checks at the end"),
        ({"verify_tokens": 1024, "calib_tokens": 512}, "`verify_tokens=1024` is more than `calib_tokens=512`"),
        ({"kv_share": 0.0}, "`kv_share` must be in (0, 1]"),
        ({"distill": True, "distill_tokens": 4096, "calib_tokens": 1024}, "more than `calib_tokens=1024`"),
        ({"distill": True, "distill_epochs": 0}, "`distill_epochs` must be in (0, 100]"),
        ({"qk_rope_head_dim": 8}, "`qk_rope_head_dim` needs `kv_lora_rank`"),
        ({"position_free_queries": "rotated"}, "`position_free_queries` must be one of"),
        ({"layer_widths": "greedy"}, "`layer_widths` must be uniform or sensitivity"),
        ({"layer_widths": "sensitivity", "kv_lora_rank": 16}, "`kv_lora_rank` gives every layer one exact width"),
        (
            {
                "kv_share": 0.7,
                "layer_widths": "distill",
                "distill": True,
                "distill_rates": (0.3, 0.5),
                "refit": "output",
            },
            "add `distill` and `layer_widths=sensitivity`",
        ),
        (
            {
                "kv_share": 0.7,
                "layer_widths": "sensitivity",
                "distill": True,
                "distill_rates": (0.3, 0.5),
                "refit": "output",
            },
            "compiled ranks only",
        ),
    ],
)
def test_the_plan_refuses_what_does_not_combine(tmp_path, options, message):
    with pytest.raises(InvalidArgumentError) as refused:
        MLAPlan(output=tmp_path / "out", **options)
    assert message in str(refused.value)


def test_defaults_are_resolved_for_the_form_and_replace_validates_again(tmp_path):
    uniform = MLAPlan(output=tmp_path / "out")
    assert uniform.refit is None and uniform.refit_method == "output-local"
    assert uniform.statistics_plan("m").refit == "output-local" and not uniform.statistics_plan("m").distill
    allocated = dataclasses.replace(uniform, layer_widths="sensitivity")
    assert allocated.refit_method == "none"  # it keeps its rate table
    assert dataclasses.replace(uniform, distill=True).refit_method == "none"
    single = dataclasses.replace(uniform, distill=True).statistics_plan("m")
    assert (single.distill_epochs, single.distill_tokens) == (DISTILL_EPOCHS, uniform.calib_tokens)
    nested = MLAPlan(
        output=tmp_path / "out", kv_share=0.7, layer_widths="sensitivity", distill=True, distill_rates=(0.5, 0.3)
    ).statistics_plan("m")
    assert (nested.distill_epochs, nested.distill_rates, nested.target_rate) == (NESTED_DISTILL_EPOCHS, (0.3, 0.5), 0.3)
    rated = MLAPlan(output=tmp_path / "out", kv_share=0.7, refit_rates=(0.5, 0.3), layer_widths="sensitivity")
    assert rated.refit_rates == (0.3, 0.5) and rated.refit_method == "output-local"
    assert rated.statistics_plan("m").refit == "none"  # the refits run per rate, not once
    with pytest.raises(InvalidArgumentError, match="export at `kv_share=0.7`"):
        dataclasses.replace(rated, kv_share=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        uniform.kv_share = 0.3


def test_export_mla_writes_a_checkpoint_exact_where_the_form_is(tmp_path):
    """One KV head at a full K+V share: every RoPE component (the one shared RoPE key is the head's) and the full
    latent are kept, so the form is the original attention and the checkpoint kvrewrite.load reads gives the original
    model's logits."""
    src = save_tiny_llama(tmp_path / "src", num_kv_heads=1)
    plan = MLAPlan(
        output=tmp_path / "mla",
        kv_share=1.0,
        refit="none",
        calibration="synthetic",
        calib_tokens=512,
        verify_tokens=32,
        progress=False,
    )
    result = kvrewrite.export_mla(str(src), plan)
    assert result.output == tmp_path / "mla" and (tmp_path / "mla" / "config.json").is_file()
    assert result.refit is None and result.rate_refit is None and result.distilled is None
    assert result.served_rates is None and result.rate_diffs == {}
    assert result.export_diff < 1e-4 and result.full_width_diff < 1e-4
    assert result.source_values == 2 * 1 * 16  # one KV head of 16 dims, keys and values
    tokens = random_windows(2, 40, seed=3)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        exported = kvrewrite.load(tmp_path / "mla").eval()(tokens).logits
        assert (exported - original(tokens).logits).abs().max() < 1e-4
    with pytest.raises(InvalidArgumentError, match="exists"):  # the plan's overwrite=False is honoured
        kvrewrite.export_mla(str(src), plan)


def test_the_checks_at_the_end_run_on_the_tokens_compress_checks_on(monkeypatch):
    """--verify-tokens N means one thing in both commands: the first calibration windows, each cut to 256 tokens, about
    N tokens in all (at least one window)."""
    from types import SimpleNamespace

    from kvrewrite.compile.mla.passes import verify_export

    seen = []
    monkeypatch.setattr(verify_export, "full_width_max_logit_diff", lambda prepared, tokens: seen.append(tokens) or 0.0)
    monkeypatch.setattr(verify_export, "export_matches_maths", lambda prepared, layers, out, tokens: 0.0)
    windows = torch.arange(3 * 512).reshape(3, 512)
    for count, rows in ((600, 2), (100, 1), (5000, 3)):
        ctx = SimpleNamespace(
            prepared=SimpleNamespace(
                ctx=SimpleNamespace(
                    calibration_tokens=windows, original_model=lambda: torch.nn.Linear(1, 1), plan=Plan(model="m")
                )
            ),
            plan=SimpleNamespace(output="x", verify_tokens=count),
            layers=None,
            rate_refit=None,
            distilled=None,
        )
        verify_export.VerifyExport().run(ctx)
        assert torch.equal(seen[-1], windows[:rows, :256]), count
    plan = MLAPlan(output="x")
    assert (plan.calib_tokens, plan.verify_tokens, plan.dtype) == (32768, 512, "auto")
    assert plan.statistics_plan("m").dtype == "float32"  # the statistics: float32 whatever the weights' dtype


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_decode_device.sh runs it)"
)
@pytest.mark.parametrize(
    "options",
    [
        {"kv_share": 0.5, "refit": "output"},  # expected rotations, the o_proj refit and its latent norms, the checks
        {"kv_share": 0.5, "layer_widths": "sensitivity"},  # the sensitivity probes
        {"kv_share": 0.7, "refit_rates": (0.3, 0.5)},  # a refit per rate, and each rate's check
        {"kv_share": 0.5, "distill": True, "distill_epochs": 1},  # the distillation
    ],
)
def test_an_export_on_cuda_is_the_cpu_export(tmp_path, monkeypatch, options):
    """--device cuda runs the export's model steps on the GPU: the checkpoint computes what the CPU export's does
    (float32 round-off apart: the statistics' products run on the GPU), its checks hold as tightly, the latent
    widths add up to the same total, and the shared original is back in host memory at the end."""
    import random

    import kvrewrite.io.source_model as source_model

    loaded = []
    load_fp32_model = source_model.load_fp32_model
    monkeypatch.setattr(
        source_model, "load_fp32_model", lambda *a, **k: loaded.append(load_fp32_model(*a, **k)) or loaded[-1]
    )
    src = save_tiny_llama(tmp_path / "src", seed=3)
    rng = random.Random(0)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{rng.randrange(3, 96)}" for _ in range(6000)))
    common = {"calibration": str(text), "calib_tokens": 1024, "verify_tokens": 64, "progress": False, **options}
    on_cpu = kvrewrite.export_mla(str(src), MLAPlan(output=tmp_path / "cpu", **common))
    on_gpu = kvrewrite.export_mla(str(src), MLAPlan(output=tmp_path / "gpu", device="cuda", **common))
    assert len(loaded) == 2 and all(p.device.type == "cpu" for p in loaded[1].parameters())
    assert all(layer.o_proj.device.type == "cpu" for layer in on_gpu.layers)
    assert on_gpu.export_diff < 1e-4 and on_gpu.full_width_diff < 1e-4
    assert on_gpu.rate_diffs.keys() == on_cpu.rate_diffs.keys() and all(d < 1e-4 for d in on_gpu.rate_diffs.values())
    widths = [layer.kv_lora_rank for layer in on_gpu.layers]
    assert sum(widths) == sum(layer.kv_lora_rank for layer in on_cpu.layers)
    if widths != [layer.kv_lora_rank for layer in on_cpu.layers]:
        return  # a near-tie of probe KLs placed a chunk of width elsewhere: the same share, another form
    tokens = random_windows(2, 40, seed=5)
    with torch.no_grad():
        expected = kvrewrite.load(tmp_path / "cpu").eval()(tokens).logits
        found = kvrewrite.load(tmp_path / "gpu").eval()(tokens).logits
    tolerance = 1e-2 if options.get("distill") else 1e-3  # training amplifies the round-off
    assert (found - expected).abs().max() <= tolerance * expected.abs().max()
