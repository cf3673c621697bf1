"""`kvrewrite budget`: split a KV byte budget across window, ranks, bits and eviction by measured calibration quality,
and record the winner in the checkpoint so `kvrewrite.load(DIR)` uses it (kvrewrite.tiers.budget)."""

from __future__ import annotations

from pathlib import Path

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError
from dataclasses import asdict

from kvrewrite.tiers.budget import (DEFAULT_BITS, DEFAULT_RATES, DEFAULT_WINDOWS, Candidate, best, candidates, measure,
                                    solve_keep, write_token_policy)


def split_budget(directory: Path, budget: float, *, context: int = 4096, windows: int = 2, length: int = 1024,
                 calibration: str = "wiki", seed: int = 1, recent_windows=DEFAULT_WINDOWS, rates=DEFAULT_RATES,
                 bits_options=DEFAULT_BITS, progress: bool = True, write: bool = True) -> dict:
    """Measure every split of `budget` (a share of the fp16 cache at `context` tokens) on `windows` calibration windows
    of `length` tokens (the first half is context, the second half scored) and record the best in the checkpoint.

    Each split is measured with its keep share solved for `length` tokens (equal bytes on the windows measured); the
    winner's (window, rate, bits) is recorded with the keep share solved for `context` tokens.
    Returns {"reference": mean NLL of the full-rank cache, "candidates": [Candidate] (as measured), "winner": the best
    of them, "chosen": the winner at `context`, "path"}.
    """
    from transformers import AutoTokenizer

    from kvrewrite.calibration_data import calibration_token_sequences
    from kvrewrite.evaluation import continuation_nll
    from kvrewrite.progress import progress_bar
    from kvrewrite.runtime import load, verify_checkpoint_files

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CorruptCheckpointError(f"{directory} has no config.json; is it a kvrewrite checkpoint?")
    if windows < 1 or length < 4:
        raise InvalidArgumentError(f"budget measurement needs >= 1 window of >= 4 tokens, got {windows} x {length}")
    verify_checkpoint_files(directory)
    reference_model = load(directory, rate=0.0, kv_codec="none", token_policy=False).eval()
    spec = reference_model.compression_spec
    head_dim, n_kv = spec.head_dim, spec.num_key_value_heads
    # Every split is measured at the budget on the windows it is measured on (bytes at `length` tokens), so the
    # ranking compares equal bytes; the winner's keep share is then solved again for `context` tokens.
    found = candidates(spec, head_dim, n_kv, budget, length, recent_windows, rates, bits_options)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    token_windows = calibration_token_sequences(calibration, tokenizer, windows * length, length, seed=seed)
    scored_from = length // 2
    fp16_per_token = 2 * 2 * head_dim * n_kv * spec.num_layers
    with progress_bar("measuring budget splits", len(found) + 1, progress) as bar:
        nll, count, _ = continuation_nll(reference_model, token_windows, scored_from, reference_model.make_kv_cache)
        reference = nll / count
        bar.advance()

        def loader(options: dict):
            return load(directory, token_policy=False, **options).eval()

        measured = measure(loader, found, token_windows, scored_from, fp16_per_token,
                           progress=lambda _c: bar.advance())
    winner = best(measured)
    chosen = solve_keep(spec, head_dim, n_kv, budget, context, winner.window, winner.rate, winner.bits)
    chosen = Candidate(**{**asdict(chosen), "nll": winner.nll, "measured_share": winner.measured_share})
    path = None
    if write:
        path = write_token_policy(directory, chosen, measured, budget, context, {
            "source": calibration, "windows": windows, "length": length, "seed": seed, "scored_from": scored_from,
            "reference_nll": reference})
    return {"reference": reference, "candidates": measured, "winner": winner, "chosen": chosen, "path": path}


def budget_rows(result: dict) -> list[dict]:
    """Table rows: every candidate with its Δppl against the full-rank cache of the same checkpoint."""
    import math

    rows = []
    for c in sorted(result["candidates"], key=lambda c: c.nll):
        rows.append({"split": c.label(), "bytes_share": c.bytes_share, "measured_share": c.measured_share,
                     "delta_ppl": math.exp(c.nll - result["reference"]) - 1, "chosen": c == result["winner"]})
    return rows


__all__ = ["Candidate", "budget_rows", "split_budget"]
