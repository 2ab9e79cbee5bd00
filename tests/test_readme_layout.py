"""Every module of the package is named in the README's "Where things live" table, in its folder's row.

A new module without a line there is a module a reader cannot find from the README; the test names it.
"""

from __future__ import annotations

import re

from helpers import REPO


def where_things_live() -> str:
    """The README's "Where things live" section: from its heading to the next `## ` heading."""
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Where things live")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def folder_key(folder: str) -> str:
    """`jaxtrain/model/` and `model/` alike -> "model/"; the package's top level -> ""."""
    return folder.removeprefix("jaxtrain/")


def table_rows(section: str) -> dict[str, str]:
    """{folder key: the row's text} for each folder its first cell names (`jaxtrain/data/`, `jaxtrain/hf/` ...)."""
    rows = {}
    for line in section.splitlines():
        cells = line.split("|")
        if not line.startswith("| `") or len(cells) < 3:
            continue
        for folder in re.findall(r"`([\w/]+/)`", cells[1]):
            rows[folder_key(folder)] = line
    return rows


def modules() -> list[str]:
    """jaxtrain/**/*.py and kernels/*.py (wherever the kernels live), without __init__.py."""
    paths = [*(REPO / "jaxtrain").rglob("*.py"), *(REPO / "kernels").glob("*.py")]
    return sorted(str(p.relative_to(REPO)) for p in paths if p.name != "__init__.py" and "__pycache__" not in p.parts)


def test_every_module_is_in_the_where_things_live_table():
    rows = table_rows(where_things_live())
    assert "" in rows and "model/" in rows and "kernels/" in rows, sorted(rows)  # the table was found
    missing = []
    for module in modules():
        folder, name = module.rsplit("/", 1)
        key = folder_key(folder + "/")
        while key not in rows and key:  # a sub-folder without a row of its own: its parent's row
            key = key.rstrip("/").rpartition("/")[0] + "/" if "/" in key.rstrip("/") else ""
        if not re.search(rf"(?<![\w/]){re.escape(name)}\b", rows.get(key, "")):
            missing.append(module)
    assert not missing, ("modules missing from README.md's \"Where things live\" table (add each to its "
                         f"folder's row with a few words): {', '.join(missing)}")
