"""docs/config.md, the reference of every config key, is generated from jaxtrain/config.py by
docs/config_reference.py: it must be current, and every key must say what it means."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import typing
from pathlib import Path
from typing import Literal, Optional

from jaxtrain.config import Config, all_keys

REPO = Path(__file__).resolve().parents[1]


def _load_generator():
    """docs/config_reference.py as a module (a script beside the docs, not part of the package)."""
    name = "docs_config_reference"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "config_reference.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


gen = _load_generator()


def test_docs_config_md_is_current():
    path = REPO / "docs" / "config.md"
    assert path.exists(), f"docs/config.md is missing; run: {gen.REGENERATE}"
    assert path.read_text() == gen.render(), (
        f"docs/config.md is stale (jaxtrain/config.py changed since it was generated); run: {gen.REGENERATE}")


def test_the_reference_covers_every_key_once():
    """The generator's walk and the config loader's list of keys agree (a nested section included)."""
    listed = [k.dotted for s in gen.sections() for k in s.keys]
    assert sorted(listed) == sorted(all_keys())
    assert len(listed) == len(set(listed))


def test_every_key_has_a_meaning():
    missing = [k.dotted for s in gen.sections() for k in s.keys if not k.meaning.strip()]
    assert missing == [], ("config keys without a meaning; add a trailing `# comment` (or comment lines "
                           f"directly above) to their fields in jaxtrain/config.py, then run {gen.REGENERATE}: "
                           + ", ".join(missing))


def test_every_section_says_what_it_is_for():
    missing = [f"{s.name} ({s.cls.__name__})" for s in gen.sections() if not s.doc]
    assert missing == [], "config sections without a class docstring in jaxtrain/config.py: " + ", ".join(missing)


def test_null_defaults_say_what_null_means():
    """A key whose default is null is derived from other keys, or off, or unset: its meaning says which."""
    silent = [k.dotted for s in gen.sections() for k in s.keys
              if k.default is None and "null" not in k.meaning.lower() and "none" not in k.meaning.lower()]
    assert silent == [], ("config keys defaulting to null whose comment does not say what null means "
                          "(e.g. `(null = follows model.mlp_dim)`) in jaxtrain/config.py: " + ", ".join(silent))


# ----------------------------------------------------------------------------- the generator's rules


@dataclasses.dataclass(frozen=True)
class _Sample:
    """A made-up section: every way a field can be commented."""

    trailing: int = 1  # said after the field
    # said above the field,
    # over two lines
    above: str = "x"
    # a heading for a group
    both: float = 0.5  # the field's own words
    none: bool = True

    bare: Optional[str] = None
    choice: Literal["a", "b"] = "a"  # a choice; with | a pipe and <tag>, x**2
    items: list = dataclasses.field(default_factory=list)  # a list


def test_meanings_come_from_the_comments_around_each_field():
    assert gen.field_meanings(_Sample) == {
        "trailing": "said after the field",
        "above": "said above the field, over two lines",
        "both": "the field's own words. a heading for a group",
        "none": "",
        "bare": "",  # the blank line above cuts it off from any comment further up
        "choice": "a choice; with | a pipe and <tag>, x**2",
        "items": "a list",
    }
    assert gen.class_doc(_Sample) == "A made-up section: every way a field can be commented."


def test_types_and_defaults_render_as_a_config_file_writes_them():
    hints = typing.get_type_hints(_Sample)
    assert gen.type_text(hints["choice"]) == "one of `a`, `b`"
    assert gen.type_text(hints["bare"]) == "str or null"
    assert gen.type_text(Optional[Literal["x", "y"]]) == "one of `x`, `y` or null"
    assert gen.type_text(list[int]) == "list"
    assert [gen.default_text(v) for v in (None, True, "auto", [], 1e-8)] == ["`null`", "`true`", '`"auto"`', "`[]`",
                                                                             "`1e-08`"]


def test_table_cells_escape_what_markdown_would_eat():
    assert gen._cell("a | b <dir>/x, y**2 `<kept> | x*y`") == r"a \| b &lt;dir>/x, y\*\*2 `<kept> \| x*y`"


def test_rendering_is_deterministic_and_names_every_section():
    text = gen.render()
    assert text == gen.render()
    for f in dataclasses.fields(Config):
        assert f"\n## {f.name}\n" in text
