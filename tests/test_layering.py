"""The package's import graph: no cycles, and every import points down the documented layers.

Layers, from the entry points down (README "Where things live", DESIGN §3):

    entry         commands/ (and __main__)          (the `jaxtrain` verbs: nothing imports them)
    launchers     launch/                           (only commands/ imports it)
    loop          trainer
    capabilities  fault/ observe/ train/ checkpoint/ data/ hf/   (may use each other, without cycles)
    core          model/ parallel/                  (model may use parallel, never the reverse)
    ground floor  storage/ runtime/                 (paths, buckets, logs; process set-up)
    base          config, numerics

`kernels/` stands apart: a top-level folder installed as `jaxtrain.kernels` (pyproject.toml's
package-dir; a bare `kernels` is Hugging Face's package), the model calls into it and it imports
nothing else from `jaxtrain`. Every import counts, also the ones inside functions (a lazy import is still a dependency). The graph is
read from the source with `ast`, so nothing is imported to test it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RANK = {"commands": 6, "__main__": 6, "launch": 5, "trainer": 4,
        "fault": 3, "observe": 3, "train": 3, "checkpoint": 3, "data": 3, "hf": 3, "infer": 3,
        "model": 2, "parallel": 2,
        "storage": 1, "runtime": 1,
        "config": 0, "numerics": 0}


def modules(folder: str, package: str | None = None) -> dict[str, Path]:
    """Dotted module name -> file, for every module under the top-level `folder`, imported as
    `package` (default: the folder's name; kernels/ is `jaxtrain.kernels`), packages by their __init__."""
    out = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        parts = (package or folder).split(".") + list(path.relative_to(REPO / folder).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The known modules that the module `name` (at `path`) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            # `from a.b import c`: a.b.c when that is a module, else a.b itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a known a.b
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found - {name}


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports. Edges into the `jaxtrain` facade (`__version__`) are left
    out: importing any submodule runs the facade first anyway, and it imports the rest lazily."""
    mods = {**modules("jaxtrain"), **modules("kernels", "jaxtrain.kernels")}
    known = set(mods)
    return {name: imports(path, name, known) - {"jaxtrain"} for name, path in mods.items()}


def wing(module: str) -> str:
    """`jaxtrain.fault.watchdog` -> `fault`; `jaxtrain.config` -> `config`; `jaxtrain.kernels.x` -> `kernels`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "jaxtrain"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return graph()


def test_the_graph_is_read(edges):
    """The walker sees real edges (a broken walker would pass every test below)."""
    assert "jaxtrain.parallel.sharding" in edges["jaxtrain.model.llama"]
    assert "jaxtrain.fault.watchdog" in edges["jaxtrain.trainer"]
    assert "jaxtrain.kernels" in edges["jaxtrain.model.attention"]
    assert "jaxtrain.kernels.common" in edges["jaxtrain.kernels.attention"]  # a relative import
    assert len(edges) > 60


def test_no_module_import_cycles(edges):
    assert cycles(edges) == []


def test_no_cycles_between_wings(edges):
    """Capabilities may use each other, but not both ways round (that is one concept in two folders)."""
    wings: dict[str, set[str]] = {}
    for src, targets in edges.items():
        for dst in targets:
            if wing(src) != wing(dst):
                wings.setdefault(wing(src), set()).add(wing(dst))
    assert cycles(wings) == []


def test_every_import_points_down_the_layers(edges):
    upward = []
    for src, targets in sorted(edges.items()):
        if wing(src) in ("jaxtrain", "kernels"):  # the package facade; kernels checked below
            continue
        for dst in sorted(targets):
            if wing(dst) == "kernels":
                if RANK[wing(src)] < 2:
                    upward.append(f"{src} -> {dst}")
                continue
            if RANK[wing(dst)] > RANK[wing(src)] or (wing(src) == "parallel" and wing(dst) == "model"):
                upward.append(f"{src} -> {dst}")
    assert upward == [], "imports against the layering:\n" + "\n".join(upward)


# The cross-wing imports the design draws, each with why; nothing else may import across wings.
# Exact both ways: an import not listed fails, and so does a listed one nothing uses any more (the
# table must say what the code does). `config` and `numerics` are the base: every wing may use them.
ALLOWED = {
    "__main__": {"commands"},  # `python -m jaxtrain` is the CLI
    "jaxtrain": {"trainer"},  # the facade: `from jaxtrain import Trainer`
    "commands": {"trainer", "launch", "checkpoint", "data", "fault", "hf", "infer", "observe", "parallel",
                 "runtime", "storage"},  # each verb calls the part it runs
    "trainer": {"checkpoint", "data", "fault", "infer", "model", "observe", "parallel", "runtime", "storage",
                "train"},  # the loop wires every capability
    "launch": {"observe", "parallel", "runtime", "storage"},  # blame from run logs, re-planned meshes
    "checkpoint": {"data", "model", "runtime", "storage"},  # a trained run's tokenizer and model shapes
    "fault": {"observe", "runtime", "storage"},  # events and health; host messages
    "hf": {"checkpoint", "storage"},  # reads and writes checkpoints
    "infer": {"checkpoint", "data", "hf", "model", "parallel", "train"},  # a trained model, decoded and scored
    "observe": {"kernels", "model", "parallel", "runtime", "storage", "train"},  # inspect compiles the step
    "train": {"data", "model", "parallel", "runtime", "storage"},  # the step, its data and state
    "model": {"kernels", "parallel"},  # attention kernels; sharding by logical names
    "parallel": set(),
    "data": {"runtime", "storage"},  # remote data files: the bucket's client (storage) and the cache folder (runtime.env)
    "runtime": {"storage"},  # the compilation cache lives in the run directory
    "storage": set(),
}
BASE = {"config", "numerics"}


def test_cross_wing_imports_are_exactly_the_drawn_ones(edges):
    used: dict[str, set[str]] = {}
    for src, targets in edges.items():
        for dst in targets:
            if wing(src) != wing(dst) and wing(dst) not in BASE and wing(src) not in ("kernels",):
                used.setdefault(wing(src), set()).add(wing(dst))
    undrawn = sorted(f"{s} -> {d}" for s, ds in used.items() for d in ds - ALLOWED.get(s, set()))
    unused = sorted(f"{s} -> {d}" for s, ds in ALLOWED.items() for d in ds - used.get(s, set()))
    assert undrawn == [], "imports the design does not draw (add to ALLOWED with why, or remove):\n" + "\n".join(undrawn)
    assert unused == [], "ALLOWED names imports nothing makes any more (remove them):\n" + "\n".join(unused)


def test_nothing_below_the_entry_points_imports_the_launcher(edges):
    """Only the commands import launch/ (the supervisor, the recovery policy)."""
    users = sorted(src for src, targets in edges.items()
                   if any(wing(t) == "launch" for t in targets) and wing(src) not in ("commands", "launch"))
    assert users == []


def test_nothing_imports_the_commands(edges):
    """commands/ is the entry wing: the library never calls a verb (`python -m jaxtrain` is its door)."""
    users = sorted(f"{src} -> {t}" for src, targets in edges.items() for t in targets
                   if wing(t) == "commands" and wing(src) not in ("commands", "__main__"))
    assert users == []


def test_kernels_import_nothing_from_jaxtrain(edges):
    assert sorted(f"{s} -> {t}" for s, ts in edges.items() if wing(s) == "kernels"
                  for t in ts if wing(t) != "kernels") == []


def test_nothing_imports_a_bare_kernels():
    """`kernels` is Hugging Face's package (transformers imports it): ours is `jaxtrain.kernels`."""
    bare = []
    for folder in ("jaxtrain", "kernels", "tests", "bench", "tpu_gpu_setup", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
                bare += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names if n.split(".")[0] == "kernels"]
    assert bare == []


def test_the_install_maps_kernels_into_jaxtrain():
    """pyproject.toml lists the packages (a mapped one is beyond `packages.find`): every package
    folder of jaxtrain/, and kernels/ as `jaxtrain.kernels`, never as a top-level `kernels`."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "jaxtrain").rglob("__init__.py")}
    assert sorted(tool["packages"]) == sorted(folders | {"jaxtrain.kernels"})
    assert tool["package-dir"] == {"jaxtrain.kernels": "kernels"}


def test_kernels_import_from_an_uninstalled_checkout(tmp_path):
    """The repository on sys.path, no install (the offline GPU check): `jaxtrain.kernels` is still
    kernels/, found by jaxtrain's own fallback finder. `-S`: no site-packages .pth files, so no
    editable install's finder; the installed libraries are put on the path by hand."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    code = (f"import sys; sys.path[:0] = [{str(REPO)!r}]; sys.path += {site!r}; "
            "import jaxtrain.kernels as k, jaxtrain.kernels.reference; print(k.__file__); "
            "assert 'kernels' not in sys.modules")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(REPO / "kernels" / "__init__.py")


def test_every_module_is_in_a_layer(edges):
    """A new top-level module or folder must be given its place in RANK (and in the README)."""
    assert sorted({wing(m) for m in edges} - set(RANK) - {"jaxtrain", "kernels"}) == []


def test_every_module_says_what_it_owns():
    missing = [str(p.relative_to(REPO)) for name, p in {**modules("jaxtrain"), **modules("kernels", "jaxtrain.kernels")}.items()
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []


def test_the_checker_catches_a_cycle_and_an_upward_import():
    """The checks can fail: a made-up graph with both defects."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert RANK[wing("jaxtrain.model.llama")] < RANK[wing("jaxtrain.trainer")]
