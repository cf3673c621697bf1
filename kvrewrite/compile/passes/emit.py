"""Pass 8: write the checkpoint atomically: shards (written layer by layer as they fill), config, tokenizer,
kernel metadata, report, and the manifest of every file (io/manifest.py)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.plan import Plan, parse_size
from kvrewrite.io.checkpoint_io import ShardWriter, atomic_output_dir
from kvrewrite.io.fault_injection import fault_point
from kvrewrite.io.manifest import MODELING_FILE, write_manifest
from kvrewrite.key_modes import key_mode
from kvrewrite.progress import progress_bar
from kvrewrite.runtime.codecs.checkpoint import write_codec_tables
from kvrewrite.runtime.compressed_model import compressed_classes, compressed_config
from kvrewrite.spec import CompressionSpec

HUB_MODELING_STUB = '''"""This checkpoint was rewritten by kvrewrite: its attention stores a compressed KV cache.

Loading it needs the kvrewrite package: `pip install kvrewrite`, then `import kvrewrite` before
`AutoModelForCausalLM.from_pretrained(...)` (no trust_remote_code needed once it is imported).
"""

try:
    from kvrewrite.modeling.families import {config_class}, {model_class}  # noqa: F401
except ImportError as exc:  # pragma: no cover - only hit without kvrewrite installed
    raise ImportError(
        "This is a kvrewrite checkpoint: install kvrewrite (`pip install kvrewrite`) and `import kvrewrite` "
        "before loading it with transformers."
    ) from exc
'''

BUCKET_MULTIPLE = 8


def rank_buckets(ranks: list[int], multiple: int = BUCKET_MULTIPLE) -> list[dict]:
    """Heads grouped by rank rounded up to `multiple` (what a bucketed kernel launches together)."""
    buckets: dict[int, list[int]] = defaultdict(list)
    for head, r in enumerate(ranks):
        buckets[-(-r // multiple) * multiple].append(head)
    return [{"rank": r, "heads": heads} for r, heads in sorted(buckets.items())]


def kernel_metadata(spec: CompressionSpec, transforms) -> dict:
    layers = []
    for layer_spec, t in zip(spec.layers, transforms):
        shared = key_mode(layer_spec.key_mode).shared_key_block
        layers.append(
            {
                "key_mode": layer_spec.key_mode,
                # "shared": one key block scored by every query head (crosshead), rank key_ranks[0].
                "key_layout": "shared" if shared else "per_kv_head",
                "key_ranks": layer_spec.key_ranks,
                "value_ranks": layer_spec.value_ranks,
                "key_buckets": rank_buckets(layer_spec.key_ranks[:1] if shared else layer_spec.key_ranks),
                "value_buckets": rank_buckets(layer_spec.value_ranks),
                "key_spectra": t.key.spectrum.tolist(),
                "value_spectra": t.value.spectrum.tolist(),
            }
        )
    return {
        "format_version": spec.format_version,
        "cache_layout": (
            "per layer: keys [B, 1, S, sum(key_ranks)], values [B, 1, S, sum(value_ranks)], KV heads packed in order "
            "(logical layout; the CPU torch runtime keeps it column-major in DynamicCache layers, tensors "
            "[B, sum(ranks), S, 1], and kvrewrite.runtime.kernels.cache_layout.packed_view gives the logical view); "
            "key_layout 'shared' (crosshead): key_ranks = [R, 0, ...], one key block that every query head "
            "scores against with an R-dim query"
        ),
        "bucket_multiple": BUCKET_MULTIPLE,
        "kept_elements_per_token": spec.kept_elements_per_token,
        "baseline_elements_per_token": spec.baseline_elements_per_token,
        "layers": layers,
        "rate_table": spec.rate_table,
    }


def default_output_dir(model: str, rate: float) -> Path:
    stem = Path(model.rstrip("/")).name or "model"
    return Path(f"{stem}-kvrewrite-p{round(rate * 100):02d}")


def output_dir_for(plan: Plan) -> Path:
    """The directory a compile of `plan` writes, known before any work (the early output checks look at it).

    Under a quality budget the rate is chosen late in the run, so a `pNN` default could not be checked up front
    (and might be another run's directory): the default name carries the budget instead, e.g.
    `<model>-kvrewrite-ppl5` for --max-ppl-increase 5%, `-kl0.05` for --max-kl 0.05, or both.
    """
    if plan.output is not None:
        return Path(plan.output)
    if plan.has_quality_budget():
        stem = Path(plan.model.rstrip("/")).name or "model"
        parts = []
        if plan.max_ppl_increase is not None:
            parts.append(f"ppl{float(plan.max_ppl_increase) * 100:g}")
        if plan.max_kl is not None:
            parts.append(f"kl{float(plan.max_kl):g}")
        return Path(f"{stem}-kvrewrite-{'-'.join(parts)}")
    return default_output_dir(plan.model, plan.target_rate)


class Emit:
    name = "emit"
    description = (
        "write safetensors shards, config.json, tokenizer, kernel_metadata.json, compress_report.json (atomically)"
    )

    produces = ("output_dir",)

    def run(self, ctx: CompileContext) -> dict:
        plan, spec = ctx.plan, ctx.spec
        out = output_dir_for(plan)  # the directory run_pipeline checked before any work
        dtype = plan.compute_dtype(ctx.config)
        with atomic_output_dir(out, overwrite=plan.overwrite) as tmp:
            # Layer by layer: each layer is folded, cast and buffered; a shard is written whenever it is full.
            writer = ShardWriter(tmp, {"kvrewrite_spec": spec.to_json()}, parse_size(plan.max_shard_size))
            names = ctx.folded.output_names(spec)
            with progress_bar("writing shards", len(names), plan.progress) as bar:
                for name in names:
                    writer.add(name, ctx.folded.read([name])[name].to(dtype))
                    bar.advance()
            writer.finish()
            fault_point("emit:shards")
            compressed_config(ctx.config, spec, dtype=dtype).save_pretrained(tmp)
            fault_point("emit:config")
            if ctx.generation_config is not None:
                ctx.generation_config.save_pretrained(tmp)
            ctx.tokenizer.save_pretrained(tmp)
            remove_foreign_code(tmp)
            fault_point("emit:tokenizer")
            (tmp / MODELING_FILE).write_text(modeling_stub(ctx.config))
            (tmp / "kernel_metadata.json").write_text(json.dumps(kernel_metadata(spec, ctx.transforms), indent=1))
            fault_point("emit:metadata")
            report = {**ctx.report, "verification": ctx.verification, "spec_summary": spec_summary(spec)}
            report.pop("rate_table", None)  # lives in config.json and kernel_metadata.json
            (tmp / "compress_report.json").write_text(json.dumps(report, indent=2, default=str))
            fault_point("emit:report")
            write_codec_tables(tmp, ctx.codec_tables)
            write_manifest(tmp)  # every file above, so a later edit of any of them is caught on load
            fault_point("emit:checksums")
        return {"output_dir": Path(out)}


def remove_foreign_code(directory: Path) -> None:
    """Delete any Python file a save_pretrained copied from the source: a checkpoint carries only our stub."""
    for path in directory.rglob("*.py"):
        if path.relative_to(directory) != Path(MODELING_FILE):
            path.unlink()


def modeling_stub(original_config) -> str:
    """The checkpoint's modeling_kvrewrite.py: imports this family's classes from kvrewrite (or says to install it)."""
    config_class, model_class = compressed_classes(original_config)
    return HUB_MODELING_STUB.replace("{config_class}", config_class.__name__).replace(
        "{model_class}", model_class.__name__
    )


def spec_summary(spec: CompressionSpec) -> dict:
    return {
        "objective": spec.objective,
        "allocation": spec.allocation,
        "target_rate": spec.target_rate,
        "achieved_rate": spec.achieved_rate,
        "kept_elements_per_token": spec.kept_elements_per_token,
        "baseline_elements_per_token": spec.baseline_elements_per_token,
        "key_modes": sorted({layer.key_mode for layer in spec.layers}),
        "kv_codec": spec.kv_codec,
    }
