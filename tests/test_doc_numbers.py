"""Numbers in README.md and docs/ that cite a result file are in that file (tools/doc_numbers.py)."""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import doc_numbers  # noqa: E402


def all_passages():
    return [p for doc in doc_numbers.documents() for p in doc_numbers.passages(doc)]


def test_every_cited_number_is_in_its_result_file():
    found = all_passages()
    assert sum(len(p.claims) for p in found) > 100  # the marked passages were read at all
    problems = [problem for passage in found for problem in doc_numbers.unsourced(passage)]
    assert problems == []


def test_every_results_page_cites_its_result_files():
    """The measured tables live in docs/results/: each page there (but the hub) holds passages the check reads."""
    pages = sorted((doc_numbers.ROOT / "docs" / "results").glob("*.md"))
    assert len(pages) >= 7
    for page in pages:
        if page.name != "index.md":
            assert sum(len(p.claims) for p in doc_numbers.passages(page)) > 10, page


def _copy_with(tmp_path: Path, doc: str, old: str, new: str) -> Path:
    """The repo's doc and results under tmp_path, with one edit in the doc."""
    (tmp_path / doc).parent.mkdir(parents=True)
    shutil.copytree(doc_numbers.ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    text = (doc_numbers.ROOT / doc).read_text(encoding="utf-8")
    assert text.count(old) == 1
    (tmp_path / doc).write_text(text.replace(old, new), encoding="utf-8")
    return tmp_path / doc


def test_a_number_edited_by_hand_fails(tmp_path):
    # One figure of the frontier table changed to a plausible value that no field of that row holds.
    row = "| `kvrewrite-W16-evict0.26-k8v4` | kvrewrite | 12.3% | +3.2% |"
    edited = _copy_with(tmp_path, "docs/results/frontier.md", row, row.replace("+3.2%", "+3.9%"))
    problems = [
        p for passage in doc_numbers.passages_at(edited, tmp_path) for p in doc_numbers.unsourced(passage, tmp_path)
    ]
    assert len(problems) == 1 and "+3.9%" in problems[0] and "docs/results/frontier.md" in problems[0]


def test_a_row_naming_no_record_and_a_missing_file_fail(tmp_path):
    row = "| `kvrewrite-W16-evict0.26-k8v4` | kvrewrite | 12.3% | +3.2% |"
    edited = _copy_with(tmp_path, "docs/results/frontier.md", row, row.replace("0.26", "0.27"))
    problems = [
        p for passage in doc_numbers.passages_at(edited, tmp_path) for p in doc_numbers.unsourced(passage, tmp_path)
    ]
    assert any("names no record" in p for p in problems)
    (tmp_path / "benchmarks" / "results" / "frontier.json").unlink()
    problems = [
        p for passage in doc_numbers.passages_at(edited, tmp_path) for p in doc_numbers.unsourced(passage, tmp_path)
    ]
    assert problems and all("does not exist" in p for p in problems)


def test_numbers_are_read_as_written():
    claims = doc_numbers.claims_in("d", "a `p0.5` cut, 46,080 bytes (+8.9%), 2.8x faster at 2K, −0.5% and [x](a1.2)", 1)
    assert [(c.text, c.value, c.decimals, c.percent) for c in claims] == [
        ("46,080", 46080.0, 0, False),
        ("+8.9%", 8.9, 1, True),
        ("2.8x", 2.8, 1, False),
        ("−0.5%", -0.5, 1, True),
    ]


def test_a_records_perplexity_increase_is_one_of_its_values():
    """Result files keep perplexity and the baseline's; the docs print the increase, which the checker derives."""
    leaves = doc_numbers.numeric_leaves({"rows": [{"perplexity": 33.29, "baseline_perplexity": 24.52}]})
    increase = doc_numbers.Claim("d", 1, "+35.8%", 35.8, 1, True)
    assert doc_numbers.matches(increase, leaves)
    assert not doc_numbers.matches(doc_numbers.Claim("d", 1, "+35.6%", 35.6, 1, True), leaves)
    # Only a record holding both parts yields an increase.
    assert not doc_numbers.matches(increase, doc_numbers.numeric_leaves({"perplexity": 33.29, "baseline": 24.52}))


def test_no_page_has_an_unmarked_measured_figure():
    """Every measured-looking figure of README.md and docs/ sits in a passage that cites its result file (or in a
    rendered table, or a passage marked not-measured): `python tools/doc_numbers.py --unmarked` lists any other."""
    assert doc_numbers.unmarked() == []


def test_measured_looking_figures_are_found_outside_marked_passages(tmp_path):
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    doc.write_text(
        "It loses +35.7% and decodes at 1.39x stock's speed, ppl 24.52, in 3,607 MiB and 12.5 s; `--tokens 4096 2.5x`.\n"
        "<!-- numbers: benchmarks/results/x.json -->\nmarked +8.9% and 0.24x\n<!-- /numbers -->\n"
        "A target of <!-- not-measured -->+25%<!-- /not-measured --> and a rate of 50% with 2x the work.\n",
        encoding="utf-8",
    )
    (tmp_path / "README.md").write_text("", encoding="utf-8")
    found = [line.split("'")[1] for line in doc_numbers.unmarked(tmp_path)]
    assert found == ["+35.7%", "1.39x", "ppl 24.52", "3,607 MiB", "12.5 s"]


def test_a_result_files_settings_and_sizes_are_its_values():
    """Numbers written in a file's strings and keys are its values; a bytes field is also its MiB, GiB and share of
    the document's float16 size; a record's cache bytes also give its share of the baseline's."""
    data = {
        "command": "eval --tokens 4096 --rate 0.5",
        "fp16_kv_bytes_per_token": 23040,
        "rows": {
            "0.30": {
                "bytes_2048": 5251.27,
                "kv_bytes_per_token": 32256.0,
                "baseline_kv_bytes_per_token": 46080.0,
                "peak_bytes": 3019898880,
            }
        },
    }
    leaves = doc_numbers.numeric_leaves(data)
    claim = lambda text, value, decimals, percent=False: doc_numbers.Claim("d", 1, text, value, decimals, percent)  # noqa: E731
    for c in (
        claim("4096", 4096, 0),
        claim("0.5", 0.5, 1),
        claim("0.30", 0.30, 2),
        claim("2048", 2048, 0),
        claim("22.8%", 22.8, 1, True),
        claim("0.700", 0.7, 3),
        claim("2880", 2880, 0),
        claim("2.81", 2.81, 2),
    ):
        assert doc_numbers.matches(c, leaves), c.text
    assert not doc_numbers.matches(claim("0.701", 0.701, 3), leaves)
    assert not doc_numbers.matches(claim("4097", 4097, 0), leaves)


def test_every_result_file_records_command_commit_machine_and_date():
    """In the file itself, or (older files) in benchmarks/results/provenance.json (tools/results_provenance.py)."""
    import json

    import results_provenance

    sidecar = json.loads(results_provenance.SIDECAR.read_text(encoding="utf-8"))["files"]
    for path in results_provenance.result_files():
        missing = results_provenance.missing_fields(path)
        assert all(field in sidecar.get(path.name, {}) for field in missing), (path.name, missing)
