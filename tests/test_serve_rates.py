"""One shape for both compilers: `--serve-rates` names the rates a file serves, exactly, in compress and export-mla
alike; `--refit` and `--distill-epochs` mean one thing with one default in both."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvrewrite.cli.app import app
from kvrewrite.compile.mla.plan import MLAPlan
from kvrewrite.compile.plan import DISTILL_EPOCHS, NESTED_DISTILL_EPOCHS, Plan
from kvrewrite.errors import InvalidArgumentError
from tests.test_mla_refit import _cli as export_mla_cli
from tests.tiny_models import save_tiny_llama


def _compress(tmp_path, *extra):
    src = save_tiny_llama(tmp_path / "src")
    text = tmp_path / "calib.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(3, 96, (3000,), generator=g)))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["compress", str(src), "-o", str(out), "--calibration", str(text), "--calib-tokens", "512", "--seq-len", "64"]
        + list(extra),
    )
    return result, out


def test_compress_serves_exactly_the_rates_named(tmp_path):
    result, out = _compress(tmp_path, "-p", "0.5", "--serve-rates", "0.7,0.3,0.5")
    assert result.exit_code == 0, result.output
    spec = json.loads((out / "config.json").read_text())["kvrewrite"]
    assert sorted(spec["rate_table"]) == ["0.30", "0.50", "0.70"]


def test_compress_serves_the_rates_of_a_nested_distillation_by_distill(tmp_path):
    result, out = _compress(
        tmp_path,
        "-p",
        "0.3",
        "--serve-rates",
        "0.3,0.5",
        "--distill",
        "--distill-epochs",
        "1",
        "--distill-tokens",
        "256",
    )
    assert result.exit_code == 0, result.output
    spec = json.loads((out / "config.json").read_text())["kvrewrite"]
    assert sorted(spec["rate_table"]) == ["0.30", "0.50"]
    report = json.loads((out / "compress_report.json").read_text())["distill"]
    assert report["nested_rates"] == ["0.30", "0.50"]  # exactly these, not every grid rate between them


def test_export_mla_serves_exactly_the_rates_named_from_its_rate_table(tmp_path):
    """--layer-widths sensitivity: served by its table (the default there); --kv-share is 1 - the smallest rate."""
    result, out = export_mla_cli(tmp_path, "--layer-widths", "sensitivity", "--serve-rates", "0.3,0.5")
    assert result.exit_code == 0, result.output
    marker = json.loads((out / "config.json").read_text())["kvrewrite_mla"]
    assert sorted(marker["rate_table"]) == ["0.30", "0.50"] and "rate_o_proj" not in marker
    assert "refit" not in marker  # auto: none, the table is kept


def test_a_uniform_export_serves_the_rates_named_by_refit(tmp_path):
    result, out = export_mla_cli(tmp_path, "--serve-rates", "0.3,0.5")
    assert result.exit_code == 0, result.output
    marker = json.loads((out / "config.json").read_text())["kvrewrite_mla"]
    assert sorted(marker["rate_table"]) == ["0.30", "0.50"] and marker["rate_o_proj"] == ["0.50"]
    assert marker["refit"]["method"] == "output-local"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"serve_rates": (0.3, 0.7)}, "`target_rate=0.5` is not one of `serve_rates`"),
        ({"serve_rates": (0.3, 0.5), "serve_rates_by": "refit"}, "compress's `refit`"),
        ({"serve_rates": (0.3, 0.5), "serve_rates_by": "table", "distill": True}, "serve its compiled rate only"),
        ({"serve_rates": (0.3, 0.5), "refit": "output"}, "serve its compiled rate only"),
        ({"serve_rates": (0.3, 0.5), "rate_grid": (0.3, 0.4, 0.5)}, "give one"),
        ({"serve_rates": (0.5,), "distill": True}, "at least two rates"),
        ({"serve_rates_by": "table"}, "add `serve_rates`"),
        ({"serve_rates": (0.5,), "max_kl": 0.1}, "quality budget"),
    ],
)
def test_compress_refuses_serve_rates_it_cannot_serve(options, message):
    with pytest.raises(InvalidArgumentError) as refused:
        Plan(model="m", **options)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"serve_rates": (0.3, 0.5)}, "export at `kv_share=0.7`"),
        ({"kv_share": 0.7, "serve_rates": (0.3, 0.5), "serve_rates_by": "table"}, "a uniform export has none"),
        ({"kv_share": 0.7, "serve_rates": (0.3, 0.5), "refit_rates": (0.3, 0.5)}, "both name the rates"),
        ({"kv_share": 0.7, "serve_rates": (0.3,)}, "at least two rates"),
        ({"kv_share": 0.7, "serve_rates": (0.3, 0.5), "serve_rates_by": "prefix"}, "must be one of"),
        ({"kv_share": 0.7, "serve_rates": (0.3, 0.5), "refit": "none"}, "`serve_rates` refits o_proj at each rate"),
        (
            {"kv_share": 0.7, "layer_widths": "sensitivity", "serve_rates": (0.3, 0.5), "refit": "output"},
            "would not serve the narrower rates",
        ),
    ],
)
def test_export_mla_refuses_serve_rates_it_cannot_serve(tmp_path, options, message):
    with pytest.raises(InvalidArgumentError) as refused:
        MLAPlan(output=tmp_path / "out", **options)
    assert message in str(refused.value)


def test_serve_rates_map_onto_each_way_of_serving(tmp_path):
    nested = MLAPlan(
        output=tmp_path / "out", kv_share=0.7, layer_widths="sensitivity", distill=True, serve_rates=(0.5, 0.3)
    )
    assert nested.serve_by == "distill" and nested.nested_rates == (0.3, 0.5)
    statistics = nested.statistics_plan("m")
    assert statistics.nested_distill_rates() == (0.3, 0.5) and statistics.epochs == NESTED_DISTILL_EPOCHS
    table = MLAPlan(output=tmp_path / "out", kv_share=0.7, layer_widths="sensitivity", serve_rates=(0.3, 0.7))
    assert table.serve_by == "table" and table.table_rates == (0.3, 0.7) and table.refit_method == "none"
    compress = Plan(model="m", target_rate=0.5, serve_rates=(0.7, 0.5, 0.3), distill=True)
    assert compress.serve_rates_by == "distill" and compress.nested_distill_rates() == (0.3, 0.5, 0.7)


def test_refit_and_distill_epochs_have_one_default_in_both_compilers(tmp_path):
    """refit=auto: none where the file keeps a rate table (every per-head checkpoint, an allocated export) or is
    distilled, output-local where it serves its widths alone; distill epochs 8, or 2 nested, in both."""
    assert Plan(model="m").refit == "none" and Plan(model="m", refit="auto", distill=True).refit == "none"
    assert MLAPlan(output=tmp_path / "o", refit="auto").refit_method == "output-local"
    assert MLAPlan(output=tmp_path / "o", layer_widths="sensitivity").refit_method == "none"
    assert Plan(model="m", distill=True).epochs == DISTILL_EPOCHS == 8.0
    assert Plan(model="m", distill=True, distill_rates=(0.3, 0.5), target_rate=0.3).epochs == NESTED_DISTILL_EPOCHS
    assert MLAPlan(output=tmp_path / "o", distill=True).statistics_plan("m").epochs == DISTILL_EPOCHS
    assert Plan(model="m", distill=True, distill_epochs=3).epochs == 3
