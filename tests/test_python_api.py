"""The Python API as the README shows it: the README's example runs exactly as printed, and a
`Trainer(cfg, write_files=False)` on a trained run directory holds the trained model (read-only),
never a fresh random one."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import numpy as np
from helpers import REPO, TINY
from trees import assert_trees_equal

from jaxtrain.config import load_config
from jaxtrain.trainer import Trainer



def readme_python_blocks() -> list[str]:
    """Every ```python block of the README, in order."""
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_the_readme_python_example_runs_as_printed(tmp_path):
    """Each README Python block, unchanged, in a fresh interpreter whose working directory holds the
    repository's configs/ (as a checkout does); it must train, save, resume read-only and print."""
    blocks = readme_python_blocks()
    assert blocks, "the README shows no Python example"
    (tmp_path / "configs").symlink_to(REPO / "configs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for i, code in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(code)
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                                env=env, timeout=600)
        assert result.returncode == 0, f"README block {i} failed:\n{code}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        if "write_files=False" in code:  # the read-only reopen printed the trained step, not a fresh model's
            assert "step None" not in result.stdout and "step 50 " in result.stdout, result.stdout[-2000:]


def test_a_read_only_trainer_restores_the_trained_run(tmp_path):
    """Train 30 steps (checkpoint at the end), then open the run with write_files=False: the restored
    step, every parameter leaf and the held-out loss equal the trained run's, and nothing in the run
    directory changes (the same files, bytes and modification times)."""
    overrides = [f"run.output_dir={tmp_path / 'run'}", "train.steps=30", "checkpoint.compilation_cache_dir=null"]
    trained = Trainer(load_config(TINY, overrides), devices=jax.devices()[:1])
    try:
        assert trained.fit()["exit_code"] == 0
        params = jax.device_get(trained.state["params"])
        eval_loss = trained.evaluate()
    finally:
        trained.close()
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "run").rglob("*") if p.is_file()}

    reader = Trainer(load_config(tmp_path / "run" / "config.yaml", []), write_files=False, devices=jax.devices()[:1])
    try:
        assert reader.resumed_from == 30 and reader.step_count == 30
        assert_trees_equal(jax.device_get(reader.state["params"]), params, what="params ")
        assert reader.evaluate() == eval_loss
    finally:
        reader.close()
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert after == before


def test_a_read_only_trainer_on_an_empty_directory_starts_fresh_and_writes_nothing(tmp_path):
    """No checkpoint to read: a fresh model, as before, and still no file written."""
    t = Trainer(load_config(TINY, [f"run.output_dir={tmp_path / 'none'}"]), write_files=False,
                devices=jax.devices()[:1])
    try:
        assert t.resumed_from is None and t.step_count == 0
        assert np.isfinite(t.step()["loss"])
    finally:
        t.close()
    assert not (tmp_path / "none").exists()
