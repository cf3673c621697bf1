"""The KV byte budget split (kvrewrite.compile.token_budget): its bytes formula against the bytes the cache really holds, the
keep share it solves against the budget, and `kvrewrite budget` end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.compile.token_budget import KEY_NLL_MARGIN, fp16_bytes, held_bytes, solve_keep
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.io.checkpoint_io import CHECKSUM_FILE
from kvrewrite.publish.evaluation import cache_tensor_bytes, continuation_nll
from kvrewrite.runtime.cache_policy import CachePolicy
from kvrewrite.runtime.tiers import EvictionPolicy
from kvrewrite.runtime.tiers.eviction import eviction_policy_for_rate
from kvrewrite.runtime.tiers.reconstruction import prefill_scored_by_reconstruction


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    src = save_tiny_llama(root / "src", seed=8, num_kv_heads=2, num_heads=4)
    run_pipeline(Plan(model=str(src), output=root / "out", progress=False, target_rate=0.5), tiny_pipeline())
    return root / "out"


@pytest.mark.parametrize(
    "window,rate,bits,keep,context,floor",
    [
        (4, 0.5, None, 0.5, 40, None),
        (2, 0.0, 4, 0.3, 57, None),
        (8, 0.5, 8, 0.9, 8, None),
        (3, 0.5, 2, 0.0, 30, None),
        (3, 0.0, (8, 4), 0.6, 33, None),
        (2, 0.5, (None, 2), 0.5, 20, None),
        (3, 0.0, (8, 4), 0.3, 41, {"key": 4, "value": 2, "bits": 4}),
        (2, 0.5, None, 0.2, 30, {"key": 3, "value": 0, "bits": 2}),
        (4, 0.0, 4, 0.5, 25, {"key": 2, "value": 2, "bits": None}),
    ],
)
def test_formula_equals_the_bytes_the_cache_holds(checkpoint, window, rate, bits, keep, context, floor):
    evict = {"keep": keep, "bits": bits, **({"floor": floor} if floor else {})}
    model = kvrewrite.load(checkpoint, rate=rate, recent_window=window, kv_codec="none", evict=evict).eval()
    cache = model.make_kv_cache()
    tokens = random_windows(n=1, length=context, seed=9)
    with torch.no_grad():
        for s in range(0, context, 7):
            model(tokens[:, s : s + 7], past_key_values=cache, use_cache=True)
    spec = model.compression_spec
    assert cache_tensor_bytes(cache) == held_bytes(model.tier_policy, spec, context)


@pytest.mark.parametrize(
    "rate,bits,group,floor",
    [
        (0.0, 8, "token", None),  # one (scale, minimum) pair per token and side
        (0.5, (4, 2), "token", None),  # cut ranks: the one group is shorter than the full-rank width
        (0.0, (8, 4), 3, None),  # groups that split heads, a last group shorter than the others
        (0.0, None, "token", {"key": 2, "value": 2, "bits": 4}),  # the floor's codes share the group width
    ],
)
def test_formula_equals_the_bytes_the_cache_holds_at_any_group_size(checkpoint, rate, bits, group, floor):
    from kvrewrite.compile.token_budget import group_size_channels

    spec = kvrewrite.load(checkpoint, token_policy=False).compression_spec
    channels = group_size_channels(spec, group)
    assert channels == (spec.head_dim * spec.num_key_value_heads if group == "token" else group)
    evict = {"keep": 0.4, "bits": bits, "group_size": channels, **({"floor": floor} if floor else {})}
    model = kvrewrite.load(checkpoint, rate=rate, recent_window=3, kv_codec="none", evict=evict).eval()
    assert model.tier_policy.group_size == channels
    cache = model.make_kv_cache()
    with torch.no_grad():
        for s in range(0, 45, 7):
            model(random_windows(n=1, length=45, seed=10)[:, s : s + 7], past_key_values=cache, use_cache=True)
    assert cache_tensor_bytes(cache) == held_bytes(model.tier_policy, spec, 45)


def test_wider_groups_are_measured_for_the_best_quantized_splits_only(checkpoint):
    from dataclasses import replace

    from kvrewrite.compile.token_budget import candidates, group_size_channels, parse_group_sizes, regrouped

    spec = kvrewrite.load(checkpoint, token_policy=False).compression_spec
    width = group_size_channels(spec, "token")
    # Groups of 8 channels against one per token and side (32 channels: 2 KV heads of 16).
    found = candidates(spec, 0.3, 64, (2,), (0.0, 0.5), (None, 8, (8, 4)), ("newest",), group_sizes=(8,))
    assert {c.group_size for c in found if c.bits is not None} == {8}  # float16 splits have no groups
    # Give the splits made-up NLLs, the float16 ones best, so the top quantized ones are not the top ones.
    measured = [replace(c, nll=(0.0 if c.bits is None else 1.0 + i / 100)) for i, c in enumerate(found)]
    quantized = [c for c in measured if c.bits is not None]
    more = regrouped(spec, 0.3, 64, measured, ("token",), count=2)
    assert [(c.window, c.rate, c.bits) for c in more] == [(c.window, c.rate, c.bits) for c in quantized[:2]]
    for wide, narrow in zip(more, quantized):
        assert wide.group_size == width and wide.nll is None
        # Fewer (scale, minimum) pairs per token: more tokens within the same budget.
        assert wide.keep > narrow.keep and wide.bytes_share <= 0.3
        assert wide == solve_keep(spec, 0.3, 64, wide.window, wide.rate, wide.bits, group_size=width)
        assert wide.label().startswith(f"W=2 p={wide.rate:g} ") and f"-g{width} " in wide.label()
    # A group size already measured is not measured twice, nor one that stores the same: 64 channels and the
    # token's 32 both hold each side whole, so only the first of them is measured.
    assert regrouped(spec, 0.3, 64, measured, (8,), count=2) == []
    same = regrouped(spec, 0.3, 64, measured, (64, "token"), count=2)
    assert [c.group_size for c in same] == [64, 64]
    assert parse_group_sizes("64, token,64") == (64, "token")
    for bad in ("0", "abc", "64,", "-8"):
        with pytest.raises(InvalidArgumentError, match="--group-sizes"):
            parse_group_sizes(bad)


def test_solved_keep_is_the_largest_within_the_budget(checkpoint):
    spec = kvrewrite.load(checkpoint).compression_spec
    context, budget = 256, 0.2
    limit = budget * 2 * 2 * spec.num_layers * spec.num_key_value_heads * spec.head_dim * context  # fp16 K and V
    assert fp16_bytes(spec, context) * budget == limit
    found = solve_keep(spec, budget, context, 8, 0.5, 4)
    assert 0 < found.keep < 1 and found.bytes_share <= budget

    def bytes_at(keep: float) -> int:
        return held_bytes(eviction_policy_for_rate(spec, 0.5, 8, keep, bits=4), spec, context)

    assert bytes_at(found.keep) <= limit < bytes_at(found.keep + 0.001)
    assert solve_keep(spec, 0.01, context, 64, 0.0, None) is None  # the window alone is over budget


def test_budget_command_records_the_best_split_and_load_uses_it(checkpoint):
    from kvrewrite.compile.budget_search import split_budget

    result = split_budget(
        checkpoint,
        0.3,
        context=48,
        windows=1,
        length=32,
        recent_windows=(2, 4),
        rates=(0.0, 0.5),
        bits_options=(None, 4),
        group_sizes=(8, "token"),  # 8-channel groups, then the best again with one pair per token (32 channels)
        perplexity_slack=0,  # perplexity alone (the planted-key ranking has its own test)
        progress=False,
    )
    measured, winner, chosen = result["candidates"], result["winner"], result["chosen"]
    assert result["reference_keys"] is None and all(c.key_nll is None for c in measured)
    from kvrewrite.compile.token_budget import candidates

    spec = kvrewrite.load(checkpoint, token_policy=False).compression_spec
    fitting = candidates(spec, 0.3, 32, (2, 4), (0.0, 0.5), (None, 4), group_sizes=(8,))
    assert [(c.window, c.rate, c.bits, c.keep) for c in measured[: len(fitting)]] == [
        (c.window, c.rate, c.bits, c.keep) for c in fitting
    ]
    # Then the best quantized splits again with one (scale, minimum) pair per token and side (token_budget.regrouped).
    wide = measured[len(fitting) :]
    width = spec.head_dim * spec.num_key_value_heads
    assert wide and all(c.group_size == width and c.bits == 4 for c in wide)
    best_coded = sorted(
        (c for c in measured[: len(fitting)] if c.bits is not None), key=lambda c: (c.nll, c.bytes_share)
    )
    assert [(c.window, c.rate, c.prefill_score, c.reconstruction_share) for c in wide] == [
        (c.window, c.rate, c.prefill_score, c.reconstruction_share) for c in best_coded[: len(wide)]
    ]
    assert len(measured) >= 4 and all(c.bytes_share <= 0.3 for c in measured)
    # Both ways of choosing a prompt's kept tokens are measured, at the same splits.
    assert {c.prefill_score for c in measured} == {"newest", "reconstruction"}
    # A reconstruction split is measured whole and with a half and a quarter of the prompt's budget chosen by it.
    assert {c.reconstruction_share for c in measured if c.prefill_score == "reconstruction"} == {1.0, 0.5, 0.25}
    assert all(c.reconstruction_share == 1.0 for c in measured if c.prefill_score == "newest")
    for c in measured:  # measured at the budget for the windows' length: the bytes really held agree
        assert c.measured_share <= 0.3 + 1e-9 and c.measured_share == pytest.approx(c.bytes_share, abs=0.02)
    assert winner.nll == min(c.nll for c in measured)
    assert (chosen.window, chosen.rate, chosen.bits, chosen.group_size) == (
        winner.window,
        winner.rate,
        winner.bits,
        winner.group_size,
    )
    assert chosen.keep >= winner.keep and chosen.bytes_share <= 0.3  # re-solved for 48 tokens: the window weighs less
    record = json.loads((checkpoint / "token_policy.json").read_text())
    assert record["policy"] == chosen.policy().to_dict()
    assert CachePolicy.from_dict(record["policy"]) == chosen.policy()
    assert "token_policy.json" in json.loads((checkpoint / CHECKSUM_FILE).read_text())
    # load(DIR) now uses the split; an explicit rate, or token_policy=False, does not.
    model = kvrewrite.load(checkpoint).eval()
    assert model.cache_policy == chosen.policy()
    assert isinstance(model.tier_policy, EvictionPolicy)
    assert model.tier_policy.window == chosen.window and model.tier_policy.bits == chosen.bits
    assert model.tier_policy.group_size == chosen.group_size
    assert model.tier_policy.prefill_score == chosen.prefill_score
    assert model.tier_policy.reconstruction_share == chosen.reconstruction_share
    assert kvrewrite.load(checkpoint, token_policy=False).tier_policy is None
    assert kvrewrite.load(checkpoint, rate=0.5).tier_policy is None
    # The recorded NLL is what the chosen model gives on the same calibration windows, measured again.
    from transformers import AutoTokenizer

    from kvrewrite.io.calibration_data import calibration_token_sequences

    windows = calibration_token_sequences("wiki", AutoTokenizer.from_pretrained(checkpoint), 32, 32, seed=1)
    prefill = None
    if chosen.prefill_score == "reconstruction":

        def prefill(model, cache, ids):
            return prefill_scored_by_reconstruction(model, cache, ids, model.repeat_instruction_ids)

    nll, count, _ = continuation_nll(model, windows, 16, model.make_kv_cache, chunk=64, prefill=prefill)
    if chosen.keep == winner.keep:  # the recorded policy is the measured one: its NLL reproduces
        assert nll / count == pytest.approx(chosen.nll, rel=1e-6)
    # An edited policy file is caught by the checksums.
    (checkpoint / "token_policy.json").write_text(json.dumps({**record, "policy": {**record["policy"], "rate": 0.0}}))
    with pytest.raises(kvrewrite.errors.CorruptCheckpointError):
        kvrewrite.load(checkpoint)
    (checkpoint / "token_policy.json").unlink()
    (checkpoint / CHECKSUM_FILE).write_text(
        json.dumps(
            {k: v for k, v in json.loads((checkpoint / CHECKSUM_FILE).read_text()).items() if k != "token_policy.json"}
        )
    )


def test_bad_budgets_are_refused(checkpoint):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app
    from kvrewrite.compile.budget_search import split_budget

    with pytest.raises(InvalidArgumentError, match="no split fits"):
        split_budget(checkpoint, 0.001, context=48, windows=1, length=32, progress=False, write=False)
    runner = CliRunner()
    for bad, message in (("25%", "not a percentage"), ("1.5", "in \\(0, 1\\]"), ("abc", "must be a number")):
        result = runner.invoke(app, ["budget", str(checkpoint), "--kv-budget", bad])
        assert result.exit_code != 0
        assert pytest.importorskip("re").search(message, result.output), result.output
    result = runner.invoke(app, ["budget", str(checkpoint), "--kv-budget", "0.3", "--group-sizes", "64,0"])
    assert result.exit_code != 0 and "--group-sizes takes whole numbers" in result.output, result.output
    # compress --kv-budget refuses a bad budget before any work (no output directory appears).
    out = checkpoint.parent / "never-written"
    result = runner.invoke(app, ["compress", str(checkpoint.parent / "src"), "-o", str(out), "--kv-budget", "2"])
    assert result.exit_code != 0 and "in (0, 1]" in result.output and not out.exists()


def test_budget_cli_dry_run_writes_its_json_and_leaves_the_checkpoint_alone(checkpoint, tmp_path):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app

    sums_before = (checkpoint / CHECKSUM_FILE).read_text()
    out = tmp_path / "splits.json"
    result = CliRunner().invoke(
        app,
        [
            "budget",
            str(checkpoint),
            "--kv-budget",
            "0.5",
            "--context",
            "512",
            "--windows",
            "1",
            "--length",
            "256",
            "--dry-run",
            "--group-sizes",
            "8,token",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    splits = record["splits"]
    # Planted keys were probed on the splits within 2% of the best perplexity, and only on those.
    lowest = min(r["nll"] for r in splits)
    assert {r["split"] for r in splits if r["key_nll"] is not None} == {
        r["split"] for r in splits if math.exp(r["nll"] - lowest) <= 1.02 + 1e-9
    }
    assert record["reference_keys"]["probes"] == 4 and "--perplexity-slack 0.02" in record["command"]
    ranked = [(r["nll"], r["bytes_share"]) for r in splits]
    assert ranked == sorted(ranked)  # perplexity first
    reference = record["reference_keys"]["answer_nll"]
    holding = [r for r in splits if r["key_nll"] is not None and r["key_nll"] <= reference + KEY_NLL_MARGIN]
    assert [r["split"] for r in splits if r["holds_keys"]] == [r["split"] for r in holding]
    best = (holding or splits)[0]  # the lowest perplexity among the splits holding the keys, if any
    assert [r["chosen"] for r in splits] == [r is best for r in splits]
    assert "planted keys: the full-rank cache answers" in result.output
    assert (record["chosen"]["window"], record["chosen"]["rate"]) == (best["window"], best["rate"])
    assert record["chosen"]["bytes_share"] <= 0.5 and all(r["measured_share"] <= 0.5 + 1e-9 for r in splits)
    assert "--dry-run" in record["command"] and record["seconds"] > 0 and record["date"]
    # The best quantized splits were measured again with one (scale, minimum) pair per token and side.
    width = kvrewrite.load(checkpoint, token_policy=False).compression_spec.head_dim * 2
    assert "--group-sizes 8,token" in record["command"]
    assert any(r["group_size"] == width and f"-g{width} " in r["split"] for r in splits)
    assert not (checkpoint / "token_policy.json").exists() and (checkpoint / CHECKSUM_FILE).read_text() == sums_before


def test_the_budget_takes_the_lowest_perplexity_among_splits_in_the_slack_that_hold_planted_keys(checkpoint):
    from kvrewrite.compile.budget_search import split_budget
    from kvrewrite.compile.key_probes import key_probes, key_recall
    from kvrewrite.compile.token_budget import MEASURE_CHUNK, Candidate, _prefill, choose
    from kvrewrite.io.calibration_data import calibration_token_sequences
    from kvrewrite.io.tokenizer_loading import load_tokenizer
    from kvrewrite.runtime.tiers.reconstruction import repeat_instruction_ids

    options = dict(context=512, windows=1, length=256, recent_windows=(2, 8), rates=(0.0,), bits_options=(None, 4))
    result = split_budget(checkpoint, 0.4, perplexity_slack=0.5, probes=2, progress=False, write=False, **options)
    measured, winner = result["candidates"], result["winner"]
    lowest = min(c.nll for c in measured)
    probed = [c for c in measured if c.key_nll is not None]
    assert probed == [c for c in measured if math.exp(c.nll - lowest) <= 1.5 + 1e-9] and len(probed) >= 2
    reference = result["reference_keys"].answer_nll
    holding = [c for c in probed if c.key_nll <= reference + KEY_NLL_MARGIN]
    assert winner == min(holding or measured, key=lambda c: (c.nll, c.bytes_share))
    # The recall is the probes read through the split's own cache, measured again from scratch; the full-rank cache's
    # is the reference.
    tokenizer = load_tokenizer(checkpoint)
    windows = calibration_token_sequences("wiki", tokenizer, 2 * 256, 256, seed=2)
    probes = key_probes(tokenizer, windows, seed=1)
    full = kvrewrite.load(checkpoint, rate=0.0, kv_codec="none", token_policy=False).eval()
    assert key_recall(full, probes, full.make_kv_cache, MEASURE_CHUNK) == result["reference_keys"]
    for c in (winner, probed[-1]):
        policy = c.policy()
        model = kvrewrite.load(checkpoint, policy=policy, token_policy=False).eval()
        model.repeat_instruction_ids = repeat_instruction_ids(checkpoint)
        again = key_recall(model, probes, model.make_kv_cache, MEASURE_CHUNK, _prefill(c))
        assert again.answer_nll == pytest.approx(c.key_nll, rel=1e-6) and again.answered == c.keys_answered
    # choose(): the slack decides who may win, holding the keys decides among them, perplexity among those.
    a = Candidate(16, 0.0, 4, 0.3, 0.1, nll=1.00, key_nll=3.0)
    b = Candidate(16, 0.0, 8, 0.2, 0.1, nll=1.01, key_nll=0.6)
    c = Candidate(16, 0.0, 8, 0.15, 0.1, nll=1.015, key_nll=0.5)
    d = Candidate(16, 0.0, 8, 0.1, 0.1, nll=1.20, key_nll=0.1)
    assert choose([a, b, c, d], 0.0, 0.5) == a  # no slack: perplexity alone
    assert choose([a, b, c, d], 0.02, 0.5) == b  # b and c hold the keys (within 0.15 of 0.5); b has the lower NLL
    assert choose([a, b, c, d], 0.02, 0.3) == a  # neither holds them against a better full-rank cache: perplexity
    assert choose([a, b, c, d], 0.5, 0.05) == d and choose([a, b, c, d], 0.5, None) == a
    with pytest.raises(InvalidArgumentError, match="slack"):
        choose([a, b, c, d], -0.1, 0.5)
