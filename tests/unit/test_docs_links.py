"""Every relative link in README.md and docs/*.md points at a file inside this repository.

Links to other sites (http, https, mailto) are not checked; a ``#fragment`` is dropped
before the check (a link that is only a fragment points into its own page). A link
may not leave the checkout either (``../shared/API.md`` exists on a developer's machine
but not in a clone of the repo).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# bench/results/history.md is linked from docs/benchmarks.md: check its links too.
PAGES += sorted((ROOT / "bench" / "results").glob("*.md"))

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target "title") and ![alt](target); the target may be wrapped in <...>
_INLINE = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text], one level of nested [] allowed
    r"\(\s*(?:<([^<>\n]+)>|([^)\s]+))(?:\s+[^)]*)?\)"  # (<target> "title") or (target)
)
# [label]: target  (reference definitions)
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
# <img src="..."> / <a href="..."> in raw HTML
_HTML = re.compile(r"""<(?:img|a)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.I)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def links(text: str) -> list[str]:
    """The link targets of a markdown text, code blocks and code spans left out."""
    text = _FENCE.sub("", text)
    text = _CODE_SPAN.sub("", text)
    found = [a or b for a, b in _INLINE.findall(text)]
    found += _REFERENCE.findall(text) + _HTML.findall(text)
    return [t for t in found if not _EXTERNAL.match(t)]


def test_the_link_finder_sees_what_it_should() -> None:
    text = (
        "See [a](docs/a.md#x), ![img](b.png), [c](<c d.md>), [web](https://x.org),\n"
        "[anchor](#here), `[not](code.md)`, [t](e.md \"title\")\n"
        "```\n[also not](fenced.md)\n```\n"
        "[ref]: ref.md\n"
        '<img src="pic.png">\n'
    )
    assert links(text) == ["docs/a.md#x", "b.png", "c d.md", "#here", "e.md", "ref.md", "pic.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repo(page: Path) -> None:
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path:
            continue  # a fragment in the same page
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (leaves the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
