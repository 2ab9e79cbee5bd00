"""SIGKILL and the same command resume bitwise for the model families' small configs (docs/models.md's
resume column): QK-norm (Qwen3), its MoE routing (Qwen3-MoE) and local/global windowed layers (Gemma 3), through `jaxtrain train`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, read_jsonl

STEPS = 12
RUN = [f"train.steps={STEPS}", "train.log_every=1", "checkpoint.every_steps=3", "data.global_batch_size=8",
       "data.seq_len=32"]


def run(config: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", str(config), f"run.output_dir={out}",
                           *RUN, *extra, "--cpu-devices", "1"], capture_output=True, text=True, timeout=600, env=env)


def losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}  # later lines win


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "gemma3-tiny", "gpt-oss-tiny", "deepseek-v3-tiny"])
def test_a_killed_family_run_resumes_bitwise(name, tmp_path):
    config = REPO / "configs" / f"{name}.yaml"
    whole = tmp_path / "whole"
    r = run(config, whole)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = tmp_path / "killed"
    assert run(config, killed, "chaos.kill_at_step=10").returncode == -signal.SIGKILL
    again = run(config, killed, "chaos.kill_at_step=10", env={**os.environ, "JAXTRAIN_RESTART_ATTEMPT": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    resumes = [e for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"]
    assert resumes and resumes[0]["restored_step"] in (6, 9)  # step 9's write may still be in flight
    got, ref = losses(killed), losses(whole)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(got[s] == ref[s] for s in range(resumes[0]["restored_step"] + 1, STEPS + 1)), (got, ref)
