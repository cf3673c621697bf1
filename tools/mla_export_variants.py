"""The MLA export at a few fixed settings of the real SmolLM2-135M, small enough for a CPU: one per branch of
`kvrewrite.export_mla` (uniform + refit, allocated with a served rate table, per-rate refits, a single-rate
distillation after a refit, a nested distillation with per-rate refits after it). Each goes to ROOT/NAME, and what
`export_mla` measured (MLAExport's figures) to ROOT/NAME.measured.json.

    PYTHONPATH=<tree> OMP_NUM_THREADS=1 python tools/mla_export_variants.py ROOT [--only NAME ...]

Run once on the tree before a refactor of the MLA compiler and once after, then compare the two roots with
tools/compare_mla_exports.py (--pair per variant, --measured per variant): benchmarks/results/
mla_pass_refactor_identity.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Small enough for seconds to a minute each on one CPU core: four 512-token windows, one distillation epoch.
COMMON = {"calibration": "wiki", "calib_tokens": 2048, "dtype": "float32", "verify_tokens": 64, "progress": False}
VARIANTS = {
    "uniform_refit": {"kv_share": 0.5, "refit": "output-local", "refit_tokens": 1024},
    "sensitivity_table": {"kv_share": 0.7, "layer_widths": "sensitivity", "serve_rates": (0.3, 0.5)},
    "refit_rates": {"kv_share": 0.7, "serve_rates": (0.3, 0.5), "serve_rates_by": "refit", "refit_tokens": 1024},
    "refit_then_distill": {
        "kv_share": 0.5,
        "refit": "output-local",
        "refit_tokens": 1024,
        "distill": True,
        "distill_epochs": 1,
    },
    "nested_distill_refit_rates": {
        "kv_share": 0.7,
        "layer_widths": "sensitivity",
        "distill": True,
        "distill_rates": (0.3, 0.5),
        "distill_epochs": 1,
        "refit_rates": (0.3, 0.5),
        "refit_tokens": 1024,
    },
}


def measured(result) -> dict:
    """MLAExport's figures, as JSON: every number export_mla measured and the shape of what it wrote."""
    return {
        "latent_widths": [layer.kv_lora_rank for layer in result.layers],
        "served_rates": result.served_rates,
        "neutralisers": [dataclasses.asdict(n) for n in result.summary.neutralisers],
        "full_width_diff": result.full_width_diff,
        "export_diff": result.export_diff,
        "rate_diffs": result.rate_diffs,
        "latent_norm_errors": result.latent_norm_errors,
        "refit": None if result.refit is None else result.refit.provenance(),
        "rate_refit": None if result.rate_refit is None else result.rate_refit.provenance(),
        "distill_validation_kl_after": None
        if result.distilled is None or result.distilled.report is None
        else result.distilled.report.validation_kl_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--only", nargs="*", default=None, choices=sorted(VARIANTS))
    args = parser.parse_args()

    import kvrewrite
    from kvrewrite.compile.mla.plan import MLAPlan

    args.root.mkdir(parents=True, exist_ok=True)
    for name, options in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        result = kvrewrite.export_mla(
            "smollm2-135m", MLAPlan(output=args.root / name, overwrite=True, **COMMON, **options)
        )
        record = {"settings": {**COMMON, **options}, **measured(result)}
        (args.root / f"{name}.measured.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"{name}: {time.perf_counter() - t0:.1f} s, export diff {result.export_diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
