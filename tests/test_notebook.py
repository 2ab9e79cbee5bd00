"""examples/quickstart.ipynb runs top to bottom in a fresh kernel, and is stored without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code), \
        "strip the outputs before committing (jupyter nbconvert --clear-output --inplace examples/quickstart.ipynb)"


def test_notebook_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # A fresh kernel on this interpreter, with the repository importable and no XLA flags of ours
    # (the notebook sets its own 8 simulated devices before JAX starts).
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["PYTHONPATH"] = os.pathsep.join([str(NOTEBOOK.parents[1]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # kernel "python3" runs sys.executable (jupyter_client swaps in the running interpreter for "python").
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "parameters identical after restore: True" in text
    assert "resumed from step 50" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the loss plot, the mesh, the weight's shards
    losses = next(line for line in text.splitlines() if line.startswith("loss "))
    first, last = (float(x) for x in losses.split()[1::2])
    assert last < first - 1.0, losses  # it learned something in 50 steps
