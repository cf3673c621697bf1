"""Continuation evaluation (kvrewrite.publish.continuation_eval, `kvrewrite eval --positions`) against a dense
one-shot forward of the same models: scoring through the cache, chunk by chunk, must give the dense figures."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_llama_config, tiny_pipeline
from transformers import AutoTokenizer, LlamaForCausalLM
from typer.testing import CliRunner

from kvrewrite.cli.app import app
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.io.calibration_data import evaluation_token_sequences
from kvrewrite.publish.continuation_eval import PositionRange, continuation_quality, parse_positions
from kvrewrite.runtime.load import load

RANGES = (PositionRange(5, 12), PositionRange(20, 40))


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def _dense(model: torch.nn.Module, windows: torch.Tensor, r: PositionRange) -> torch.Tensor:
    """Log-probabilities of the tokens at positions [r.start, r.end) from one forward with no cache: [n, len, V]."""
    with torch.no_grad():
        logits = model(windows).logits[:, r.start - 1 : r.end - 1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_scores_equal_a_dense_forward_at_the_chosen_positions(chunk: int) -> None:
    model, baseline = _model(1), _model(0)
    windows = random_windows(n=3, length=40)
    out = continuation_quality({"m": model}, windows, RANGES, baseline=baseline, chunk=chunk, progress=False)
    for r in RANGES:
        logp, ref = _dense(model, windows, r), _dense(baseline, windows, r)
        targets = windows[:, r.start : r.end]
        nll = -logp.gather(-1, targets[..., None]).mean().item()
        base_nll = -ref.gather(-1, targets[..., None]).mean().item()
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        agree = (ref.argmax(-1) == logp.argmax(-1)).float().mean().item()
        stats = out["m"].by_range[r.label]
        assert stats.n_tokens == 3 * (r.end - r.start)
        assert stats.perplexity == pytest.approx(math.exp(nll), rel=1e-5)
        assert stats.baseline_perplexity == pytest.approx(math.exp(base_nll), rel=1e-5)
        assert stats.kl_mean == pytest.approx(kl, rel=1e-4, abs=1e-7)
        assert stats.top1_agreement == pytest.approx(agree)
        assert out["baseline"].by_range[r.label].perplexity == pytest.approx(math.exp(base_nll), rel=1e-5)
    # The stock cache holds K and V of every layer: 2 * layers * kv_heads * head_dim floats per token.
    config = tiny_llama_config()
    assert (
        out["m"].kv_bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    )


def test_a_lossy_cache_is_read_by_the_scored_tokens(tmp_path) -> None:
    """An int2-coded cache (no full-precision recent window) changes the scores of later positions (a one-shot forward would never read it)."""
    source = save_tiny_llama(tmp_path / "src")
    out = tmp_path / "ckpt"
    run_pipeline(Plan(model=str(source), output=out, progress=False), tiny_pipeline())
    windows = random_windows(n=2, length=48, seed=3)
    ranges = (PositionRange(40, 48),)
    plain = load(out, rate=0.0)
    coded = load(out, rate=0.0, kv_codec="int2:residual=0")
    res = continuation_quality({"plain": plain, "coded": coded}, windows, ranges, chunk=8, progress=False)
    dense = _dense(plain, windows, ranges[0]).gather(-1, windows[:, 40:48, None]).mean().item()
    assert res["plain"].by_range["40-48"].perplexity == pytest.approx(math.exp(-dense), rel=1e-5)
    assert abs(res["coded"].by_range["40-48"].perplexity / res["plain"].by_range["40-48"].perplexity - 1) > 1e-3
    assert res["coded"].kv_bytes_per_token < res["plain"].kv_bytes_per_token


def test_parse_positions() -> None:
    assert parse_positions("2K-4K,512-1K") == (PositionRange(512, 1024), PositionRange(2048, 4096))
    assert parse_positions("1-8") == (PositionRange(1, 8),)
    for bad, needle in (
        ("0-8", "1 <= start < end"),
        ("8-8", "1 <= start < end"),
        ("1-4,3-9", "overlap"),
        ("a-4", "not a whole number"),
        ("12", "expected ranges"),
    ):
        with pytest.raises(InvalidArgumentError, match=needle):
            parse_positions(bad)


def test_ranges_beyond_the_windows_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="ends beyond the 40-token"):
        continuation_quality({"m": _model(0)}, random_windows(n=1, length=40), (PositionRange(8, 41),), progress=False)


def test_cli_positions_match_a_dense_forward_of_the_original(tmp_path) -> None:
    source = save_tiny_llama(tmp_path / "src")
    out = tmp_path / "ckpt"
    run_pipeline(Plan(model=str(source), output=out, progress=False), tiny_pipeline())
    json_path = tmp_path / "rows.json"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            str(out),
            "--baseline",
            str(source),
            "--positions",
            "16-32,48-64",
            "--tokens",
            "128",
            "--json",
            str(json_path),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(json_path.read_text())
    assert [(r["positions"], r.get("baseline", False)) for r in rows] == [
        ("16-32", True),
        ("16-32", False),
        ("48-64", True),
        ("48-64", False),
    ]
    saved = json.loads((out / "eval_results_continuation.json").read_text())
    assert saved["settings"]["positions"] == ["16-32", "48-64"] and saved["settings"]["seq_len"] == 64
    assert not (out / "eval_results.json").exists()  # the windows' table (the card's) is left alone
    windows = evaluation_token_sequences(AutoTokenizer.from_pretrained(out), 128, 64)
    original = LlamaForCausalLM.from_pretrained(source).eval()
    for row in rows:
        if not row.get("baseline"):
            continue
        r = PositionRange(*map(int, row["positions"].split("-")))
        nll = -_dense(original, windows, r).gather(-1, windows[:, r.start : r.end, None]).mean().item()
        assert row["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
        assert row["n_tokens"] == 2 * 16


def test_news_text_is_the_held_out_half_of_the_lee_corpus() -> None:
    pytest.importorskip("gensim")
    from kvrewrite.io.calibration_data import news_split

    class Bytes:
        eos_token_id = 256

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(t.encode()) for t in texts]}

    first, held_out = news_split()
    windows = evaluation_token_sequences(Bytes(), 8192, 1024, text="news")
    assert windows.shape == (8, 1024)
    held, free = "".join(held_out), "".join(first)
    for row in windows.tolist():
        piece = bytes(i for i in row[100:200] if i < 256).decode(errors="ignore")
        assert piece in held and piece not in free
    with pytest.raises(InvalidArgumentError, match="unknown evaluation text"):
        evaluation_token_sequences(Bytes(), 8192, 1024, text="blogs")
