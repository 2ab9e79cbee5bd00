"""Generate docs/config.md: every config key with its type, default and meaning.

The reference is read from `jaxtrain/config.py` itself, so it cannot drift from the code:
- keys, types and defaults from the frozen config dataclasses (`Config` and its sections);
- a key's meaning from the comments on its field: its trailing `# comment`, then the comment
  lines directly above the field (no blank line between);
- a section's description from its class docstring (read from the source: dataclasses invent
  a `__doc__` for classes without one).

    python docs/config_reference.py            # print the reference
    python docs/config_reference.py --write    # rewrite docs/config.md
    python docs/config_reference.py --check    # exit 1 when docs/config.md is stale

`tests/test_config_reference.py` fails when docs/config.md differs from `render()`.
This is a script beside the docs, not a package module: the package's layers
(tests/test_layering.py) hold code the system runs, and nothing in it needs this.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal

from jaxtrain import config as config_module
from jaxtrain.config import DEFAULT_RULES, Config

DOC_PATH = Path(__file__).resolve().parent / "config.md"
REGENERATE = "python docs/config_reference.py --write"


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key as the reference shows it."""

    dotted: str  # e.g. "model.d_model"
    type: str  # rendered type, e.g. "int", "one of `ring`, `allgather`"
    default: Any  # the value a default Config holds
    meaning: str  # the field's comments, joined into one line


@dataclasses.dataclass(frozen=True)
class Section:
    """One config section (a dataclass) and its keys."""

    name: str  # dotted prefix, e.g. "model"
    cls: type
    doc: str  # the class docstring, "" when it has none
    keys: list[Key]


# ----------------------------------------------------------------------------- reading config.py


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """(trailing, whole_line): comment text by 1-based line of `source`, without the `#`.

    trailing: comments after code on the same line; whole_line: lines holding only a comment."""
    trailing, whole_line = {}, {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row = tok.start[0]
        text = tok.string.lstrip("#").strip()
        if lines[row - 1].strip().startswith("#"):
            whole_line[row] = text
        else:
            trailing[row] = text
    return trailing, whole_line


def field_meanings(cls: type) -> dict[str, str]:
    """Field name -> meaning, from the comments around each field in the class's source."""
    source = inspect.getsource(cls)
    trailing, whole_line = _comments(source)
    class_node = ast.parse(source).body[0]
    meanings = {}
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row in whole_line:  # the comment block directly above, read upwards
            above.insert(0, whole_line[row])
            row -= 1
        own = " ".join(trailing[r] for r in range(node.lineno, node.end_lineno + 1) if r in trailing)
        meanings[node.target.id] = _join(own, " ".join(above))
    return meanings


def _join(own: str, above: str) -> str:
    """A field's trailing comment, then the block above it. When a field has both, the block is
    usually a heading for a group of fields (the `mesh.dcn_*` keys), so the field's own words lead."""
    if own and above:
        return own + ("" if own[-1] in ".:;!?" else ".") + " " + above
    return own or above


def class_doc(cls: type) -> str:
    """The docstring written in the class's source, as one paragraph ("" when there is none)."""
    doc = ast.get_docstring(ast.parse(inspect.getsource(cls)).body[0]) or ""
    return " ".join(doc.split())


def type_text(t: Any) -> str:
    """A field type as the reference shows it; Literal types list their allowed values."""
    origin = typing.get_origin(t)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        text = " or ".join(type_text(a) for a in args)
        return text + " or null" if len(args) < len(typing.get_args(t)) else text
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in typing.get_args(t))
    if origin is not None:  # list[int], dict[str, Any]: the container is what YAML sees
        return origin.__name__
    return getattr(t, "__name__", str(t))


def sections(cls: type = Config, prefix: str = "", instance: Any = None) -> list[Section]:
    """Every section under `cls`, depth first in field order; nested dataclasses get their own."""
    instance = cls() if instance is None else instance
    hints = typing.get_type_hints(cls)
    meanings = field_meanings(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            nested += sections(hints[f.name], f"{prefix}{f.name}.", value)
        else:
            keys.append(Key(prefix + f.name, type_text(hints[f.name]), value, meanings.get(f.name, "")))
    own = [Section(prefix.rstrip("."), cls, class_doc(cls), keys)] if keys else []
    return own + nested


def rules_meanings() -> dict[str, str]:
    """Logical axis -> the comments on its DEFAULT_RULES entry (above it, then trailing)."""
    source = inspect.getsource(config_module)
    trailing, whole_line = _comments(source)
    for node in ast.parse(source).body:
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "DEFAULT_RULES" and isinstance(node.value, ast.Dict)):
            out = {}
            for k in node.value.keys:
                above, row = [], k.lineno - 1
                while row in whole_line:
                    above.insert(0, whole_line[row])
                    row -= 1
                out[ast.literal_eval(k)] = _join(trailing.get(k.lineno, ""), " ".join(above))
            return out
    return {}


# ----------------------------------------------------------------------------- rendering


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: `|` escaped everywhere; outside code spans `<` (an
    HTML tag to a renderer, e.g. <output_dir>) and `*` (emphasis, e.g. logits)**2) escaped too."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("*", r"\*")
    return "`".join(parts).replace("|", r"\|")


def default_text(value: Any) -> str:
    """A default as YAML would write it (JSON is YAML's flow style): null, true, "auto", [] ..."""
    return f"`{json.dumps(value)}`"


def render() -> str:
    """The whole of docs/config.md. Deterministic: field order of the dataclasses, no timestamps."""
    all_sections = sections()
    out = [
        "# Config reference",
        "",
        "<!-- Generated from jaxtrain/config.py by docs/config_reference.py; do not edit by hand. -->",
        f"<!-- Refresh: {REGENERATE} -->",
        "",
        "Every key a config accepts, with its type, default and meaning, generated from the config",
        "dataclasses in `jaxtrain/config.py` (the meaning is the comment on each field there).",
        "Set a key in a YAML file under its section, or on the command line as a dotted override:",
        "",
        "```bash",
        "jaxtrain train --config configs/tiny.yaml train.steps=200 mesh.fsdp=2 'train.profile_steps=[20,22]'",
        "```",
        "",
        "Defaults are written as YAML values (`null`, `true`, `[]`). Where a default is `null`, `0`, `-1`",
        "or `auto`, the value is usually derived or the feature is off: the meaning says which (e.g.",
        "`mesh.data: -1` takes the devices the other axes leave over, `model.moe_mlp_dim: 0` follows",
        "`model.mlp_dim`). Types `one of ...` list every value the key accepts. Config loading rejects",
        "unknown keys, wrong types and values outside those lists (`jaxtrain/config.py`, exit code 2).",
        "",
        "Sections: " + ", ".join(f"[`{s.name}`](#{s.name})" for s in all_sections) + ".",
        "",
    ]
    for s in all_sections:
        out += [f"## {s.name}", ""]
        if s.doc:
            out += [s.doc, ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{k.dotted}` | {_cell(k.type)} | {_cell(default_text(k.default))} | {_cell(k.meaning)} |"
                for k in s.keys]
        out.append("")
        if s.name == "mesh":  # the rules table is one key but decides every sharding: show its entries
            meanings = rules_meanings()
            out += ["Default `mesh.rules` (logical axis → mesh axis or axes; `null` = replicated). A partial",
                    "table in a config overrides only the entries it names.", "",
                    "| logical axis | mesh axes | meaning |", "|---|---|---|"]
            out += [f"| `{axis}` | {_cell(default_text(target))} | {_cell(meanings.get(axis, ''))} |"
                    for axis, target in DEFAULT_RULES.items()]
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Print the reference, write it (--write) or check docs/config.md against it (--check)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {DOC_PATH.name}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {DOC_PATH.name} is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
    elif args.check:
        if not DOC_PATH.exists() or DOC_PATH.read_text() != text:
            print(f"docs/{DOC_PATH.name} is stale; run: {REGENERATE}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
