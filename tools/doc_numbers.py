"""Numbers in the docs, checked against the committed result files they cite.

A doc marks a passage whose figures come from results with an HTML comment naming the file(s):

    <!-- numbers: benchmarks/results/frontier.json -->
    | ... a table or paragraph ... |
    <!-- /numbers -->

Every number written in such a passage (outside `code`, links and comments) must be some value of the cited
file(s) as printed: the same value at the number's own precision, or that value x 100 when it is a share
printed as a percentage. Prose may round; it may not invent. The file's values are its numbers, the numbers written
in its strings and keys (settings such as "0.5", "--tokens 4096", "bytes_4096"), and a few values a record implies
and the docs print (kvrewrite/publish/figures.py, shared with the model card check): a record's perplexity increase
(perplexity / baseline_perplexity - 1), its cache bytes as a share of the baseline's or of a float16 cache, and a
bytes field in MiB and GiB. The marker may sit inside a line (`<!-- numbers: F -->24.52<!-- /numbers -->`).

A table whose rows are records of a list in the file names that list and the field that names a record:

    <!-- numbers: benchmarks/results/frontier.json rows=results.name -->

Then the numbers of a row must come from the record its first cell names (its first `code` span, or the cell's
text), not from anywhere in the file, so an edited figure cannot hide among the file's other values. `python tools/doc_numbers.py` lists every passage
and any number without a source; tests/test_doc_numbers.py runs the same check.

Tables rendered by tools/docs_tables.py (`<!-- table: FILE template=NAME -->` ... `<!-- /table -->`) are passages
too: their numbers are checked against their file the same way.

Outside marked passages, a figure that looks measured (a signed or decimal percentage, a decimal speed ratio such
as 1.39x, a size in MiB/GiB, a time in s/min, a rate in tokens/s, a perplexity or KL value) is reported by
`python tools/doc_numbers.py --unmarked`, and the test fails on it: either the passage cites its result file, or
it is wrapped in `<!-- not-measured -->` ... `<!-- /not-measured -->` when its figures are settings, formulas or
examples rather than measurements.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvrewrite, not an installed one
from kvrewrite.publish.figures import NOT_PROSE, NUMBER, Claim, claims_in, matches, numeric_leaves  # noqa: E402,F401

BLOCK = re.compile(
    r"<!-- numbers: (?P<files>[^ >]+(?:, *[^ >]+)*)(?: rows=(?P<rows>[\w.]+))? -->\n?(?P<body>.*?)"
    r"<!-- /numbers -->",
    re.S,
)
TABLE_BLOCK = re.compile(
    r"<!-- table: (?P<files>[^ >]+(?:, *[^ >]+)*) template=(?P<template>[\w-]+)"
    r"(?: rows=(?P<rows>[\w.]+))? -->\n(?P<body>.*?)<!-- /table -->",
    re.S,
)
NOT_MEASURED = re.compile(r"<!-- not-measured -->.*?<!-- /not-measured -->", re.S)
# Figures that look measured: signed or decimal percentages, decimal speed ratios, sizes, times, rates, and the
# value after "ppl"/"perplexity"/"KL". Integers such as "50%" or "2x" are mostly settings and stay out.
MEASURED = re.compile(
    r"(?<![\w.])(?:[+\-−±]\d[\d,]*(?:\.\d+)?%|\d[\d,]*\.\d+%|\d+\.\d+x\b"
    r"|\d[\d,]*(?:\.\d+)? ?(?:MiB|GiB|KiB|MB|GB|ms|s|min|tokens/s|tok/s|B/token|bytes/token)\b"
    r"|(?:ppl|perplexity|KL)(?: of| is| =|:)? +\d+\.\d+)"
)
FIRST_CELL = re.compile(r"^\|\s*(?:`(?P<code>[^`]+)`|(?P<text>[^|]*?))\s*\|")


@dataclass(frozen=True)
class Passage:
    doc: str
    line: int
    sources: tuple[str, ...]
    claims: tuple[Claim, ...]
    rows: str | None = None  # "list.field": each table row's numbers come from the record its first cell names
    row_names: tuple[tuple[int, str], ...] = ()  # (line, first cell) of every table row
    template: str | None = None  # a rendered table's renderer (tools/docs_tables.py)


def passages(doc_path: Path) -> list[Passage]:
    return passages_at(doc_path, ROOT)


def passages_at(doc_path: Path, root: Path) -> list[Passage]:
    """The marked passages of a doc under `root` (the repo, or a copy of it): numbers blocks and rendered tables."""
    text = doc_path.read_text(encoding="utf-8")
    doc = str(doc_path.relative_to(root))
    out = []
    blocks = sorted([*BLOCK.finditer(text), *TABLE_BLOCK.finditer(text)], key=lambda m: m.start())
    for m in blocks:
        first_line = text.count("\n", 0, m.start("body")) + 1
        sources = tuple(s.strip() for s in m.group("files").split(","))
        row_names = tuple(
            (first_line + i, (cell.group("code") or cell.group("text")).strip())
            for i, line in enumerate(m.group("body").splitlines())
            if (cell := FIRST_CELL.match(line)) and not set(line) <= set("|-: ")
        )
        template = m.groupdict().get("template")
        out.append(
            Passage(
                doc,
                first_line,
                sources,
                tuple(claims_in(doc, m.group("body"), first_line)),
                m.group("rows"),
                row_names,
                template,
            )
        )
    return out


def row_leaves(data, rows: str, row_names: tuple[tuple[int, str], ...]) -> dict[int, list[float] | None]:
    """line -> the numbers of the record that row names (None: no such record; header rows map to the names)."""
    list_key, field = rows.rsplit(".", 1)
    records = data
    for key in list_key.split("."):
        records = records[key]
    by_name = {str(record.get(field)): record for record in records if isinstance(record, dict)}
    return {line: numeric_leaves(by_name[name]) if name in by_name else None for line, name in row_names}


def unsourced(passage: Passage, root: Path = ROOT) -> list[str]:
    """Problems of one passage: a cited file that is missing, a row naming no record, and every number that is
    not in its source (the row's record, or else any cited file)."""
    leaves: list[float] = []
    problems = []
    documents_read = []
    for source in passage.sources:
        path = root / source
        if not path.is_file():
            problems.append(f"{passage.doc}:{passage.line}: cites {source}, which does not exist")
            continue
        documents_read.append(json.loads(path.read_text(encoding="utf-8")))
        leaves += numeric_leaves(documents_read[-1])
    if problems:
        return problems
    if passage.template:  # a rendered table may also print what its renderer computed from the files
        from docs_tables import render_block

        leaves += render_block(", ".join(passage.sources), passage.template, root).derived
    per_row = row_leaves(documents_read[0], passage.rows, passage.row_names) if passage.rows else {}
    header = passage.row_names[0][0] if passage.row_names else None
    for line, found in per_row.items():
        if found is None and line != header:
            problems.append(f"{passage.doc}:{line}: the row names no record of {passage.sources[0]} ({passage.rows})")
    for claim in passage.claims:
        source = per_row.get(claim.line) or leaves
        if not matches(claim, source):
            where = "its row's record" if claim.line in per_row else ", ".join(passage.sources)
            problems.append(f"{claim.doc}:{claim.line}: {claim.text} is in none of {where}")
    return problems


def unmarked_at(doc_path: Path, root: Path) -> list[str]:
    """Measured-looking figures of a doc outside every marked, rendered or not-measured passage."""
    text = doc_path.read_text(encoding="utf-8")
    doc = str(doc_path.relative_to(root))
    for block in (BLOCK, TABLE_BLOCK, NOT_MEASURED):  # blank covered spans, keeping line numbers
        text = block.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    # Comments, link targets and inline code (a command's settings) are not prose; fenced transcripts are.
    text = re.sub(r"<!--.*?-->|\]\([^)]*\)|`[^`\n]*`", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    return [
        f"{doc}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()!r} is not in a marked passage"
        for m in MEASURED.finditer(text)
    ]


def unmarked(root: Path = ROOT) -> list[str]:
    return [problem for doc in documents(root) for problem in unmarked_at(doc, root)]


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    if "--unmarked" in (sys.argv[1:] if argv is None else argv):
        found = unmarked()
        print("\n".join(found) if found else "no measured-looking figure outside a marked passage")
        return 1 if found else 0
    problems, count = [], 0
    for doc in documents():
        for passage in passages(doc):
            count += len(passage.claims)
            print(f"{passage.doc}:{passage.line}: {len(passage.claims)} numbers from {', '.join(passage.sources)}")
            problems += unsourced(passage)
    print("\n".join(problems) if problems else f"all {count} numbers found in their result files")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
