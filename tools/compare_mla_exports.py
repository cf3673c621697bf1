"""Two MLA exports of the same settings compared: every file, every tensor bit for bit, and the logits of both loaded
by kvrewrite's runtime (at the export's widths and at every rate of its table) on held-out text.

    python tools/compare_mla_exports.py --pair NAME BEFORE_DIR AFTER_DIR [--pair ...] [--setting NAME FLAGS ...] \
        [--measured NAME BEFORE_JSON AFTER_JSON ...] --json OUT --before-commit C1 --after-commit C2 \
        --command-before "..." --command-after "..."

Used to show that a refactor of the MLA compiler writes the same checkpoints: `kvrewrite export-mla` as
`kvrewrite.export_mla(source, MLAPlan)` (benchmarks/results/mla_export_api_equivalence.json, mla_api_identity.json),
and export_mla's steps as passes (mla_pass_refactor_identity.json, with tools/mla_export_variants.py, whose
NAME.measured.json files --measured compares: every figure export_mla returned).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def config_differences(a, b, path: str = "") -> list[str]:
    """The key paths where two JSON documents differ (a training's wall time, say)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d for key in sorted(set(a) | set(b)) for d in config_differences(a.get(key), b.get(key), f"{path}.{key}")
        ]
    return [] if a == b else [path]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: bit for bit, so -0.0 and 0.0 (equal as numbers) differ."""
    return tensor.contiguous().flatten().view(torch.uint8)


def compare_files(before: Path, after: Path) -> dict:
    names = sorted(str(p.relative_to(before)) for p in before.rglob("*") if p.is_file())  # side files included
    other = sorted(str(p.relative_to(after)) for p in after.rglob("*") if p.is_file())
    tensors, different, config = 0, [], []
    for name in names:
        if name not in other:
            continue
        if name.endswith(".safetensors"):
            a, b = load_file(str(before / name)), load_file(str(after / name))
            tensors += len(a)
            different += [
                f"{name}:{key}"
                for key in sorted(set(a) | set(b))
                if key not in a
                or key not in b
                or a[key].dtype != b[key].dtype
                or not torch.equal(bits(a[key]), bits(b[key]))
            ]
        elif name.endswith(".json"):
            config += [
                f"{name}{d}"
                for d in config_differences(
                    json.loads((before / name).read_text()), json.loads((after / name).read_text())
                )
            ]
    return {
        "files_before": names,
        "files_after": other,
        "same_file_names": names == other,
        "tensors": tensors,
        "tensors_different": different,
        "json_values_different": config,
    }


def table_keys(path: Path) -> list[str]:
    return list(json.loads((path / "config.json").read_text())["kvrewrite_mla"].get("rate_table") or {})


def logits_difference(before: Path, after: Path, windows: torch.Tensor) -> dict:
    """max |Δlogit| between the two exports loaded by kvrewrite.load, at their own widths and at each rate both
    tables serve (a table that serves more rates than the other has those compared by nothing)."""
    import kvrewrite

    def table(path: Path) -> dict:
        return json.loads((path / "config.json").read_text())["kvrewrite_mla"].get("rate_table") or {}

    both = [key for key in table(before) if key in table(after)]
    result = {}
    for rate in [None, *[float(key) for key in both]]:
        a, b = kvrewrite.load(before, rate=rate).eval(), kvrewrite.load(after, rate=rate).eval()
        with torch.no_grad():
            diff = max(float((a(w[None]).logits - b(w[None]).logits).abs().max()) for w in windows)
        result["exported widths" if rate is None else f"p={rate:.2f}"] = diff
    return result


def _renamed_settings(record: dict) -> dict:
    """A measured record with its settings under MLAPlan's current field names: records written before the latent
    widths across layers were `layer_widths` name them `allocation`, the same setting."""
    settings = dict(record.get("settings") or {})
    if "allocation" in settings:
        settings.setdefault("layer_widths", settings.pop("allocation"))
    return {**record, "settings": settings} if "settings" in record else record


def measured_difference(before: Path, after: Path) -> dict:
    """Two records of what export_mla measured (tools/mla_export_variants.py): the key paths where they differ, and
    the after's verification figures."""
    a, b = (_renamed_settings(json.loads(path.read_text())) for path in (before, after))
    errors = b.get("latent_norm_errors")
    return {
        "measured_values_different": config_differences(a, b),
        "full_width_diff": b["full_width_diff"],
        "export_diff": b["export_diff"],
        "rate_diffs": b["rate_diffs"],
        "max_latent_norm_error": None if errors is None else max(errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", nargs=3, action="append", metavar=("NAME", "BEFORE", "AFTER"), required=True)
    parser.add_argument(
        "--setting",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "FLAGS"),
        help="the export-mla flags a pair was exported with, recorded with it",
    )
    parser.add_argument(
        "--measured",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "BEFORE_JSON", "AFTER_JSON"),
        help="what export_mla measured for a pair, before and after (tools/mla_export_variants.py)",
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--before-commit", required=True)
    parser.add_argument("--after-commit", required=True)
    parser.add_argument("--command-before", required=True)
    parser.add_argument("--command-after", required=True)
    parser.add_argument("--what", default=None, help="what the comparison shows (default: the MLAPlan refactor's)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from kvrewrite.io.calibration_data import evaluation_token_sequences

    pairs = {}
    for name, before, after in args.pair:
        before, after = Path(before), Path(after)
        tokenizer = AutoTokenizer.from_pretrained(before)
        windows = evaluation_token_sequences(tokenizer, args.windows * args.length, args.length, "wiki")
        pairs[name] = {
            "flags": dict(args.setting).get(name),
            **compare_files(before, after),
            "rate_table_before": sorted(table_keys(before)),
            "rate_table_after": sorted(table_keys(after)),
            "max_abs_logit_difference": logits_difference(before, after, windows),
        }
        measured = {m[0]: m[1:] for m in args.measured}
        if name in measured:
            pairs[name]["export_mla_measured"] = measured_difference(*map(Path, measured[name]))
        print(
            name,
            json.dumps(pairs[name]["max_abs_logit_difference"]),
            "tensors different:",
            pairs[name]["tensors_different"],
            "json values different:",
            pairs[name]["json_values_different"],
            "measured different:",
            pairs[name].get("export_mla_measured", {}).get("measured_values_different"),
        )
    record = {
        "what": args.what
        or "the same export-mla settings run before and after the MLA compiler became "
        "kvrewrite.export_mla(source, MLAPlan): every tensor compared bit for bit, and the logits of both "
        "checkpoints loaded by kvrewrite.load on held-out wiki windows",
        "command": " ".join(sys.argv),
        "before": {"commit": args.before_commit, "command": args.command_before},
        "after": {"commit": args.after_commit, "command": args.command_after},
        "windows": args.windows,
        "length": args.length,
        "text": "wiki (held-out)",
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "exports": pairs,
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
