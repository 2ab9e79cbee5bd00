"""Resume through the real entry point: SIGKILL, SIGTERM, kill mid-write, other meshes, bad checkpoints."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY, read_jsonl
from trees import assert_trees_equal

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.config import load_config
from jaxtrain.trainer import Trainer

STEPS = 40
RUN = ["train.steps=40", "train.log_every=1", "checkpoint.every_steps=5", "model.num_layers=1",
       "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8", "data.seq_len=32"]


def train_cmd(out: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
            f"checkpoint.compilation_cache_dir={cache}", *RUN, *extra, "--cpu-devices", "1"]


def run(out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(out, cache, *extra), capture_output=True, text=True, timeout=600)


def final_state(out: Path) -> dict:
    """The whole train state of the run's latest checkpoint: parameters, optimizer, step and RNG."""
    cfg = load_config(out / "config.yaml", ["checkpoint.compilation_cache_dir=null"])
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    checkpoints = Checkpointer(str(out / "checkpoints"), cfg.checkpoint)
    state, _ = checkpoints.restore(checkpoints.latest_step(), trainer.abstract_state())
    checkpoints.close()
    return jax.device_get(state)


def losses_by_step(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}  # later lines win


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    r = run(out, cache)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def assert_same_run(resumed: Path, reference: Path, after_step: int) -> None:
    ref, got = losses_by_step(reference), losses_by_step(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(after_step + 1, STEPS + 1):
        assert got[step] == ref[step], (step, got[step], ref[step])  # bitwise, not approximately
    assert_trees_equal(final_state(resumed), final_state(reference))


def kill_and_resume(out: Path, cache: Path, *extra: str) -> int:
    """SIGKILL after step 23, then the same command again; returns the step it resumed from."""
    killed = run(out, cache, "chaos.kill_at_step=23", *extra)
    assert killed.returncode == -signal.SIGKILL
    assert max(losses_by_step(out)) >= 22
    # The same command; the restart counter (set by `jaxtrain launch`) keeps the drill from firing again.
    env_restart = subprocess.run(train_cmd(out, cache, "chaos.kill_at_step=23", *extra), capture_output=True,
                                 text=True, timeout=600, env={**os.environ, "JAXTRAIN_RESTART_ATTEMPT": "1"})
    assert env_restart.returncode == 0, env_restart.stderr[-3000:]
    resume = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume"]
    # Step 20's write may still be in flight 3 steps later (then 15 is the latest committed).
    restored = resume[0]["restored_step"]
    assert restored in (15, 20) and resume[0]["restart_to_first_step_s"] > 0
    return restored


@pytest.mark.slow
def test_sigkill_then_same_command_resumes_bitwise(tmp_path, cache, uninterrupted):
    restored = kill_and_resume(tmp_path / "run", cache)
    assert_same_run(tmp_path / "run", uninterrupted, after_step=restored)


@pytest.mark.slow
def test_fp16_resume_restores_loss_scale_and_spike_statistics_bitwise(tmp_path, cache):
    """The scaler (which backs off and grows here) and the spike statistics are part of the state:
    a killed fp16 run resumes to the same losses and the same final state, bitwise."""
    fp16 = ("precision.policy=fp16", "precision.loss_scale_init=1024", "precision.growth_interval=3",
            "chaos.nan_at_steps=[7,18]", "stability.min_history=5")
    reference = tmp_path / "uninterrupted"
    assert run(reference, cache, *fp16).returncode == 0
    scales = [m["loss_scale"] for m in read_jsonl(reference / "metrics.jsonl")]
    assert len(set(scales)) > 2  # the scale really moved both ways during the run
    restored = kill_and_resume(tmp_path / "run", cache, *fp16)
    assert_same_run(tmp_path / "run", reference, after_step=restored)


@pytest.mark.slow
def test_kill_during_async_write_restores_previous_checkpoint(tmp_path, cache, uninterrupted):
    out = tmp_path / "run"
    # Saving every step, the kill after step 12 lands while step 11's write is still in flight.
    killed = run(out, cache, "checkpoint.every_steps=1", "chaos.kill_at_step=12")
    assert killed.returncode == -signal.SIGKILL
    env = {**os.environ, "JAXTRAIN_RESTART_ATTEMPT": "1"}
    r = subprocess.run(train_cmd(out, cache, "checkpoint.every_steps=1", "chaos.kill_at_step=12"),
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    restored = next(e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume")["restored_step"]
    assert 8 <= restored <= 11
    assert_same_run(out, uninterrupted, after_step=restored)


@pytest.mark.slow
def test_sigterm_saves_exits_75_and_loses_no_step(tmp_path, cache, uninterrupted):
    out = tmp_path / "run"
    # A slowed host (50 ms per step, same numerics) so the signal lands mid-run even when warm.
    proc = subprocess.Popen(train_cmd(out, cache, "checkpoint.every_steps=100", "chaos.slow_seconds=0.05"),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 6:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    events = read_jsonl(out / "events.jsonl")
    stopped = next(e for e in events if e["kind"] == "preempted")["step"]
    saved = [e["step"] for e in events if e["kind"] == "checkpoint_saved"]
    assert saved == [stopped] and 6 <= stopped < STEPS  # the emergency checkpoint, committed
    r = run(out, cache, "checkpoint.every_steps=100")
    assert r.returncode == 0, r.stderr[-3000:]
    assert next(e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume")["restored_step"] == stopped
    assert_same_run(out, uninterrupted, after_step=stopped)


def tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


def test_checkpoint_of_another_model_shape_exits_2_untouched(tmp_path, cache):
    out = tmp_path / "run"
    assert run(out, cache, "train.steps=2").returncode == 0
    before = tree_hash(out / "checkpoints")
    # With consent to the change (else the config check refuses it first, tests/train/test_config_changes.py),
    # the restore's own shape check refuses the checkpoint.
    r = run(out, cache, "train.steps=4", "model.mlp_dim=96", "run.allow_changes=all")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "w_down" in r.stderr or "w_up" in r.stderr or "w_gate" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert tree_hash(out / "checkpoints") == before
    # init_from with the wrong shape: also exit 2, and the new run directory is never created.
    new = tmp_path / "new"
    r = run(new, cache, "model.mlp_dim=96", f"checkpoint.init_from={out}")
    assert r.returncode == 2 and "mlp" in r.stderr and not new.exists()


def test_restore_onto_other_meshes_in_process(tmp_path):
    """8 devices (2,2,2) -> 4 devices fsdp=4 -> 1 device: each restores the previous one's values."""
    base = load_config(TINY, [f"run.output_dir={tmp_path}", "checkpoint.compilation_cache_dir=null",
                              "train.steps=3", "checkpoint.every_steps=0", "checkpoint.save_at_end=true",
                              "model.num_heads=4", "model.num_kv_heads=2", "data.global_batch_size=8"])
    layouts = [(8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]), (4, ["mesh.data=1", "mesh.fsdp=4"]),
               (1, ["mesh.data=1"])]
    previous = None
    for i, (n, mesh) in enumerate(layouts):
        # Each restore trains 3 more steps: a longer schedule, consented to (docs/checkpoint.md).
        trainer = Trainer(base.with_overrides(*mesh, f"train.steps={3 * (i + 1)}", "run.allow_changes=[train.steps]"),
                          devices=jax.devices()[:n])
        restored = jax.device_get(trainer.state)
        if previous is None:
            assert trainer.resumed_from is None
        else:
            assert trainer.resumed_from == 3 * i
            jax.tree_util.tree_map(np.testing.assert_array_equal, restored, previous)
        trainer.fit()
        previous = jax.device_get(trainer.state)
        trainer.close()
    assert int(previous["step"]) == 9
