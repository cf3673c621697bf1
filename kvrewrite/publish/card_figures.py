"""The measured figures of a generated model card, checked against the files the card was generated from.

A card's measured sections (its "## Measured quality" section and the compile wall time / peak RSS row) print
values of eval_results.json (written by `kvrewrite eval`) and compress_report.json (written by the compiler).
Every number there must be a value of those two documents at its printed precision (kvrewrite.publish.figures),
or one of the two ratios the card derives from an evaluation row and the baseline row: the perplexity increase
and the KV bytes against the original's. Strings of the documents (the command, the version, the date) are text,
not figures.
"""

from __future__ import annotations

import re

from kvrewrite.publish.figures import claims_in, matches, numeric_leaves

MEASURED_SECTION = re.compile(r"^## Measured quality\n(?P<body>.*?)(?=^## |\Z)", re.S | re.M)
COMPILE_COST_ROW = re.compile(r"^\| compile wall time / peak RSS[^|]*\|(?P<cells>.*)$", re.M)


def measured_text(card_text: str) -> str:
    """The parts of a card that print measurements (the table header's labels, such as "top-1", left out)."""
    section = MEASURED_SECTION.search(card_text)
    body = section.group("body") if section else ""
    body = "\n".join(line for line in body.splitlines() if not line.startswith("| model |"))
    rows = [m.group("cells") for m in COMPILE_COST_ROW.finditer(card_text)]
    return "\n".join([body, *rows])


def _strings(data) -> list[str]:
    stack, out = [data], []
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            out.append(item)
    return out


def card_leaves(evaluation: dict | None, report: dict | None) -> list[float]:
    """Every value the card may print: the two documents' numbers and each row's ratios to the baseline row."""
    leaves = numeric_leaves(evaluation or {}) + numeric_leaves(report or {})
    rows = (evaluation or {}).get("rows", [])
    base = next((r for r in rows if r.get("baseline")), None)
    if base:
        for r in rows:
            leaves += [r["perplexity"] / base["perplexity"] - 1, r["kv_bytes_per_token"] / base["kv_bytes_per_token"]]
    return leaves


def unsourced_card_figures(card_text: str, evaluation: dict | None, report: dict | None) -> list[str]:
    """The numbers of the card's measured sections that neither document holds (empty: every figure is sourced)."""
    text = measured_text(card_text)
    for string in sorted(_strings([evaluation, report]), key=len, reverse=True):
        if len(string) > 3:
            text = text.replace(string, " " * len(string))
    leaves = card_leaves(evaluation, report)
    return [
        f"card line {c.line}: {c.text} is in neither eval_results.json nor compress_report.json"
        for c in claims_in("card", text, 1)
        if not matches(c, leaves)
    ]
