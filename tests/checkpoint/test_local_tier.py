"""The local checkpoint tier (checkpoint.local_every_steps; jaxtrain/checkpoint/local_tier.py).

In-process: round trip of one process's shards, the commit by rename, retention, refusal of a
corrupted copy, of another mesh and of a step not newer than the persistent one. Multi-process
(`jaxtrain launch`, 2 processes over gloo): kill -9 resumes from the local tier (own copy, then the
peer's copy of a lost slot's directory) bitwise; both copies gone or a damaged copy -> the
persistent tier; isolation onto fewer processes reads nothing of the local tier. Three processes
with a private disk each (`local_dir=.../host-{process}`): the replicas go over the network,
and a lost host's shards come back from its peer over the network, bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY, read_jsonl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import mesh_of  # noqa: E402
from test_checkpoint import abstract, cfg, host_state, matches, to_device  # noqa: E402

from jaxtrain.checkpoint.checkpointer import CheckpointError  # noqa: E402
from jaxtrain.checkpoint.local_tier import LocalTier, default_dir  # noqa: E402
from jaxtrain.config import ConfigError, load_config  # noqa: E402

SMALL = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8",
         "data.seq_len=16", "train.log_every=1"]


def tier(tmp_path, **kw) -> LocalTier:
    return LocalTier(cfg(local_every_steps=2, local_dir=str(tmp_path / "local"), **kw), str(tmp_path / "run"))


# ----------------------------------------------------------------------------- in-process


def test_round_trip_commit_by_rename_and_retention(tmp_path):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    t = tier(tmp_path)
    for step in (2, 4, 6):
        t.save(step, to_device(host_state(seed=step), mesh), {"data": {"pos": step}})
    t.wait()
    mine = tmp_path / "local" / "process-0"
    assert sorted(os.listdir(mine)) == ["step-4", "step-6"]  # local_keep=2, no .tmp left
    manifest = json.loads((mine / "step-6" / "manifest.json").read_text())
    assert manifest["process_count"] == 1 and manifest["mesh"] == {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}
    # each distinct shard index once: the (16, 8) embedding is split 2 x 2 over fsdp x tensor
    assert len(manifest["leaves"]["params.embed"]["chunks"]) == 4
    plan, reason = t.plan(None, abstract(host_state(0), mesh))
    assert plan.step == 6 and plan.source == "local", reason
    state, extra = t.restore(plan.step, abstract(host_state(0), mesh))
    assert matches(state, host_state(seed=6)) and extra == {"data": {"pos": 6}}
    t.clear()
    assert not (tmp_path / "local").exists()


def test_both_snapshots_write_the_same_bytes_and_the_state_may_be_donated_at_once(tmp_path, monkeypatch):
    """The device snapshot returns before the step is read: the caller's next step donates the
    state's buffers straight away (here a jitted donation deletes them, and the writer thread is
    held until then), and what is written is still the saved state, the same bytes as the host
    snapshot's."""
    import threading

    import jax

    from jaxtrain.checkpoint import local_tier
    donated, to_host = threading.Event(), local_tier._host_chunks

    def after_the_donation(state):  # the writer thread reads the snapshot only once the state is gone
        if threading.current_thread() is not threading.main_thread():
            assert donated.wait(30)
        return to_host(state)

    monkeypatch.setattr(local_tier, "_host_chunks", after_the_donation)
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    written = {}
    for mode in ("device", "host"):
        donated.clear()
        t = LocalTier(cfg(local_every_steps=2, local_dir=str(tmp_path / mode), local_snapshot=mode),
                      str(tmp_path / "run"))
        state = to_device(host_state(seed=3), mesh)
        t.save(2, state, {})
        jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)  # the next step
        assert all(x.is_deleted() for x in jax.tree.leaves(state))
        donated.set()
        t.wait()
        written[mode] = (tmp_path / mode / "process-0" / "step-2" / "shards.bin").read_bytes()
        plan, _ = t.plan(None, abstract(host_state(0), mesh))
        restored, _ = t.restore(plan.step, abstract(host_state(0), mesh))
        assert matches(restored, host_state(seed=3)), mode
    assert written["device"] == written["host"]
    with pytest.raises(ConfigError, match="'checkpoint.local_snapshot' must be one of auto, device, host; got 'gpu'"):
        load_config(TINY, ["checkpoint.local_snapshot=gpu"])


def test_the_snapshot_copy_is_compiled_at_start_up_not_at_the_first_save(tmp_path):
    from jaxtrain.checkpoint import local_tier
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    local_tier._copy_on_device.clear_cache()  # (earlier tests compiled it for these shapes)
    t = tier(tmp_path)
    t.plan(None, abstract(host_state(0), mesh))  # every start plans
    before = local_tier._copy_on_device._cache_size()
    t.save(2, to_device(host_state(seed=2), mesh), {})
    t.wait()
    assert local_tier._copy_on_device._cache_size() == before  # the save ran the copy compiled at start-up
    t.restore(t.plan(None, abstract(host_state(0), mesh))[0].step, abstract(host_state(0), mesh))


def test_a_step_not_newer_than_the_persistent_one_is_never_restored(tmp_path):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    t = tier(tmp_path)
    t.save(4, to_device(host_state(seed=4), mesh), {})
    t.wait()
    for persistent in (4, 6):
        plan, reason = t.plan(persistent, abstract(host_state(0), mesh))
        assert plan is None and f"newer than the persistent step {persistent}" in reason
    assert t.plan(2, abstract(host_state(0), mesh))[0].step == 4


def test_a_corrupted_copy_is_refused(tmp_path):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    t = tier(tmp_path)
    t.save(2, to_device(host_state(seed=2), mesh), {})
    t.wait()
    data = tmp_path / "local" / "process-0" / "step-2" / "shards.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # a same-size bit flip
    data.write_bytes(bytes(raw))
    plan, _ = t.plan(None, abstract(host_state(0), mesh))
    with pytest.raises(CheckpointError, match="checksum mismatch"):  # on every process: the persistent tier next
        t.restore(plan.step, abstract(host_state(0), mesh))


def test_another_mesh_is_refused_without_reading_the_process_folders(tmp_path):
    t = tier(tmp_path)
    t.save(2, to_device(host_state(seed=2), mesh_of(data=2, fsdp=2, tensor=2)), {})
    t.wait()
    plan, reason = t.plan(None, abstract(host_state(0), mesh_of(data=1, fsdp=4, tensor=2)))
    assert plan is None and "mesh" in reason
    assert not (tmp_path / "local" / "process-0").exists()  # the stale tier is cleared, not restored later


def test_an_interrupted_write_is_invisible(tmp_path):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    t = tier(tmp_path)
    t.save(2, to_device(host_state(seed=2), mesh), {})
    t.wait()
    shutil.copytree(tmp_path / "local" / "process-0" / "step-2", tmp_path / "local" / "process-0" / "step-4.tmp")
    assert t.plan(None, abstract(host_state(0), mesh))[0].step == 2


def test_config_keys_default_off_and_are_checked(tmp_path):
    c = load_config(TINY, [])
    assert c.checkpoint.local_every_steps == 0 and c.checkpoint.local_keep == 2 and c.checkpoint.local_replicas == 1
    assert c.checkpoint.local_dir is None and default_dir("runs/x").startswith(os.path.join(
        __import__("tempfile").gettempdir(), "jaxtrain-local"))
    with pytest.raises(ConfigError, match="inside run.output_dir"):
        load_config(TINY, [f"run.output_dir={tmp_path}", "checkpoint.local_every_steps=2",
                           f"checkpoint.local_dir={tmp_path}/local"])
    with pytest.raises(ConfigError, match="local_keep"):
        load_config(TINY, ["checkpoint.local_every_steps=2", "checkpoint.local_keep=0"])
    assert c.checkpoint.local_transfer == "auto"
    with pytest.raises(ConfigError, match="'checkpoint.local_transfer' must be one of auto, files, network; got 'nfs'"):
        load_config(TINY, ["checkpoint.local_transfer=nfs"])
    with pytest.raises(ConfigError, match="inside run.output_dir"):  # {process} does not hide it
        load_config(TINY, [f"run.output_dir={tmp_path}", "checkpoint.local_every_steps=2",
                           f"checkpoint.local_dir={tmp_path}/disk-{{process}}"])


# ----------------------------------------------------------------------------- two processes


def launch(env: dict, out: Path, local: Path, *overrides: str, restarts: int = 0, isolate_after: int = 0,
           processes: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", "launch", "--num-processes", str(processes),
                           "--cpu-devices", "1", "--isolate-after", str(isolate_after),
                           "--max-restarts", str(restarts), "--grace-period-s", "2", "--", "train", "--config", TINY,
                           *SMALL, f"run.output_dir={out}", f"checkpoint.compilation_cache_dir={env['CACHE']}",
                           f"checkpoint.local_dir={local}", f"checkpoint.local_every_steps={LOCAL_EVERY}", "fault.preflight=false",
                           *overrides], env=env, capture_output=True, text=True, timeout=timeout)


def losses(out: Path) -> dict[int, float]:
    # the kept computation wins
    return {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl", missing_ok=True)}


def resume(out: Path) -> dict:
    return next(e for e in read_jsonl(out / "events.jsonl", missing_ok=True) if e["kind"] == "resume")


STEPS = 12
LOCAL_EVERY = 2  # checkpoint.local_every_steps of `launch`


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, child_env) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("whole")
    r = launch(child_env, tmp / "run", tmp / "local", f"train.steps={STEPS}", "checkpoint.every_steps=50")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp / "local").exists()  # a run that finished deletes its local tier
    return losses(tmp / "run")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_resumes_from_the_local_tier_bitwise(tmp_path, child_env, uninterrupted):
    """kill -9 of process 1 at a random step; the job restarts, restores the newest local step
    (persistent checkpoints are 50 steps apart) and ends with the uninterrupted run's losses,
    bitwise. At most 2 x local_every_steps re-done: the kill comes right after a step, before its
    save, and the newest local save begun may still be in the asynchronous writer (then the one
    before it is the newest complete)."""
    kill = int(np.random.default_rng().integers(5, STEPS))  # from 5: a local step before the newest begun
    out, local = tmp_path / "run", tmp_path / "local"
    r = launch(child_env, out, local, f"train.steps={STEPS}", "checkpoint.every_steps=50",
               f"chaos.kill_at_step={kill}", "chaos.kill_process=1", restarts=1)
    assert r.returncode == 0, r.stderr[-3000:]
    e = resume(out)
    assert e["source"] == "local" and kill - 2 * LOCAL_EVERY <= e["restored_step"] < kill, (kill, e)
    assert losses(out) == uninterrupted
    assert not local.exists()
    saved = [x for x in read_jsonl(out / "events.jsonl", missing_ok=True) if x["kind"] == "local_checkpoint_saved"]
    assert saved and all(x["step"] % LOCAL_EVERY == 0 for x in saved)
    # `jaxtrain goodput` books the local saves' blocking as checkpoint time: the same run without
    # those events has less of it
    from jaxtrain.observe.goodput import goodput
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(out / "metrics.jsonl", bare / "metrics.jsonl")
    (bare / "events.jsonl").write_text("".join(line + "\n" for line in (out / "events.jsonl").read_text().splitlines()
                                               if '"local_checkpoint_saved"' not in line))
    booked, without = goodput(out)["parts"]["checkpoint_s"], goodput(bare)["parts"]["checkpoint_s"]
    assert booked > without and booked - without <= sum(x["blocked_s"] for x in saved) + 1e-6, (booked, without)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_lost_slot_directory_resumes_from_the_peer_copy_bitwise(tmp_path, child_env, uninterrupted):
    """The same kill, no restart by the launcher; the killed slot's local directory is deleted (a
    replacement node) before the same job is started again: process 1's shards come from process 0's
    replica, bitwise."""
    out, local = tmp_path / "run", tmp_path / "local"
    r = launch(child_env, out, local, f"train.steps={STEPS}", "checkpoint.every_steps=50",
               "chaos.kill_at_step=8", "chaos.kill_process=1")
    assert r.returncode != 0
    assert (local / "process-0" / "peer-1" / "step-6").is_dir()
    shutil.rmtree(local / "process-1")
    r = launch(child_env, out, local, f"train.steps={STEPS}", "checkpoint.every_steps=50")
    assert r.returncode == 0, r.stderr[-3000:]
    e = resume(out)
    assert e["source"] == "peer" and e["restored_step"] == 6, e
    assert losses(out) == uninterrupted


def killed_after_local_step_6(env: dict, out: Path, local: Path) -> list[str]:
    """Persistent checkpoints every 4 steps (synchronous: step 4 is surely committed; an async commit
    took 1.7 s on a loaded machine, longer than steps 5-8), killed after step 8: local step 6 is
    newer than persistent step 4 and its write had a whole step to finish. Returns the overrides."""
    common = [f"train.steps={STEPS}", "checkpoint.every_steps=4", "checkpoint.async_save=false"]
    r = launch(env, out, local, *common, "chaos.kill_at_step=8", "chaos.kill_process=1")
    assert r.returncode != 0
    assert (local / "process-1" / "step-6").is_dir() and (local / "process-0" / "peer-1" / "step-6").is_dir()
    return common


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_damaged_local_copy_is_refused_for_the_persistent_tier(tmp_path, child_env, uninterrupted):
    """Slot 1's own copy of step 6 has a flipped bit: process 1's checksum check refuses it, every
    process restores persistent step 4 (`local_tier_fallback` names the shard), bitwise."""
    out, local = tmp_path / "run", tmp_path / "local"
    common = killed_after_local_step_6(child_env, out, local)
    data = local / "process-1" / "step-6" / "shards.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    r = launch(child_env, out, local, *common)
    assert r.returncode == 0, r.stderr[-3000:]
    events = read_jsonl(out / "events.jsonl", missing_ok=True)
    e = resume(out)
    assert e["source"] == "persistent" and e["restored_step"] == 4, e
    fallback = next(x for x in events if x["kind"] == "local_tier_fallback")
    assert "checksum mismatch" in fallback["reason"] and "process 1" in fallback["reason"], fallback
    assert losses(out) == uninterrupted


@pytest.mark.multiprocess
@pytest.mark.slow
def test_both_copies_of_a_slot_gone_fall_back_to_the_persistent_tier(tmp_path, child_env, uninterrupted):
    """Slot 1's own folder and the replica its peer held are both gone: step 6 is not complete for
    every process, so persistent step 4 is restored, bitwise."""
    out, local = tmp_path / "run", tmp_path / "local"
    common = killed_after_local_step_6(child_env, out, local)
    shutil.rmtree(local / "process-1")
    shutil.rmtree(local / "process-0" / "peer-1")
    r = launch(child_env, out, local, *common)
    assert r.returncode == 0, r.stderr[-3000:]
    e = resume(out)
    assert e["source"] == "persistent" and e["restored_step"] == 4, e
    fallback = next(x for x in read_jsonl(out / "events.jsonl", missing_ok=True) if x["kind"] == "local_tier_fallback")
    assert "no local step complete on every process" in fallback["reason"], fallback
    assert losses(out) == uninterrupted


@pytest.mark.multiprocess
@pytest.mark.slow
def test_isolation_continues_on_fewer_processes_from_the_persistent_tier(tmp_path, child_env):
    """Slot 1 crashes at step 7 on every attempt; `--isolate-after 1` continues on one process. The
    local tier (step 6, 2 processes) is refused by its process count before any process folder is
    read: the run resumes from persistent step 4; the lost slot's folder is left as it was."""
    out, local = tmp_path / "run", tmp_path / "local"
    r = launch(child_env, out, local, f"train.steps={STEPS}", "checkpoint.every_steps=4",
               "checkpoint.async_save=false", "chaos.crash_process=1", "chaos.crash_at_step=7", restarts=2, isolate_after=1)
    assert r.returncode == 0, r.stderr[-3000:]
    events = read_jsonl(out / "events.jsonl", missing_ok=True)
    assert [x["slot"] for x in events if x["kind"] == "isolate"] == [1]
    e = resume(out)
    assert e["source"] == "persistent" and e["restored_step"] == 4, e
    fallback = next(x for x in events if x["kind"] == "local_tier_fallback")
    assert "2 processes, now 1" in fallback["reason"], fallback
    assert events[-1]["kind"] == "done" and events[-1]["step"] == STEPS
    # What the crashed attempts left (their writes run behind the loop, so which of steps 2-6 got
    # committed before a crash varies): kept, and nothing newer written there after the isolation.
    left = [p.name for p in (local / "process-1").iterdir() if p.name.startswith("step-")]
    assert left and all(int(n[5:].removesuffix(".tmp")) <= 6 for n in left), left
    assert not (local / "process-0").exists()


THREE = ["data.global_batch_size=6"]  # a batch that splits over 3 processes


@pytest.fixture(scope="module")
def uninterrupted_three(tmp_path_factory, child_env) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("whole3")
    r = launch(child_env, tmp / "run", tmp / "disk-{process}", f"train.steps={STEPS}",
               "checkpoint.every_steps=50", *THREE, processes=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(tmp.glob("disk-*"))  # each process deleted its disk's tier at the end
    return losses(tmp / "run")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_three_hosts_with_private_disks_get_a_lost_hosts_shards_back_over_the_network(tmp_path, child_env,
                                                                                      uninterrupted_three):
    """Each of 3 processes has a local disk of its own (`{process}` in local_dir): what each
    disk holds is its own process's folder only, the replicas having gone over TCP to the holder
    ((i + 1) % 3). Process 1 is killed after step 8 and its disk is gone (a replacement node); the
    job restarts, process 1 fetches step 6 from process 2's replica server (source peer) and the run
    ends with the uninterrupted 3-process losses, bitwise; the disks are empty at the end."""
    out, disks = tmp_path / "run", tmp_path / "disks"
    local = f"{disks}/host-{{process}}"
    common = [f"train.steps={STEPS}", "checkpoint.every_steps=50", *THREE]
    r = launch(child_env, out, Path(local), *common, "chaos.kill_at_step=8", "chaos.kill_process=1", processes=3)
    assert r.returncode != 0
    for i in range(3):
        assert sorted(os.listdir(disks / f"host-{i}")) == [f"process-{i}", "tier.json"], i
        held = set(os.listdir(disks / f"host-{i}" / f"process-{i}"))  # (the others may have saved step 8)
        assert {f"peer-{(i - 1) % 3}", "step-6"} <= held and all(n.startswith(("peer-", "step-")) for n in held), held
    held = disks / "host-2" / "process-2" / "peer-1" / "step-6"
    assert (held / "shards.bin").read_bytes() == (disks / "host-1" / "process-1" / "step-6" / "shards.bin").read_bytes()
    shutil.rmtree(disks / "host-1")
    r = launch(child_env, out, Path(local), *common, processes=3)
    assert r.returncode == 0, r.stderr[-3000:]
    e = resume(out)
    assert e["source"] == "peer" and e["restored_step"] == 6, e
    assert losses(out) == uninterrupted_three
    assert sorted(os.listdir(disks)) == []
