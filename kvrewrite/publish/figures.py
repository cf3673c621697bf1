"""Figures in published text, matched against the result document they come from.

Used by tools/doc_numbers.py (README and docs/, against benchmarks/results/) and by the model card check
(a generated card against the eval_results.json it was made from). A number as written matches a value of the
document when it is that value at the number's own precision, or that value x 100 when it is a share printed as a
percentage. Prose may round; it may not invent. Pure text and arithmetic: no torch, nothing from the runtime.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# What is not prose: inline code, link targets, images, HTML comments.
NOT_PROSE = re.compile(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->", re.S)
# A number: optional sign, digits with thousands commas, optional decimals and exponent; not glued to a word
# ("p0.5", "2K", "x8", the 1 of "top-1" stay out), but "12.3%", "2.8x" and "1.9e-05" are numbers.
NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z][-−])(?P<sign>[+\-−]?)(?P<num>\d{1,3}(?:,\d{3})+|\d+)(?P<dec>\.\d+)?"
                    r"(?:e(?P<exp>[+\-−]?\d+))?(?P<unit>%|x\b)?(?![\w.]*\w)")


@dataclass(frozen=True)
class Claim:
    doc: str
    line: int
    text: str  # as written
    value: float
    decimals: int
    percent: bool


def numeric_leaves(data) -> list[float]:
    """Every number in a JSON document (bools excluded), at any depth, plus each record's perplexity increase."""
    out: list[float] = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            ppl, base = item.get("perplexity"), item.get("baseline_perplexity")
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ppl, base)) and base > 0:
                out.append(float(ppl) / float(base) - 1.0)  # the increase printed as Δppl
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            out.append(float(item))
    return out


def claims_in(doc: str, body: str, first_line: int) -> list[Claim]:
    """Every number written in `body` (outside code, link targets and comments), with its line and precision."""
    found = []
    for offset, raw_line in enumerate(body.splitlines()):
        prose = NOT_PROSE.sub(lambda m: " " * len(m.group()), raw_line)
        for m in NUMBER.finditer(prose):
            digits = m.group("num").replace(",", "") + (m.group("dec") or "")
            exponent = int(m.group("exp").replace("−", "-")) if m.group("exp") else 0
            value = float(digits) * 10.0 ** exponent * (-1 if m.group("sign") in ("-", "−") else 1)
            decimals = len(m.group("dec") or "") - (1 if m.group("dec") else 0) - exponent
            found.append(Claim(doc, first_line + offset, m.group().strip(), value, decimals, m.group("unit") == "%"))
    return found


def matches(claim: Claim, leaves: list[float]) -> bool:
    half_step = 0.5 * 10 ** -claim.decimals + 1e-9
    candidates = leaves + [100 * v for v in leaves] if claim.percent else leaves  # a share printed as a percentage
    return any(abs(v - claim.value) <= half_step for v in candidates)
