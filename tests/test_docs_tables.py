"""The docs' rendered tables equal what tools/docs_tables.py draws from their result files (`make docs-tables`)."""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import doc_numbers  # noqa: E402
import docs_tables  # noqa: E402

MAIN_TABLES = {
    "README.md": {"readme-headline"},
    "docs/results/quality.md": {"demo", "allocation", "issue3", "key-modes"},
    "docs/results/codecs.md": {"codecs"},
    "docs/results/frontier.md": {"frontier"},
}


def test_the_main_tables_are_rendered_blocks():
    for doc, templates in MAIN_TABLES.items():
        text = (docs_tables.ROOT / doc).read_text(encoding="utf-8")
        assert {m.group("template") for m in doc_numbers.TABLE_BLOCK.finditer(text)} >= templates, doc


def test_committed_tables_equal_their_rendering():
    assert docs_tables.stale() == []


def test_a_table_edited_by_hand_is_stale_and_rendering_restores_it(tmp_path):
    shutil.copytree(docs_tables.ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    doc = "docs/results/quality.md"
    original = (docs_tables.ROOT / doc).read_text(encoding="utf-8")
    row = "| | 0.50 | 33.29 | +35.7% |"
    assert original.count(row) == 1
    (tmp_path / doc).write_text(original.replace(row, row.replace("+35.7%", "+35.6%")), encoding="utf-8")
    (tmp_path / "README.md").write_text("", encoding="utf-8")
    assert docs_tables.stale(tmp_path) == [tmp_path / doc]
    assert docs_tables.render_text((tmp_path / doc).read_text(encoding="utf-8"), tmp_path) == original


def test_a_changed_result_changes_the_table(tmp_path):
    """The body really comes from the file: a different perplexity renders a different row."""
    import json

    shutil.copytree(docs_tables.ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    path = tmp_path / "benchmarks" / "results" / "key_modes.json"
    data = json.loads(path.read_text())
    data["key-only"]["results"]["latent keys p=0.5 (values full)"]["perplexity"] = 27.0
    path.write_text(json.dumps(data))
    table = docs_tables.render_block("benchmarks/results/key_modes.json", "key-modes", tmp_path).text
    assert "| latent | rebuilds every cached key each step | 27.00 | +10.1% |" in table


def test_rendered_tables_pass_the_numbers_check():
    rendered = [p for doc in doc_numbers.documents() for p in doc_numbers.passages(doc) if p.template]
    assert len(rendered) >= 7
    assert [problem for p in rendered for problem in doc_numbers.unsourced(p)] == []


def test_every_template_is_registered_and_an_unknown_one_is_named():
    assert set().union(*MAIN_TABLES.values()) <= set(docs_tables.RENDERERS)
    try:
        docs_tables.render_block("benchmarks/results/key_modes.json", "no-such-table")
    except KeyError as exc:
        assert "no-such-table" in str(exc) and "key-modes" in str(exc)
    else:
        raise AssertionError("an unknown template rendered")
