"""Nothing below the commands prints: the library returns data and strings, `jaxtrain/commands/`
parses, calls and prints, and library warnings and drill notices go through `logging` (one stderr
handler, `jaxtrain.observe.console.install_stderr_logging`).

Allowed to call `print`: `jaxtrain/commands/` (the verbs) and `jaxtrain/observe/console.py` (the loop's
console: the lines a person reads). The loop itself (`trainer.py`) reports through both. The source
is read with `ast`: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ALLOWED = ("jaxtrain/commands/", "jaxtrain/observe/console.py")


def print_calls(source: str, filename: str) -> list[int]:
    """The lines where `source` calls the builtin `print` (also `builtins.print`)."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Name) and f.id == "print") or (
                isinstance(f, ast.Attribute) and f.attr == "print" and isinstance(f.value, ast.Name)
                and f.value.id == "builtins"):
            lines.append(node.lineno)
    return sorted(lines)


def test_nothing_below_the_commands_prints():
    found = []
    for folder in ("jaxtrain", "kernels"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if "__pycache__" in path.parts or rel.startswith(ALLOWED):
                continue
            found += [f"{rel}:{line}" for line in print_calls(path.read_text(), rel)]
    assert found == [], ("modules below jaxtrain/commands/ call print (return the text, or log it: "
                         "logging.getLogger(__name__)):\n" + "\n".join(found))


def test_the_checker_sees_a_print():
    """The check can fail: a print in a lambda, a method and through `builtins` is found."""
    source = ("import builtins\nf = lambda: print('x')\nclass A:\n    def m(self):\n        builtins.print(1)\n"
              "def g(out):\n    out.write('fine')\n")
    assert print_calls(source, "<test>") == [2, 5]
