"""`kvrewrite eval`: compare a compressed checkpoint (at one or more rates) with its original, on held-out text."""

from __future__ import annotations

import json
from pathlib import Path

from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.spec import CompressionSpec


def evaluate_checkpoint(directory: Path, *, baseline: str | None = None, rates: list[float] | None = None,
                        tokens: int = 8192, seq_len: int = 512, progress: bool = True) -> list[dict]:
    """Rows for the eval table: the baseline first, then the checkpoint at each rate."""
    from transformers import AutoTokenizer

    from kvrewrite.calibration_data import evaluation_token_sequences
    from kvrewrite.evaluation import evaluate_many
    from kvrewrite.passes.load_checkpoint import load_fp32_model
    from kvrewrite.runtime import load, verify_checkpoint_files
    from kvrewrite.sources import resolve_model_source

    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise CorruptCheckpointError(f"{directory} has no config.json; is it a kvrewrite checkpoint?")
    spec = json.loads(config_path.read_text()).get("kvrewrite")
    if spec is None:
        raise CorruptCheckpointError(f"{config_path} has no kvrewrite compression spec")
    rate_list = rates if rates else [spec["target_rate"]]
    parsed = CompressionSpec.from_dict(spec)
    for rate in rate_list:
        parsed.ranks_for_rate(rate)  # an unknown rate fails now, naming the table, not after loading two models
    verify_checkpoint_files(Path(directory))  # likewise a damaged or edited checkpoint
    source = baseline or spec["source_model"]
    original = load_fp32_model(resolve_model_source(source).path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    windows = evaluation_token_sequences(tokenizer, tokens, seq_len)
    models = {f"{Path(directory).name} p={rate:.2f}": load(directory, rate=rate) for rate in rate_list}
    results = evaluate_many(models, windows, baseline=original, progress=progress)
    return result_rows(source, results, dict(zip(models, rate_list)))


def result_rows(baseline_name: str, results: dict, rates: dict[str, float]) -> list[dict]:
    first = next(iter(results.values()))
    rows = [{
        "name": f"{baseline_name} (original)", "baseline": True, "rate": 0.0,
        "perplexity": first.baseline_perplexity, "kl_mean": None, "top1_agreement": None,
        "kv_bytes_per_token": first.baseline_kv_bytes_per_token, "n_tokens": first.n_tokens,
    }]
    for name, result in results.items():
        rows.append({"name": name, "rate": rates[name], **result.as_dict()})
    return rows

