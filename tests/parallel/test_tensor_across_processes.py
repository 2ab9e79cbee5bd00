"""A mesh axis other than the batch's across processes: both processes load the same rows.

`mesh.tensor=4` over two processes of two CPU devices puts one tensor ring across both, and the
batch is not split over the processes at all (it is over data x stage x fsdp, all 1). Each process
must then load every row (`sharding.process_rows`). Before, each loaded half of the batch and the
first step died with a TypeError (a [8, 64] batch for a step compiled for [16, 64]). The run must
equal the same layout in one process: losses, gradient norms, eval losses, final parameters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY
from trees import assert_trees_close, final_params

RUN = ["train.steps=4", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "mesh.data=1",
       "mesh.tensor=4", "checkpoint.async_save=false"]


def metrics(run_dir: Path) -> list[dict]:
    keys = ("step", "loss", "grad_norm", "eval_loss")
    return [{k: r.get(k) for k in keys} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.multiprocess
def test_a_tensor_ring_across_two_processes_trains_like_one_process(tmp_path, child_env):
    cache = [f"checkpoint.compilation_cache_dir={child_env['CACHE']}"]
    two, one = tmp_path / "two", tmp_path / "one"
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "2", "--cpu-devices", "2",
                        "--max-restarts", "0", "--", "train", "--config", TINY, *RUN, *cache,
                        f"run.output_dir={two}"], env=child_env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY, "--cpu-devices", "4",
                        *RUN, *cache, f"run.output_dir={one}"], env=child_env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got, want = metrics(two), metrics(one)
    assert [m["step"] for m in got] == [1, 2, 3, 4] and [m["step"] for m in want] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        for k in ("loss", "grad_norm", "eval_loss"):
            assert (g[k] is None) == (w[k] is None), (k, g, w)
            if w[k] is not None:  # reductions cross processes in another order: equal to fp32 rounding
                assert abs(g[k] - w[k]) <= 1e-5 * abs(w[k]), (k, g, w)
    assert_trees_close(final_params(two), final_params(one), rel=1e-5)
