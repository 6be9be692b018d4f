"""mkdocs hooks (mkdocs.yml ``hooks:``): links from a docs page to repository files outside
docs/, and Sphinx roles in docstrings.

In the repository (on a forge, in an editor) a link such as ``../bench/results/history.md``
opens the file; the built site has no page for it, so ``mkdocs build --strict`` would
fail on it as a broken link. Before mkdocs checks the links, this hook turns each such
link into its text followed by the file's path in the repository, which is what a reader
of the site needs to find it. ``tests/unit/test_docs_links.py`` checks that every relative
link resolves to a file inside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# [text](../path) or [text](../path#anchor); images (![...]) are left to mkdocs
_OUTSIDE_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    here = (docs / page.file.src_uri).parent

    def replace(m: re.Match[str]) -> str:
        text, link = m.group(1), m.group(2)
        target = (here / link).resolve()
        if target.is_relative_to(docs):
            return m.group(0)  # still inside docs/: mkdocs resolves it
        path = target.relative_to(repo).as_posix() if target.is_relative_to(repo) else link
        if text.strip("`") == path:
            return f"`{path}` (in the repository)"
        return f"{text} (`{path}` in the repository)"

    return _OUTSIDE_LINK.sub(replace, markdown)


# Docstrings use Sphinx roles (:class:`X`, :meth:`x`); mkdocstrings renders the role's
# name as text in front of the code span. Keep only the code span on the site.
_ROLE = re.compile(r":(?:class|meth|func|attr|exc|mod|obj|data|const):(<code>)")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return _ROLE.sub(r"\1", html)
