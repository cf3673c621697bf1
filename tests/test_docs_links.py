"""The docs hold together: docs/index.md lists every page, and every relative link in README.md and docs/ reaches
a file that exists and, with an #anchor, a heading of that page (as GitHub names heading anchors)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p != DOCS / "index.md")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return "\n".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 0)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-', repeats -1, -2."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text(encoding="utf-8")).splitlines():
        if heading := re.match(r"#{1,6} (.+)", line):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(document: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(prose(document.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists():
            broken.append(f"{document.relative_to(root)}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{document.relative_to(root)}: {target} (no such heading)")
    return broken


def test_the_index_lists_every_page_once():
    """One bullet per page, its first link naming the page."""
    bullets = re.findall(r"^- \[[^]]*\]\(([^)\s]+)\)", (DOCS / "index.md").read_text(encoding="utf-8"), flags=re.M)
    assert sorted((DOCS / target).resolve() for target in bullets) == [p.resolve() for p in pages()]


def test_every_relative_link_reaches_its_file_and_heading():
    assert [b for doc in [ROOT / "README.md", DOCS / "index.md", *pages()] for b in broken_links(doc)] == []


def test_the_link_check_finds_a_broken_anchor_and_a_missing_file(tmp_path):
    """Guards the check itself: a wrong anchor and a missing file are both reported, a right anchor is not."""
    (tmp_path / "a.md").write_text("# Model sources (`kvrewrite.io.sources`)\n\n## Same\n\n## Same\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#model-sources-kvrewriteiosources) [ok](a.md#same-1) "
        "[bad](a.md#model-sources-kvrewritesources) [gone](c.md)\n"
    )
    assert broken_links(tmp_path / "b.md", tmp_path) == [
        "b.md: a.md#model-sources-kvrewritesources (no such heading)",
        "b.md: c.md (no such file)",
    ]


GUIDE_LINES = 300  # a guide says what a feature does and links to its measured tables, which live in results/


def test_every_guide_is_under_the_line_limit():
    guides = sorted(DOCS.glob("*.md"))  # docs/results/ holds the rendered tables, not guides
    assert guides, "no guides found"
    long = {p.name: n for p in guides if (n := len(p.read_text(encoding="utf-8").splitlines())) >= GUIDE_LINES}
    assert long == {}, f"guides of {GUIDE_LINES} lines or more: {long}"
