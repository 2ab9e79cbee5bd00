"""The `JAXTRAIN_*` contract between the cluster recipes and the processes they start.

`jaxtrain/runtime/env.py` is the one place the names are written in Python; the recipes (train.sbatch,
the Kubernetes JobSet, the TPU launch script, the GPU check) spell them in shell and YAML. A name
a recipe sets that no process reads, or a name a process needs that a recipe does not set, is a
silent misconfiguration on a real cluster: these tests make it a failure here.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from jaxtrain.runtime import env

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (REPO / "tpu_gpu_setup").rglob("*") if p.suffix in (".sh", ".sbatch", ".yaml", ".md"))
NAME = re.compile(r"\bJAXTRAIN_[A-Z][A-Z0-9_]*\b")


def test_every_name_a_recipe_uses_is_defined_in_env_py():
    known = set(env.ALL) | set(env.SCRIPT_SETTINGS)
    unknown = {f"{p.relative_to(REPO)}: {n}" for p in RECIPES for n in NAME.findall(p.read_text()) if n not in known}
    assert sorted(unknown) == []


def test_the_python_code_writes_no_name_by_hand():
    """Outside env.py, `jaxtrain/` names the variables through `jaxtrain.runtime.env` (docstrings and
    comments may mention them)."""
    offenders = []
    for path in sorted((REPO / "jaxtrain").rglob("*.py")):
        if path.name == "env.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"[\"']JAXTRAIN_[A-Z_]+[\"']", code):
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert offenders == []


def test_the_jobset_sets_what_a_process_needs_to_join_and_count_attempts():
    docs = list(yaml.safe_load_all((REPO / "tpu_gpu_setup/kubernetes/jobset.yaml").read_text()))
    names = set()

    def walk(node):
        if isinstance(node, dict):
            if node.get("name", "").startswith("JAXTRAIN_") and ("value" in node or "valueFrom" in node):
                names.add(node["name"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(docs)
    assert {env.COORDINATOR, env.NUM_PROCESSES, env.PROCESS_ID, env.RESTART_ATTEMPT} <= names, names


def test_the_tpu_launch_script_exports_the_coordinates():
    text = (REPO / "tpu_gpu_setup/tpu/launch.sh").read_text()
    exported = set(NAME.findall(" ".join(line for line in text.splitlines() if "export " in line)))
    assert {env.COORDINATOR, env.NUM_PROCESSES, env.PROCESS_ID} <= exported


def test_the_sbatch_script_counts_attempts_for_the_drills():
    text = (REPO / "tpu_gpu_setup/gpu/slurm/train.sbatch").read_text()
    assert re.search(rf"export {env.RESTART_ATTEMPT}=", text)
