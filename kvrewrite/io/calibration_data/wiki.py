"""English Wikipedia text from the small dump slice that ships inside the gensim wheel.

gensim's test data holds ``enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``, about 200 pages
(roughly 100 real articles after redirects and stubs are dropped). It gives kvrewrite real encyclopedic prose for
calibration and a held-out evaluation set without any download. Parsing and cleaning take a few seconds, so the
cleaned articles are cached as JSON under ``cache_dir()/wiki/``.
"""

from __future__ import annotations

import bz2
import functools
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvrewrite.errors import CalibrationError
from kvrewrite.io.atomic_files import atomic_write_text
from kvrewrite.io.sources import cache_dir

__all__ = ["WikiArticle", "wiki_articles", "wiki_dump_path", "wiki_split", "EVAL_TARGET_CHARS"]

_DUMP_RELPATH = ("test", "test_data", "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
# Bump when the cleaning below changes, so stale caches are not reused.
_CLEAN_VERSION = 1
# Articles shorter than this after cleaning are stubs or lists, not useful prose.
_MIN_WORDS = 150
# Evaluation articles are taken (in hash order) until they hold this many characters: ~4.3 characters per SmolLM2
# token for this text, so about 55K tokens, comfortably above the 40K-token evaluation target. The rest (~90% of the
# text) is calibration. Counting characters keeps the split independent of any tokenizer.
EVAL_TARGET_CHARS = 240_000
_SPLIT_SALT = "kvrewrite-wiki-split-v1"

# Back-matter sections: citations and link lists, not prose.
_DROP_SECTIONS = {
    "see also", "references", "notes", "footnotes", "external links", "further reading", "bibliography",
    "sources", "citations", "notes and references", "references and notes", "secondary references",
    "primary references", "works cited", "general references", "specific references", "cited sources",
    "other reading", "online", "links",
}  # fmt: skip
_HEADING_RE = re.compile(r"^(={2,6})\s*(.*?)\s*\1\s*$")
_LIST_MARK_RE = re.compile(r"^[*#:;]+\s*")
_IMAGE_PREFIX_RE = re.compile(r"^(?:(?:File|Image):)?[^|]{0,200}\.(?:jpe?g|png|gif|svg|tiff?)\s*\|", re.IGNORECASE)
_SENTENCE_END = (".", "!", "?", ":", '"', "”", "’", ")", "'")


@dataclass(frozen=True)
class WikiArticle:
    """One cleaned Wikipedia article."""

    title: str
    text: str


def wiki_dump_path() -> Path:
    """Path of the Wikipedia dump slice inside the installed gensim package."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise CalibrationError(
            "The 'wiki' calibration source needs the gensim package (it ships the Wikipedia slice). "
            "Install it with `pip install 'kvrewrite[compile]'` (or `pip install gensim`), or use "
            "`calibration=synthetic` or a text file."
        )
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*_DUMP_RELPATH)
    if not path.is_file():
        raise CalibrationError(
            f"gensim is installed but its Wikipedia test slice is missing ({path}). Reinstall gensim from the "
            "official wheel (`pip install --force-reinstall gensim`), or use another calibration source."
        )
    return path


def _clean_inline(line: str) -> str:
    # Image syntax that filter_wiki leaves in galleries and captions: "File:x.jpg|caption", "caption|alt=...",
    # "Name|299x299pxText".
    line = _IMAGE_PREFIX_RE.sub("", line)
    line = re.sub(r"\|\s*alt=.*$", "", line)
    line = re.sub(r"^[^|]{0,200}\|\s*\d*x?\d+px", "", line)
    line = line.replace("'''", "").replace("''", "")
    # filter_wiki removes templates such as {{IPA|...}} and {{convert|...}} but leaves their punctuation behind.
    line = re.sub(r"\(\s*[;,]\s*", "(", line)
    line = re.sub(r"\s*[;,]\s*\)", ")", line)
    line = re.sub(r"\(\s*\)", "", line)
    line = re.sub(r"[ \t\u00a0]{2,}", " ", line)
    line = re.sub(r"\s+([,.;:!?])", r"\1", line)
    line = re.sub(r"([,;])\1+", r"\1", line)
    return line.strip()


def _keep_line(line: str, is_list_item: bool) -> bool:
    words = len(line.split())
    if is_list_item:
        return words >= 4
    # Table cells, captions and formula leftovers are short and lack sentence punctuation; prose has both.
    return (words >= 4 and line.endswith(_SENTENCE_END)) or words >= 25


def clean_wiki_text(filtered: str) -> str:
    """Turn the output of gensim's ``filter_wiki`` into readable prose paragraphs separated by blank lines.

    Headings become their own paragraph (dropped when their section is empty), back-matter sections (references,
    external links, ...) are dropped, and table cells, captions and empty list items are removed.
    """
    paragraphs: list[str] = []
    pending_heading: str | None = None
    skip_level: int | None = None  # inside a dropped section of this heading level
    for raw in filtered.splitlines():
        raw = raw.strip()
        if not raw:
            continue
        heading = _HEADING_RE.match(raw)
        if heading:
            level = len(heading.group(1))
            title = _clean_inline(heading.group(2))
            if skip_level is not None and level > skip_level:
                continue  # sub-section of a dropped section
            skip_level = level if title.lower() in _DROP_SECTIONS else None
            pending_heading = None if skip_level is not None else title
            continue
        if skip_level is not None:
            continue
        is_list_item = bool(_LIST_MARK_RE.match(raw))
        line = _clean_inline(_LIST_MARK_RE.sub("", raw))
        if not line or not _keep_line(line, is_list_item):
            continue
        if pending_heading:
            paragraphs.append(pending_heading)
            pending_heading = None
        paragraphs.append(line)
    return "\n\n".join(paragraphs)


def _parse_dump(path: Path) -> list[WikiArticle]:
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    articles: list[WikiArticle] = []
    with bz2.open(path, "rb") as f:
        # Namespace 0 = normal articles; other namespaces come back with empty text.
        for title, raw, _page_id in extract_pages(f, filter_namespaces=("0",)):
            if not raw or raw.lstrip().lower().startswith("#redirect"):
                continue
            if "(disambiguation)" in title or re.search(r"\{\{\s*disambig", raw, re.IGNORECASE):
                continue  # disambiguation pages are bare lists of links
            text = clean_wiki_text(filter_wiki(raw))
            if len(text.split()) < _MIN_WORDS:
                continue
            articles.append(WikiArticle(title=title, text=text))
    return articles


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _load_articles(cache_root: str) -> tuple[WikiArticle, ...]:
    dump = wiki_dump_path()
    digest = _file_sha256(dump)
    cache_file = Path(cache_root) / "wiki" / f"enwiki-slice-{digest[:16]}-v{_CLEAN_VERSION}.json"
    if cache_file.is_file():
        try:
            data = json.loads(cache_file.read_text(encoding="utf-8"))
            if data.get("dump_sha256") == digest and data.get("clean_version") == _CLEAN_VERSION:
                return tuple(WikiArticle(title=a["title"], text=a["text"]) for a in data["articles"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or foreign cache file: rebuild it below
    articles = _parse_dump(dump)
    payload = {
        "dump": dump.name,
        "dump_sha256": digest,
        "clean_version": _CLEAN_VERSION,
        "articles": [{"title": a.title, "text": a.text} for a in articles],
    }
    atomic_write_text(cache_file, json.dumps(payload, ensure_ascii=False))
    return tuple(articles)


def wiki_articles() -> list[WikiArticle]:
    """All usable articles of the gensim Wikipedia slice, cleaned, in dump order (cached on disk after first use)."""
    return list(_load_articles(str(cache_dir())))


def _split_key(title: str) -> str:
    return hashlib.sha256(f"{_SPLIT_SALT}:{title}".encode()).hexdigest()


def wiki_split() -> tuple[list[WikiArticle], list[WikiArticle]]:
    """Deterministic ``(calibration, evaluation)`` split of :func:`wiki_articles`, disjoint by article.

    Articles are ordered by a salted SHA-256 of their title; evaluation takes articles from the front of that order
    until it holds :data:`EVAL_TARGET_CHARS` characters, calibration gets all the others. Both lists keep dump order.
    """
    articles = wiki_articles()
    eval_titles: set[str] = set()
    chars = 0
    for article in sorted(articles, key=lambda a: _split_key(a.title)):
        if chars >= EVAL_TARGET_CHARS:
            break
        eval_titles.add(article.title)
        chars += len(article.text)
    calibration = [a for a in articles if a.title not in eval_titles]
    evaluation = [a for a in articles if a.title in eval_titles]
    return calibration, evaluation
