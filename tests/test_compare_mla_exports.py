"""tools/compare_mla_exports.py reads records written by older trees: a measured record whose settings name the
latent widths across layers `allocation` (MLAPlan's field before it was `layer_widths`) compares as the same setting."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from compare_mla_exports import measured_difference  # noqa: E402

FIGURES = {"full_width_diff": 0.0, "export_diff": 0.25, "rate_diffs": {"0.30": 0.5}, "latent_norm_errors": [0.1]}


def _write(path: Path, settings: dict) -> Path:
    path.write_text(json.dumps({"settings": settings, **FIGURES}))
    return path


def test_an_old_records_allocation_setting_is_the_same_as_layer_widths(tmp_path):
    before = _write(tmp_path / "before.json", {"kv_share": 0.7, "allocation": "sensitivity"})
    after = _write(tmp_path / "after.json", {"kv_share": 0.7, "layer_widths": "sensitivity"})
    assert measured_difference(before, after)["measured_values_different"] == []


def test_a_different_layer_widths_setting_is_still_a_difference(tmp_path):
    before = _write(tmp_path / "before.json", {"kv_share": 0.7, "allocation": "uniform"})
    after = _write(tmp_path / "after.json", {"kv_share": 0.7, "layer_widths": "sensitivity"})
    assert measured_difference(before, after)["measured_values_different"] == [".settings.layer_widths"]
