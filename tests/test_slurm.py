"""A real SLURM job step: `srun -n2 jaxtrain train` forms one 2-process JAX job by itself.

jaxtrain.distributed sees SLURM_NTASKS=2 and calls a bare `jax.distributed.initialize()`, which reads
the coordinator, process count and id from SLURM's environment. Needs a running cluster: on a
Debian/Ubuntu machine, `tpu_gpu_setup/slurm_local/start_local_slurm.sh` (as root) starts a one-node one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/tiny.yaml"

# Where CI could install SLURM (.ci/run sets JAXTRAIN_REQUIRE_SLURM=1 after starting it), a missing
# cluster is a failure; elsewhere (a laptop, a machine without root) the test says what is missing.
REQUIRED = os.environ.get("JAXTRAIN_REQUIRE_SLURM") == "1"
pytestmark = pytest.mark.skipif(
    shutil.which("srun") is None and not REQUIRED,
    reason="no SLURM cluster on this machine (start one: sudo tpu_gpu_setup/slurm_local/start_local_slurm.sh)")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_srun_two_tasks_form_one_job(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXTRAIN_")}  # SLURM must be the source
    env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",  # devices come from --cpu-devices, not conftest's 8
                "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    cmd = ["srun", "-n2", "--kill-on-bad-exit=1", "--immediate=120",  # fail instead of queueing for ever
           sys.executable, "-m", "jaxtrain.cli", "train", "--config", str(TINY), f"run.output_dir={out}",
           "train.steps=3", "train.log_every=1", "data.global_batch_size=8",
           f"checkpoint.compilation_cache_dir={tmp_path / 'xla_cache'}", "--cpu-devices", "2"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert events[0]["kind"] == "start" and events[0]["processes"] == 2 and events[0]["devices"] == 4
    assert events[-1]["kind"] == "done" and events[-1]["step"] == 3
