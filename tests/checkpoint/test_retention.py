"""Retention: the checkpoint a pending rollback needs is pinned, and deletions run on a background
queue that saves never wait for (jaxtrain/checkpoint/checkpointer.py, jaxtrain/train/rollback.py)."""

from __future__ import annotations

import os
import sys
import time

import jax
import pytest
from helpers import TINY, read_jsonl

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.checkpoint import checkpointer as ckpt_mod
from jaxtrain.config import load_config
from jaxtrain.trainer import Trainer

sys.path.insert(0, os.path.dirname(__file__))
from helpers import mesh_of  # noqa: E402
from test_checkpoint import Events, cfg, host_state, to_device  # noqa: E402



def steps_on_disk(directory) -> list[int]:
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def test_pinned_checkpoint_survives_keep_last_until_unpinned(tmp_path):
    state = to_device(host_state(seed=1), mesh_of(data=1, fsdp=1, tensor=1))
    ck = Checkpointer(str(tmp_path), cfg(keep_last=2))
    ck.save(10, state, {})
    ck.wait()
    ck.pin_before(15)  # a spike at 15: a rollback would go back to step 10
    for step in (20, 30, 40):
        ck.save(step, state, {})
    ck.wait()
    assert steps_on_disk(tmp_path) == [10, 30, 40]
    assert ck.latest_step(before=15) == 10
    ck.pin_before(None)  # the window has passed
    ck.save(50, state, {})
    ck.wait()
    assert steps_on_disk(tmp_path) == [40, 50]


def test_a_slow_deletion_does_not_add_to_the_next_saves_blocking_time(tmp_path, monkeypatch):
    real = ckpt_mod._delete_step

    def slow(folder):
        time.sleep(2.0)  # an object store: thousands of objects
        real(folder)

    monkeypatch.setattr(ckpt_mod, "_delete_step", slow)
    state = to_device(host_state(seed=1), mesh_of(data=1, fsdp=1, tensor=1))
    events = Events()
    ck = Checkpointer(str(tmp_path), cfg(keep_last=1), on_event=events)
    ck.save(1, state, {})
    ck.wait()
    ck.save(2, state, {})  # its commit queues the deletion of step 1
    t = time.monotonic()
    ck.save(3, state, {})  # joins step 2's commit, but not the deletion it queued
    blocked = time.monotonic() - t
    assert blocked < 1.0, blocked
    assert ck.latest_step() in (2, 3)  # whatever is committed; a folder being deleted is not "damaged"
    t = time.monotonic()
    ck.wait()  # the end of a run still finishes the deletions
    assert time.monotonic() - t > 1.0
    assert steps_on_disk(tmp_path) == [3]
    assert not events.kinds("checkpoint_damaged")
    assert sum((d["deleted"] for _, d in events.kinds("checkpoint_saved")), []) == [1, 2]


def test_a_deletion_that_fails_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    def broken(folder):
        raise OSError("permission denied")

    monkeypatch.setattr(ckpt_mod, "_delete_step", broken)
    state = to_device(host_state(seed=1), mesh_of(data=1, fsdp=1, tensor=1))
    events = Events()
    ck = Checkpointer(str(tmp_path), cfg(keep_last=1), on_event=events)
    for step in (1, 2):
        ck.save(step, state, {})
    ck.wait()
    ck.save(3, state, {})  # no exception: retention is housekeeping
    ck.wait()
    failed = events.kinds("checkpoint_delete_failed")
    assert failed and failed[0][0] == 1 and "permission denied" in failed[0][1]["error"]
    assert ck.latest_step() == 3


@pytest.mark.slow
def test_rollback_finds_the_checkpoint_before_the_first_spike_despite_keep_last(tmp_path):
    """every_steps=10, keep_last=2, spikes at 15, 35, 38 within a 30-step window: the rollback at 38
    needs the step-10 checkpoint, which plain keep_last retention deleted when step 30 committed."""
    cfg_ = load_config(TINY, [
        f"run.output_dir={tmp_path}", "model.num_layers=1", "data.global_batch_size=8", "data.seq_len=32",
        "checkpoint.compilation_cache_dir=null", "train.steps=40", "train.log_every=1",
        "checkpoint.every_steps=10", "checkpoint.keep_last=2", "checkpoint.async_save=false",
        "stability.min_history=10", "stability.window=30", "stability.spike_threshold=5", "stability.max_spikes=3",
        "stability.skip_batches=30", "chaos.spike_at_steps=[15,35,38]", "chaos.spike_factor=50"])
    t = Trainer(cfg_, write_files=True, devices=jax.devices()[:1])
    try:
        t.fit()
    finally:
        t.close()
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "spike"] == [15, 35, 38]
    assert not [e for e in events if e["kind"] == "rollback_unavailable"]
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    assert [(r["from_step"], r["to_step"]) for r in rollbacks] == [(38, 10)], rollbacks
    assert events[-1]["kind"] == "done"
    # The pin ends with the rollback: keep_last=2 holds again once training is past it.
    assert steps_on_disk(tmp_path / "checkpoints") == [30, 40]


# ----------------------------------------------------------------------------- compilation cache
# (Here rather than in test_checkpoint.py: the default moved with the retention work of this file's
# change; `compilation_cache.py`.)

from jaxtrain.runtime import compilation_cache as cc  # noqa: E402


def test_auto_cache_dir_is_in_the_run_directory_every_host_shares():
    assert cc.resolve_cache_dir("auto", "/shared/runs/a") == ("/shared/runs/a/compilation_cache", None)
    assert cc.resolve_cache_dir("auto", "gs://b/runs/a") == ("gs://b/runs/a/compilation_cache", None)
    where, warning = cc.resolve_cache_dir("auto", "s3://b/runs/a")
    assert where == cc.PER_HOST_DIR and "only process 0's host restarts warm" in warning
    assert cc.resolve_cache_dir("auto", None) == (cc.PER_HOST_DIR, None)  # write_files=False: run dir untouched
    assert cc.resolve_cache_dir("/x/cache", "/shared/runs/a") == ("/x/cache", None)
    assert cc.resolve_cache_dir(None, "/shared/runs/a") == (None, None)
    assert load_config(TINY).checkpoint.compilation_cache_dir == "auto"


@pytest.mark.slow
def test_auto_uses_the_run_directory_only_for_a_job_spread_over_hosts():
    assert cc.shared_cache_run_dir("/shared/run", process_count=4, one_machine=False) == "/shared/run"
    assert cc.shared_cache_run_dir("/shared/run", process_count=1, one_machine=False) is None  # per host: warm across runs
    assert cc.shared_cache_run_dir("/shared/run", process_count=4, one_machine=True) is None  # jaxtrain launch
    assert cc.shared_cache_run_dir(None, process_count=4, one_machine=False) is None  # write_files=False


def test_a_run_caches_its_programs_and_compile_time_in_its_cache_folder(tmp_path, monkeypatch):
    from jax.experimental.compilation_cache import compilation_cache

    monkeypatch.setattr(cc, "RECORD_MIN_S", 0.0)  # CPU compiles of the tiny model are short
    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    try:
        # A single process uses the per-host folder under `auto`; name the folder to look at it.
        cfg_ = load_config(TINY, [f"run.output_dir={tmp_path}", "model.num_layers=1", "data.global_batch_size=8",
                                  "data.seq_len=32", "train.steps=2", "checkpoint.save_at_end=false",
                                  f"checkpoint.compilation_cache_dir={tmp_path / 'compilation_cache'}"])
        t = Trainer(cfg_, write_files=True, devices=jax.devices()[:1])
        try:
            t.fit()
        finally:
            t.close()
        cache = tmp_path / "compilation_cache"
        assert jax.config.jax_compilation_cache_dir == str(cache)
        assert any(n.endswith("-cache") for n in os.listdir(cache)), os.listdir(cache)
        assert cc.last_compile_s(str(cache)) > 0
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


def test_cache_writes_wait_until_the_run_directory_exists(tmp_path):
    """Programs compiled before the Trainer's last user-error check must not create the run
    directory (a refused run leaves nothing behind); they are written once it exists."""
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    run = tmp_path / "run"
    try:
        assert cc.enable_compilation_cache("auto", str(run)) == str(run / "compilation_cache")
        jax.jit(lambda x: x * 5 - 2)(jnp.arange(7)).block_until_ready()
        assert not run.exists()
        run.mkdir()  # the Trainer's RunLog, after every user-error check
        jax.jit(lambda x: x * 7 - 3)(jnp.arange(7)).block_until_ready()
        assert len([n for n in os.listdir(run / "compilation_cache") if n.endswith("-cache")]) >= 2
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
