"""docs/index.md lists every page in docs/, and every page it links to exists."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def linked_pages() -> list[str]:
    """The docs/ pages docs/index.md links to, e.g. `config.md` for `[config.md](config.md#x)`."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (DOCS / "index.md").read_text())
    return [t for t in targets if t.endswith(".md") and "/" not in t]


def test_every_doc_is_listed_in_the_index():
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    missing = sorted(set(pages) - set(linked_pages()))
    assert missing == [], ("docs/index.md does not list " + ", ".join(missing)
                           + ": add a line `- [name.md](name.md) — what it covers` for each")


def test_every_page_the_index_links_exists():
    dangling = sorted(p for p in set(linked_pages()) if not (DOCS / p).exists())
    assert dangling == [], "docs/index.md links to missing pages: " + ", ".join(dangling)
