"""The budget search behind `kvrewrite budget`: split a KV byte budget across window, ranks, bits and eviction by
measured calibration quality, and record the winner in the checkpoint so `kvrewrite.load(DIR)` uses it
(kvrewrite.compile.token_budget). Quality is calibration perplexity, and among the splits within a perplexity slack of
the best, how well each answers planted-key probes (kvrewrite.compile.key_probes)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from kvrewrite.compile.token_budget import (
    DEFAULT_BITS,
    DEFAULT_FLOORS,
    DEFAULT_GROUP_SIZES,
    DEFAULT_PREFILL_SCORES,
    DEFAULT_RATES,
    DEFAULT_WINDOWS,
    MEASURE_CHUNK,
    Candidate,
    candidates,
    choose,
    fp16_bytes,
    group_size_channels,
    holds_keys,
    measure,
    probe_keys,
    ranking,
    regrouped,
    solve_keep,
    within_slack,
    write_token_policy,
)
from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError

# Splits within 2% of the best perplexity are probed for planted keys, 4 probes each (docs/budget.md).
DEFAULT_PERPLEXITY_SLACK = 0.02
DEFAULT_PROBES = 4


def split_budget(
    directory: Path,
    budget: float,
    *,
    context: int = 4096,
    windows: int = 2,
    length: int = 1024,
    calibration: str = "wiki",
    seed: int = 1,
    recent_windows=DEFAULT_WINDOWS,
    rates=DEFAULT_RATES,
    bits_options=DEFAULT_BITS,
    prefill_scores=DEFAULT_PREFILL_SCORES,
    floors=DEFAULT_FLOORS,
    group_sizes=DEFAULT_GROUP_SIZES,
    perplexity_slack: float = DEFAULT_PERPLEXITY_SLACK,
    probes: int = DEFAULT_PROBES,
    progress: bool = True,
    write: bool = True,
) -> dict:
    """Measure every split of `budget` (a share of the fp16 cache) on `windows` calibration windows of `length` tokens
    (the first half is context, the second half scored) and record the best in the checkpoint.

    The best: the lowest perplexity, unless some split within `perplexity_slack` of it (1.02 x at 0.02) holds the
    keys of `probes` planted-key probes (calibration windows of `length` tokens with four labelled keys, one asked:
    token_budget.holds_keys) and it does not; then the lowest perplexity among those that do. With a slack of 0, no
    probes are run.
    Each split is measured with its keep share solved for `length` tokens (equal bytes on the windows measured); the
    winner's (window, rate, bits) is recorded with the keep share solved for `context` tokens. Splits are measured at
    the first of `group_sizes` (channels per quantization pair, or "token"), then the best quantized ones again at
    each other (token_budget.regrouped).
    Returns {"reference": mean NLL of the full-rank cache, "reference_keys": its KeyRecall (None without probes),
    "perplexity_slack", "candidates": [Candidate] (as measured; probed ones carry key_nll), "winner": the best of them, "chosen": the
    winner at `context`, "path"}.
    """
    from kvrewrite.io.calibration_data import calibration_token_sequences
    from kvrewrite.io.tokenizer_loading import load_tokenizer
    from kvrewrite.progress import progress_bar
    from kvrewrite.publish.evaluation import continuation_nll
    from kvrewrite.runtime.codecs.checkpoint import read_codec_tables
    from kvrewrite.runtime.load import load
    from kvrewrite.runtime.tiers.build import enable_tiers

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CorruptCheckpointError(f"{directory} has no config.json; is it a kvrewrite checkpoint?")
    if windows < 1 or length < 4:
        raise InvalidArgumentError(f"budget measurement needs >= 1 window of >= 4 tokens, got {windows} x {length}")
    if perplexity_slack < 0 or (perplexity_slack > 0 and probes < 1):
        raise InvalidArgumentError(
            f"a perplexity slack ({perplexity_slack}) must be >= 0, and > 0 needs >= 1 key probe (got {probes})"
        )
    # One full-rank model (load verifies the checksums) serves every split: a policy lives in the cache, not the weights.
    model = load(directory, rate=0.0, kv_codec="none", token_policy=False).eval()
    spec, tables = model.compression_spec, read_codec_tables(directory)
    # Every split is measured at the budget on the windows it is measured on (bytes at `length` tokens), so the
    # ranking compares equal bytes; the winner's keep share is then solved again for `context` tokens.
    if not group_sizes:
        raise InvalidArgumentError("the budget search needs at least one group size")
    for group in group_sizes:  # every size is checked now, not after the first measurement
        group_size_channels(spec, group)
    found = candidates(
        spec, budget, length, recent_windows, rates, bits_options, prefill_scores, floors, group_sizes=group_sizes[:1]
    )
    tokenizer = load_tokenizer(directory)
    token_windows = calibration_token_sequences(calibration, tokenizer, windows * length, length, seed=seed)
    scored_from = length // 2

    def with_policy(candidate: Candidate):
        enable_tiers(model, spec, candidate.policy(), tables, str(directory))
        if candidate.prefill_score == "reconstruction" and not hasattr(model, "repeat_instruction_ids"):
            from kvrewrite.runtime.tiers.reconstruction import repeat_instruction_ids

            model.repeat_instruction_ids = repeat_instruction_ids(directory)
        return model

    planted, reference_keys = [], None
    if perplexity_slack > 0:
        from kvrewrite.compile.key_probes import key_probes

        # Other windows than the scored ones (seed + 1), each with four keys planted.
        probe_windows = calibration_token_sequences(calibration, tokenizer, probes * length, length, seed=seed + 1)
        planted = key_probes(tokenizer, probe_windows, seed=seed)

    with progress_bar("measuring budget splits", len(found) + 1, progress) as bar:
        nll, count, _ = continuation_nll(model, token_windows, scored_from, model.make_kv_cache)  # the full-rank cache
        reference = nll / count
        if planted:  # what the full-rank cache answers: the most any split can
            from kvrewrite.compile.key_probes import key_recall

            reference_keys = key_recall(model, planted, model.make_kv_cache, MEASURE_CHUNK)
        bar.advance()
        measured = measure(
            with_policy, found, token_windows, scored_from, fp16_bytes(spec, 1), progress=lambda _c: bar.advance()
        )
    # The best quantized splits again at the other group sizes (token_budget.regrouped).
    regroup = regrouped(spec, budget, length, measured, group_sizes[1:]) if len(group_sizes) > 1 else []
    if regroup:
        with progress_bar("measuring wider groups", len(regroup), progress) as bar:
            measured += measure(
                with_policy, regroup, token_windows, scored_from, fp16_bytes(spec, 1), lambda _c: bar.advance()
            )
    if perplexity_slack > 0:
        shortlist = within_slack(measured, perplexity_slack)
        with progress_bar("probing planted keys", len(shortlist), progress) as bar:
            probed = dict(zip(shortlist, probe_keys(with_policy, shortlist, planted, lambda _c: bar.advance())))
        measured = [probed.get(c, c) for c in measured]
    winner = choose(measured, perplexity_slack, None if reference_keys is None else reference_keys.answer_nll)
    chosen = solve_keep(
        spec,
        budget,
        context,
        winner.window,
        winner.rate,
        winner.bits,
        winner.prefill_score,
        winner.floor,
        winner.reconstruction_share,
        winner.group_size,
    )
    chosen = Candidate(**{**asdict(chosen), "nll": winner.nll, "measured_share": winner.measured_share})
    path = None
    if write:
        path = write_token_policy(
            directory,
            chosen,
            measured,
            budget,
            context,
            {
                "source": calibration,
                "windows": windows,
                "length": length,
                "seed": seed,
                "scored_from": scored_from,
                "reference_nll": reference,
                "perplexity_slack": perplexity_slack,
                "key_probes": probes if reference_keys is not None else 0,
                "reference_key_nll": None if reference_keys is None else reference_keys.answer_nll,
                "reference_keys_answered": None if reference_keys is None else reference_keys.answered,
            },
        )
    return {
        "reference": reference,
        "reference_keys": reference_keys,
        "perplexity_slack": perplexity_slack,
        "candidates": measured,
        "winner": winner,
        "chosen": chosen,
        "path": path,
    }


def budget_rows(result: dict) -> list[dict]:
    """Table rows: every candidate with its Δppl against the full-rank cache of the same checkpoint."""
    import math

    rows = []
    keys = result["reference_keys"]
    for c in sorted(result["candidates"], key=ranking):
        rows.append(
            {
                "split": c.label(),
                **asdict(c),
                "delta_ppl": math.exp(c.nll - result["reference"]) - 1,
                "key_probes": None if keys is None else keys.probes,
                "holds_keys": None if keys is None or c.key_nll is None else holds_keys(c, keys.answer_nll),
                "chosen": c == result["winner"],
            }
        )
    return rows


__all__ = ["Candidate", "budget_rows", "split_budget"]
