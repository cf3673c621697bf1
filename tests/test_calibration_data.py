"""Calibration / evaluation text: the wiki split, token windows, user files, and synthetic generation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrewrite.errors import CalibrationError, InvalidArgumentError
from kvrewrite.io.calibration_data import (
    calibration_token_sequences,
    evaluation_token_sequences,
    synthetic_texts,
    wiki_articles,
    wiki_split,
)
from kvrewrite.io.calibration_data.synthetic import seed_prompts
from kvrewrite.io.calibration_data.wiki import EVAL_TARGET_CHARS


class ByteTokenizer:
    """A model-free stand-in tokenizer: one token per UTF-8 byte, id 256 = EOS."""

    eos_token_id = 256

    def __call__(self, texts: str | list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        if isinstance(texts, str):
            return {"input_ids": list(texts.encode())}
        return {"input_ids": [list(t.encode()) for t in texts]}

    def decode(self, ids: list[int]) -> str:
        # "ignore" drops a multi-byte character cut at a window edge, so the rest stays a substring of the source.
        return bytes(i for i in ids if i < 256).decode(errors="ignore")


def _ngrams(ids: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


# ---------------------------------------------------------------------------------------------------------------------
# Wikipedia slice and split (no model needed)
# ---------------------------------------------------------------------------------------------------------------------


def test_wiki_articles_are_clean_prose() -> None:
    articles = wiki_articles()
    assert 80 <= len(articles) <= 130
    assert len({a.title for a in articles}) == len(articles)
    for article in articles:
        assert not article.text.lower().startswith("#redirect")
        assert "{{" not in article.text and "[[" not in article.text and "'''" not in article.text
        assert len(article.text.split()) >= 150
    titles = {a.title for a in articles}
    assert "Albert Einstein" in titles and "AccessibleComputing" not in titles  # article kept, redirect dropped
    assert not any("(disambiguation)" in t for t in titles)


def test_wiki_split_is_disjoint_complete_and_deterministic() -> None:
    calibration, evaluation = wiki_split()
    cal_titles = {a.title for a in calibration}
    eval_titles = {a.title for a in evaluation}
    assert not cal_titles & eval_titles
    assert cal_titles | eval_titles == {a.title for a in wiki_articles()}
    assert sum(len(a.text) for a in evaluation) >= EVAL_TARGET_CHARS
    # Calibration keeps the bulk of the text.
    assert sum(len(a.text) for a in calibration) > 5 * sum(len(a.text) for a in evaluation)
    again = wiki_split()
    assert [a.title for a in again[0]] == [a.title for a in calibration]
    assert [a.title for a in again[1]] == [a.title for a in evaluation]


def test_wiki_articles_are_cached_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvrewrite.io.calibration_data import wiki

    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path))
    first = wiki_articles()
    files = list((tmp_path / "wiki").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert [a["title"] for a in data["articles"]] == [a.title for a in first]

    # A new process (empty in-memory cache) reads the JSON instead of parsing the dump again.
    wiki._load_articles.cache_clear()
    monkeypatch.setattr(wiki, "_parse_dump", lambda path: pytest.fail("dump parsed again despite the cache"))
    assert wiki_articles() == first


# ---------------------------------------------------------------------------------------------------------------------
# Token windows (model-free byte tokenizer)
# ---------------------------------------------------------------------------------------------------------------------


def test_wiki_calibration_windows_shape_and_determinism() -> None:
    tok = ByteTokenizer()
    a = calibration_token_sequences("wiki", tok, 1000, 128)
    assert a.shape == (8, 128) and a.dtype == torch.long
    assert torch.equal(a, calibration_token_sequences("wiki", tok, 1000, 128))
    assert torch.equal(a, calibration_token_sequences("wiki", tok, 1000, 128, seed=0))
    assert not torch.equal(a, calibration_token_sequences("wiki", tok, 1000, 128, seed=1))


def test_evaluation_windows_never_come_from_calibration_articles() -> None:
    tok = ByteTokenizer()
    calibration, evaluation = wiki_split()
    cal_text = "\n".join(a.text for a in calibration)
    eval_text = "".join(a.text for a in evaluation)  # the EOS between articles decodes to nothing
    windows = evaluation_token_sequences(tok, 20_000, 256)
    assert windows.shape == (79, 256)
    assert torch.equal(windows, evaluation_token_sequences(tok, 20_000, 256))
    for row in windows[::8].tolist():
        chunk = tok.decode(row[64:160])  # 96 bytes from the middle of the window
        assert chunk in eval_text
        assert chunk not in cal_text


def test_user_text_file_source(tmp_path: Path) -> None:
    text = " ".join(f"sentence number {i} of the user's own calibration text." for i in range(200))
    path = tmp_path / "notes.txt"
    path.write_text(text, encoding="utf-8")
    tok = ByteTokenizer()
    windows = calibration_token_sequences(str(path), tok, 2000, 100)
    assert windows.shape == (20, 100)
    for row in windows.tolist():
        assert tok.decode(row) in text
    assert torch.equal(windows, calibration_token_sequences(str(path), tok, 2000, 100))


def test_user_text_directory_joins_documents_with_eos(tmp_path: Path) -> None:
    a, b = " ".join(["alpha"] * 50), " ".join(["beta"] * 50)
    (tmp_path / "a.txt").write_text(a)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text(b)
    (tmp_path / "ignored.md").write_text("gamma " * 500)
    tok = ByteTokenizer()
    total = len(a) + len(b) + 1  # two documents and one EOS between them
    windows = calibration_token_sequences(str(tmp_path), tok, total, total)
    stream = windows[0].tolist()
    assert stream.count(ByteTokenizer.eos_token_id) == 1
    assert "gamma" not in tok.decode(stream)


def test_too_few_tokens_error_gives_the_counts(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("x" * 1234)
    with pytest.raises(CalibrationError) as info:
        calibration_token_sequences(str(path), ByteTokenizer(), 5000, 512)
    message = str(info.value)
    assert "1234" in message and "5000" in message
    assert "1024" in message  # the largest request that would fit (2 windows of 512)


def test_evaluation_too_many_tokens_error() -> None:
    with pytest.raises(CalibrationError, match="held-out evaluation text"):
        evaluation_token_sequences(ByteTokenizer(), 50_000_000, 512)


def test_unknown_source_lists_valid_sources() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        calibration_token_sequences("c4", ByteTokenizer(), 100, 10)
    message = str(info.value)
    assert "'c4'" in message and "wiki" in message and "synthetic" in message and ".txt" in message


def test_synthetic_without_model_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="model"):
        calibration_token_sequences("synthetic", ByteTokenizer(), 100, 10)


@pytest.mark.parametrize("n_tokens, seq_len", [(0, 10), (100, 0), (-5, 10), (100, 2.5)])
def test_bad_sizes_are_rejected(n_tokens: Any, seq_len: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        calibration_token_sequences("wiki", ByteTokenizer(), n_tokens, seq_len)


def test_non_utf8_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("café ".encode("latin-1") * 100)
    with pytest.raises(CalibrationError, match="UTF-8"):
        calibration_token_sequences(str(path), ByteTokenizer(), 10, 5)


def test_seed_prompts_are_diverse_and_unique() -> None:
    prompts = seed_prompts()
    assert 48 <= len(prompts) <= 64
    assert len(set(prompts)) == len(prompts)


# ---------------------------------------------------------------------------------------------------------------------
# Real SmolLM2 tokenizer (bundled model, converted once and cached)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from kvrewrite.io.sources import bundled_smollm2_path

    return AutoTokenizer.from_pretrained(bundled_smollm2_path())


@pytest.mark.real_model
def test_default_calibration_and_evaluation_sizes_fit(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    cal = calibration_token_sequences("wiki", tok, 32_768, 512)
    assert cal.shape == (64, 512)
    assert torch.equal(cal, calibration_token_sequences("wiki", tok, 32_768, 512))
    ev = evaluation_token_sequences(tok, 40_960, 512)
    assert ev.shape == (80, 512)
    assert int(cal.max()) < len(tok) and int(ev.max()) < len(tok)


@pytest.mark.real_model
def test_evaluation_ngrams_do_not_occur_in_calibration_stream(smollm2_tokenizer: Any) -> None:
    from kvrewrite.io.calibration_data.corpus import token_stream

    tok = smollm2_tokenizer
    calibration, _ = wiki_split()
    cal_ngrams = _ngrams(token_stream(tok, [a.text for a in calibration]), 24)
    windows = evaluation_token_sequences(tok, 40_960, 512).tolist()
    probes = [tuple(row[start : start + 24]) for row in windows[::4] for start in (0, 200, 400)]
    assert len(probes) == 60
    assert not [p for p in probes if p in cal_ngrams]


@pytest.fixture
def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.real_model
def test_synthetic_texts_count_determinism_and_cache(
    smollm2_tokenizer: Any, tiny_llama: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tok = smollm2_tokenizer
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path / "first"))
    texts = synthetic_texts(tiny_llama, tok, 300, seed=3)
    counts = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert sum(counts) >= 300
    assert sum(counts) - counts[-1] < 300, "generation must stop once the target is reached"
    assert all(t.strip() for t in texts)
    assert len(list((tmp_path / "first" / "calibration").glob("synthetic-*.json"))) == 1

    # Same seed in an empty cache: the same texts are generated again.
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path / "second"))
    assert synthetic_texts(tiny_llama, tok, 300, seed=3) == texts

    # Cached: a second call must not generate at all.
    def no_generate(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the decoder ran although the texts are cached")

    monkeypatch.setattr("kvrewrite.io.calibration_data.synthetic.decode_batch", no_generate)
    assert synthetic_texts(tiny_llama, tok, 300, seed=3) == texts
    # A different seed is a different cache entry, so it would have to generate.
    with pytest.raises(AssertionError, match="cached"):
        synthetic_texts(tiny_llama, tok, 300, seed=4)


@pytest.mark.real_model
def test_synthetic_calibration_windows(
    smollm2_tokenizer: Any, tiny_llama: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path))
    state = torch.random.get_rng_state()
    windows = calibration_token_sequences("synthetic", smollm2_tokenizer, 200, 64, model=tiny_llama, seed=1)
    assert windows.shape == (4, 64)
    assert torch.equal(torch.random.get_rng_state(), state), "generation must not disturb the global RNG"
    again = calibration_token_sequences("synthetic", smollm2_tokenizer, 200, 64, model=tiny_llama, seed=1)
    assert torch.equal(windows, again)
