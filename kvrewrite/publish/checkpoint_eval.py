"""Checkpoint evaluation behind `kvrewrite eval`: compare a compressed checkpoint (at one or more rates) with its
original, on held-out text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError
from kvrewrite.publish.continuation_eval import DEFAULT_CONTINUATION_CHUNK, PositionRange, continuation_quality
from kvrewrite.publish.evaluation import default_chunk, kv_cache_bytes_per_token_formula
from kvrewrite.spec import CompressionSpec, rate_key


def evaluate_checkpoint(
    directory: Path,
    *,
    baseline: str | None = None,
    rates: list[float] | None = None,
    tokens: int = 8192,
    seq_len: int = 512,
    progress: bool = True,
    kv_codecs: list[str] | None = None,
    chunk: int | None = None,
    recent_windows: list[int] | None = None,
    positions: tuple[PositionRange, ...] | None = None,
    text: str = "wiki",
) -> list[dict]:
    """Rows for the eval table: the baseline first, then the checkpoint at each rate (and each KV codec).

    positions: continuation mode (kvrewrite.publish.continuation_eval): windows as long as the last range's end, fed
    through each model's cache in chunks, and only the tokens at these positions scored; one group of rows per range.
    text: the held-out evaluation text, "wiki" or "news".

    kv_codecs: codecs to evaluate instead of the compiled one ("none" = the plain reduced cache).
    recent_windows: token tiers (kvrewrite.runtime.tiers) to evaluate instead of the plain cache: each query reads its last W
    tokens at full rank. A tiered forward reads its own cache, so one forward per window measures it exactly.
    chunk: chunked-prefill length; default evaluation.CODEC_EVAL_CHUNK when any codec is in use (a one-shot forward would
    never read the cache, so a lossy cache would go unmeasured), else one forward per window.
    """
    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.io.tokenizer_loading import load_tokenizer
    from kvrewrite.publish.evaluation import evaluate_many
    from kvrewrite.runtime.mla.checkpoint import is_mla_checkpoint

    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise CorruptCheckpointError(f"{directory} has no config.json; is it a kvrewrite checkpoint?")
    config = json.loads(config_path.read_text())
    if is_mla_checkpoint(config):
        source, original, models, model_rates = _mla_models(
            Path(directory), config, baseline, rates, kv_codecs, recent_windows
        )
    else:
        source, original, models, model_rates = _per_head_models(
            Path(directory), config, baseline, rates, kv_codecs, recent_windows
        )
    tokenizer = load_tokenizer(directory)
    window_len = positions[-1].end if positions else seq_len
    windows = evaluation_token_sequences(tokenizer, tokens, window_len, text)
    if positions:
        chunk = chunk if chunk is not None else (default_chunk(models.values()) or DEFAULT_CONTINUATION_CHUNK)
        measured = continuation_quality(models, windows, positions, baseline=original, chunk=chunk, progress=progress)
        rows = continuation_rows(source, measured, model_rates)
    else:
        chunk = chunk if chunk is not None else default_chunk(models.values())
        results = evaluate_many(models, windows, baseline=original, progress=progress, chunk=chunk)
        rows = result_rows(source, results, model_rates)
    fp16 = kv_cache_bytes_per_token_formula(original.config, torch.float16)
    for row in rows:
        row["fp16_kv_bytes_per_token"] = fp16
        row["chunk"] = chunk
        row["text"] = text
    return rows


def _per_head_models(
    directory: Path,
    config: dict,
    baseline: str | None,
    rates: list[float] | None,
    kv_codecs: list[str] | None,
    recent_windows: list[int] | None,
):
    """A per-head checkpoint at each rate (and codec, and token tier), with its source model."""
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.runtime.checkpoint_files import verify_checkpoint_files
    from kvrewrite.runtime.load import load

    spec = config.get("kvrewrite")
    if spec is None:
        raise CorruptCheckpointError(f"{directory / 'config.json'} has no kvrewrite compression spec")
    verify_checkpoint_files(directory)  # a damaged or edited checkpoint fails now, naming the file
    rate_list = rates if rates else [spec["target_rate"]]
    parsed = CompressionSpec.from_dict(spec)
    for rate in rate_list:
        parsed.ranks_for_rate(rate)  # likewise an unknown rate, naming the table, not after loading two models
    source = baseline or spec["source_model"]
    baseline_dir = resolve_model_source(source).path
    refuse_compressed_baseline(directory, baseline_dir, given=baseline is not None)
    original = load_fp32_model(baseline_dir)
    codec_list = kv_codecs if kv_codecs else ["compiled"]
    models, model_rates = {}, {}
    for rate in rate_list:
        for codec in codec_list:
            for window in recent_windows or [None]:
                model = load(directory, rate=rate, kv_codec=codec, recent_window=window)
                codec_config = model.kv_codec if window is None else model.tier_policy.codec
                label = codec_config.describe() if codec_config is not None else "none"
                name = (
                    f"{directory.name} p={rate:.2f}"
                    + (f" +W={window}" if window is not None else "")
                    + (f" +{label}" if label != "none" else "")
                )
                models[name], model_rates[name] = model, rate
    return source, original, models, model_rates


def _mla_models(
    directory: Path,
    config: dict,
    baseline: str | None,
    rates: list[float] | None,
    kv_codecs: list[str] | None,
    recent_windows: list[int] | None,
):
    """An MLA export (export-mla) at its own widths, or at each rate of its rate table, run by kvrewrite's absorbed
    runtime, with its source model (recorded by the export, or --baseline)."""
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.runtime.checkpoint_files import verify_mla_files
    from kvrewrite.runtime.mla.checkpoint import MLA_MARKER, RATE_TABLE_KEY

    if kv_codecs or recent_windows:
        raise InvalidArgumentError(
            f"{directory} is an MLA export: --kv-codec and --recent-window apply to the per-head forms only"
        )
    verify_mla_files(directory)  # an edited or damaged export fails now, naming the file, not after the baseline loads
    marker = config[MLA_MARKER]
    table = marker.get(RATE_TABLE_KEY) or {}
    unknown = [rate_key(r) for r in rates or [] if rate_key(r) not in table]
    if unknown:
        raise InvalidArgumentError(
            f"{directory} is an MLA export whose rate table has no rate {', '.join(unknown)} "
            f"(rates: {', '.join(table) or 'none'})"
        )
    source = baseline or marker.get("source_model")
    if source is None:
        raise InvalidArgumentError(
            f"{directory} is an MLA export that does not record its source model; pass --baseline"
        )
    baseline_dir = resolve_model_source(source).path
    refuse_compressed_baseline(directory, baseline_dir, given=baseline is not None)
    original = load_fp32_model(baseline_dir)
    models, model_rates = mla_models_at_rates(directory, rates, original.config, directory.name)
    return source, original, models, model_rates


def mla_models_at_rates(
    directory: Path, rates: list[float] | None, source_config: Any, name: str
) -> tuple[dict[str, Any], dict[str, float]]:
    """An MLA export loaded by kvrewrite's runtime at each rate of its table (rates), or at its own widths (None),
    as {"NAME p=RATE": model} and {"NAME p=RATE": rate}."""
    from kvrewrite.runtime.load import load
    from kvrewrite.runtime.mla.checkpoint import latent_ranks

    text = source_config
    values = 2 * text.num_key_value_heads * getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    models, model_rates = {}, {}
    for rate in rates or [None]:
        model = load(directory, rate=rate)
        if rate is None:  # the export's own widths: its rate is the share of K+V it does not cache
            own = latent_ranks(model.config) or [model.config.kv_lora_rank] * model.config.num_hidden_layers
            rate = round(1 - (sum(own) / len(own) + model.config.qk_rope_head_dim) / values, 4)
        label = f"{name} p={rate:.2f}"
        models[label], model_rates[label] = model, rate
    return models, model_rates


def refuse_compressed_baseline(checkpoint: Path, baseline_dir: Path, given: bool) -> None:
    """The baseline must be an original model: comparing a checkpoint with itself reports a perfect, false result."""
    where = "`baseline`" if given else "the source model recorded in its spec"
    fix = "pass `baseline` with the original (uncompressed) model"
    if baseline_dir.resolve() == checkpoint.resolve():
        raise InvalidArgumentError(f"the baseline ({where}) is {checkpoint} itself; {fix}")
    try:
        baseline_config = json.loads((baseline_dir / "config.json").read_text(encoding="utf-8"))
        compressed = "kvrewrite" in baseline_config or "kvrewrite_mla" in baseline_config
    except (OSError, ValueError, TypeError):
        return  # an unreadable baseline is reported, naming its file, when it is loaded
    if compressed:
        raise InvalidArgumentError(
            f"the baseline {baseline_dir} ({where}) is itself a kvrewrite checkpoint, not the original model; {fix}"
        )


def continuation_rows(baseline_name: str, measured: dict, rates: dict[str, float]) -> list[dict]:
    """Per position range: the baseline's row, then each model's; cache bytes are those held after the window."""
    base = measured["baseline"]
    rows = []
    for label, base_stats in base.by_range.items():
        rows.append(
            {
                "name": f"{baseline_name} (original)",
                "baseline": True,
                "rate": 0.0,
                "positions": label,
                "perplexity": base_stats.perplexity,
                "kl_mean": None,
                "top1_agreement": None,
                "kv_bytes_per_token": base.kv_bytes_per_token,
                "n_tokens": base_stats.n_tokens,
            }
        )
        for name, result in measured.items():
            if name == "baseline":
                continue
            stats = result.by_range[label]
            rows.append(
                {
                    "name": name,
                    "rate": rates[name],
                    "positions": label,
                    "perplexity": stats.perplexity,
                    "kl_mean": stats.kl_mean,
                    "top1_agreement": stats.top1_agreement,
                    "kv_bytes_per_token": result.kv_bytes_per_token,
                    "n_tokens": stats.n_tokens,
                    "baseline_perplexity": stats.baseline_perplexity,
                    "baseline_kv_bytes_per_token": base.kv_bytes_per_token,
                }
            )
    return rows


def result_rows(baseline_name: str, results: dict, rates: dict[str, float]) -> list[dict]:
    first = next(iter(results.values()))
    rows = [
        {
            "name": f"{baseline_name} (original)",
            "baseline": True,
            "rate": 0.0,
            "perplexity": first.baseline_perplexity,
            "kl_mean": None,
            "top1_agreement": None,
            "kv_bytes_per_token": first.baseline_kv_bytes_per_token,
            "n_tokens": first.n_tokens,
        }
    ]
    for name, result in results.items():
        rows.append({"name": name, "rate": rates[name], **result.as_dict()})
    return rows
