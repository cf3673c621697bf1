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
NUMBER = re.compile(
    r"(?<![\w.])(?<![A-Za-z][-−])(?P<sign>[+\-−]?)(?P<num>\d{1,3}(?:,\d{3})+|\d+)(?P<dec>\.\d+)?"
    r"(?:e(?P<exp>[+\-−]?\d+))?(?P<unit>%|x\b)?(?![\w.]*\w)"
)


# A number inside a JSON key: a setting named by the key ("bytes_4096", "rate 0.30"), not part of a word ("fp16").
KEY_NUMBER = re.compile(r"(?<![A-Za-z.\d])\d+(?:\.\d+)?(?![\d.]*\d)")


@dataclass(frozen=True)
class Claim:
    doc: str
    line: int
    text: str  # as written
    value: float
    decimals: int
    percent: bool


# Ratios a record implies and the docs print: (numerator, denominator, offset). The perplexity increase is printed
# as Δppl; the cache bytes as a share of the original's and of a float16 cache (`kvrewrite eval`'s two columns).
DERIVED = (
    ("perplexity", "baseline_perplexity", -1.0),
    ("kv_bytes_per_token", "baseline_kv_bytes_per_token", 0.0),
    ("kv_bytes_per_token", "fp16_kv_bytes_per_token", 0.0),
)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_leaves(data) -> list[float]:
    """Every number in a JSON document (bools excluded), at any depth, including the numbers written inside its
    strings (settings such as "0.5" or "--tokens 4096" in a command) and keys ("bytes_4096"), plus each record's
    derived ratios, each byte figure in MiB and GiB and, when the document states `fp16_kv_bytes_per_token`, as a
    share of it."""
    out: list[float] = []
    # A document that states the float16 cache's size prints its byte figures as shares of it too.
    fp16 = data.get("fp16_kv_bytes_per_token") if isinstance(data, dict) else None
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            for key, value in item.items():
                out += [float(n) for n in KEY_NUMBER.findall(str(key))]  # "kv_bytes_per_token_512", "0.30"
                # A bytes field, or a dict of them ("sent_bytes": {"qkv": ...}): sizes printed in MiB or GiB.
                sizes = [value] if _number(value) else list(value.values()) if isinstance(value, dict) else []
                for size in (v for v in sizes if _number(v)) if "bytes" in str(key) else ():
                    out += [float(size) / 2**20, float(size) / 2**30]
                    if _number(fp16) and fp16 > 0 and size is value:
                        out.append(float(size) / fp16)
            for top, bottom, offset in DERIVED:
                a, b = item.get(top), item.get(bottom)
                if _number(a) and _number(b) and b > 0:
                    out.append(float(a) / float(b) + offset)
        elif isinstance(item, list):
            stack.extend(item)
        elif _number(item):
            out.append(float(item))
        elif isinstance(item, str):
            out += [claim.value for claim in claims_in("", item, 1)]
    return out


def claims_in(doc: str, body: str, first_line: int) -> list[Claim]:
    """Every number written in `body` (outside code, link targets and comments), with its line and precision."""
    found = []
    for offset, raw_line in enumerate(body.splitlines()):
        prose = NOT_PROSE.sub(lambda m: " " * len(m.group()), raw_line)
        for m in NUMBER.finditer(prose):
            digits = m.group("num").replace(",", "") + (m.group("dec") or "")
            exponent = int(m.group("exp").replace("−", "-")) if m.group("exp") else 0
            value = float(digits) * 10.0**exponent * (-1 if m.group("sign") in ("-", "−") else 1)
            decimals = len(m.group("dec") or "") - (1 if m.group("dec") else 0) - exponent
            found.append(Claim(doc, first_line + offset, m.group().strip(), value, decimals, m.group("unit") == "%"))
    return found


def matches(claim: Claim, leaves: list[float]) -> bool:
    half_step = 0.5 * 10**-claim.decimals + 1e-9
    candidates = leaves + [100 * v for v in leaves] if claim.percent else leaves  # a share printed as a percentage
    return any(abs(v - claim.value) <= half_step for v in candidates)
