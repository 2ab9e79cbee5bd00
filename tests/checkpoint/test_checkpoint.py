"""Checkpoint library: round trip, resharding, damage fallback, non-finite skip, retention,
kill mid-write, shape mismatch, init_from, CLI listing, compilation cache.

Run as a script (`python tests/checkpoint/test_checkpoint.py kill DIR`) it is the child process of the
kill-mid-write test.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.checkpoint import checkpointer
from jaxtrain.checkpoint import layout
from jaxtrain.commands import checkpoints
from jaxtrain.storage import paths as storage_paths
from jaxtrain.runtime import compilation_cache
from jaxtrain.checkpoint.checkpointer import Checkpointer, CheckpointError
from jaxtrain.config import CheckpointConfig, ConfigError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: run as a script too
from helpers import mesh_of  # noqa: E402

# ----------------------------------------------------------------------------- helpers
# Shared with test_checkpoint_multiprocess.py: values depend only on (seed, leaf position), so
# every process can build its part of a global array and check what it restored.


def spec_for(shape: tuple, mesh: jax.sharding.Mesh) -> P:
    """Last two dims over (fsdp, tensor) where they divide; the rest replicated."""
    axes = [None] * len(shape)
    for dim, axis in zip(range(len(shape) - 1, -1, -1), ("tensor", "fsdp") if len(shape) >= 2 else ("fsdp",)):
        if shape[dim] % mesh.shape[axis] == 0:
            axes[dim] = axis
    return P(*axes)


def host_state(seed: int, d: int = 8, big: tuple | None = None) -> dict:
    """A train-state-shaped pytree of numpy values: step, params, AdamW state, RNG key data."""
    params = {"embed": np.zeros((16, d), np.float32), "norm": np.zeros((d,), np.float32),
              "layers": {"w": np.zeros((4, d, 16), np.float32), "b": np.zeros((4, 16), np.float32)}}
    opt_state = jax.tree.map(np.asarray, optax.adamw(1e-3).init(params))
    if big is not None:  # added after the optimizer init so AdamW does not triple it
        params["big"] = np.zeros(big, np.float32)
    tree = {"step": np.int32(0), "params": params, "opt_state": opt_state, "rng": np.zeros((2,), np.uint32)}
    leaves, treedef = jax.tree.flatten(tree)
    filled = [(np.arange(x.size) % 97 * 0.25 + seed + i).astype(x.dtype).reshape(x.shape)
              for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, filled)


def to_device(host: dict, mesh: jax.sharding.Mesh) -> dict:
    """Global jax.Arrays; each process builds only its own shards (works multi-process)."""
    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec_for(x.shape, mesh)), lambda i: x[i])
    return jax.tree.map(put, host)


def abstract(host: dict, mesh: jax.sharding.Mesh) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                       sharding=NamedSharding(mesh, spec_for(np.shape(x), mesh))), host)


def matches(tree: dict, host: dict) -> bool:
    """Every addressable shard of `tree` equals the same slice of `host` (same structure too)."""
    if jax.tree.structure(tree) != jax.tree.structure(host):
        return False
    for x, h in zip(jax.tree.leaves(tree), jax.tree.leaves(host)):
        h = np.asarray(h)
        if x.shape != h.shape or x.dtype != h.dtype:
            return False
        if not all(np.array_equal(np.asarray(s.data), h[s.index]) for s in x.addressable_shards):
            return False
    return True


class Events(list):
    def __call__(self, kind: str, step: int, **details) -> None:
        self.append((kind, step, details))

    def kinds(self, kind: str) -> list:
        return [(s, d) for k, s, d in self if k == kind]


def tree_hash(directory) -> dict:
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, directory)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def cfg(**kw) -> CheckpointConfig:
    return CheckpointConfig(**{"keep_last": 10, **kw})


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 5 saved from an 8-device mesh (data=2, fsdp=2, tensor=2)."""
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    with Checkpointer(str(directory), cfg()) as ck:
        assert ck.save(5, to_device(host_state(seed=5), mesh), {"data": {"epoch": 1, "pos": 40}, "config": {"a": [1, 2]}})
    return directory


def test_round_trip_restores_equal_values_and_extra(saved):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    fresh = to_device(host_state(seed=0), mesh)
    assert not matches(fresh, host_state(seed=5)), "the fresh state must differ before the restore"
    ck = Checkpointer(str(saved), cfg())
    assert ck.latest_step() == 5
    state, extra = ck.restore(5, abstract(host_state(0), mesh))
    assert matches(state, host_state(seed=5))
    assert extra == {"data": {"epoch": 1, "pos": 40}, "config": {"a": [1, 2]}}
    assert state["params"]["embed"].sharding == NamedSharding(mesh, P("fsdp", "tensor"))
    assert isinstance(state["opt_state"][0], optax.ScaleByAdamState)  # NamedTuples come back as such


@pytest.mark.parametrize("sizes", [{"fsdp": 4}, {}], ids=["fsdp4-on-4-devices", "one-device"])
def test_restore_onto_a_different_mesh(saved, sizes):
    mesh = mesh_of(**sizes)
    state, _ = Checkpointer(str(saved), cfg()).restore(5, abstract(host_state(0), mesh))
    assert matches(state, host_state(seed=5))
    assert state["params"]["layers"]["w"].sharding.mesh.devices.size == mesh.devices.size


def test_state_may_be_donated_right_after_save(tmp_path):
    # save() returns once the arrays are copied: the step may then donate/overwrite them.
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    state = to_device(host_state(seed=3), mesh)
    overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 7, s), donate_argnums=0)
    ck = Checkpointer(str(tmp_path), cfg())
    assert ck.save(1, state, {})
    for _ in range(3):
        state = overwrite(state)
    jax.block_until_ready(state)
    ck.wait()
    restored, _ = ck.restore(1, abstract(host_state(0), mesh))
    assert matches(restored, host_state(seed=3))


def test_damaged_latest_falls_back_to_previous_good(tmp_path, capsys):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    ck = Checkpointer(str(tmp_path), cfg())
    for step in (1, 2, 3):
        ck.save(step, to_device(host_state(seed=step), mesh), {"step": step})
    ck.wait()

    os.remove(tmp_path / "3" / layout.MARKER)  # killed between Orbax's rename and our marker
    data_files = sorted((tmp_path / "2" / "state").rglob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)
    with open(data_files[-1], "r+b") as f:  # truncated array data
        f.truncate(data_files[-1].stat().st_size // 2)

    events = Events()
    ck2 = Checkpointer(str(tmp_path), cfg(), on_event=events)
    assert ck2.latest_step() == 1
    damaged = dict(events.kinds("checkpoint_damaged"))
    assert set(damaged) == {2, 3}
    assert "no commit marker" in damaged[3]["reason"]
    assert "bytes; the manifest says" in damaged[2]["reason"]
    state, extra = ck2.restore(1, abstract(host_state(0), mesh))
    assert matches(state, host_state(seed=1)) and extra == {"step": 1}
    with pytest.raises(CheckpointError, match="manifest"):
        ck2.restore(2, abstract(host_state(0), mesh))
    assert ck2.latest_step() == 1 and len(events.kinds("checkpoint_damaged")) == 2  # reported once

    listing = {r["step"]: r for r in layout.list_checkpoints(str(tmp_path))}
    assert [listing[s]["valid"] for s in (1, 2, 3)] == [True, False, False]
    assert listing[1]["mesh"] == {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2} and listing[1]["bytes"] > 0
    assert checkpoints.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "latest good: 1" in out
    assert checkpoints.main([str(tmp_path / "nope")]) == 2


def test_nonfinite_state_is_never_committed(tmp_path):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    events = Events()
    ck = Checkpointer(str(tmp_path), cfg(keep_last=1), on_event=events)
    assert ck.save(1, to_device(host_state(seed=1), mesh), {})
    for step, where in ((2, ("params", "embed")), (3, ("opt_state",))):
        bad = host_state(seed=step)
        if where[0] == "params":
            bad["params"]["embed"][3, 1] = np.nan
        else:
            bad["opt_state"][0].nu["norm"][0] = np.inf
        assert not ck.save(step, to_device(bad, mesh), {})
    ck.wait()
    assert [s for s, d in events.kinds("checkpoint_skipped") if "non-finite" in d["reason"]] == [2, 3]
    assert sorted(os.listdir(tmp_path)) == ["1"]
    assert ck.latest_step() == 1
    assert checkpointer.all_finite({"step": jnp.int32(-1), "rng": jnp.zeros(2, jnp.uint32), "big": jnp.full(4, 3e38)})
    for bad in (jnp.array([1.0, jnp.inf]), jnp.array([jnp.nan], jnp.bfloat16), np.array([-np.inf], np.float32)):
        assert not checkpointer.all_finite({"ok": jnp.ones(3), "bad": bad})


def test_retention_keeps_last_n_and_every_kth(tmp_path):
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    state = to_device(host_state(seed=1), mesh)
    os.makedirs(tmp_path / "0.orbax-checkpoint-tmp")  # leftover of a crashed write
    events = Events()
    ck = Checkpointer(str(tmp_path), cfg(keep_last=2, keep_every=4), on_event=events)
    for step in range(1, 10):
        ck.save(step, state, {})
    ck.wait()
    assert sorted(os.listdir(tmp_path), key=int) == ["4", "8", "9"]
    assert sum((d["deleted"] for _, d in events.kinds("checkpoint_saved")), []) == [0, 1, 2, 3, 5, 6, 7]

    # keep_last=0 still keeps the newest good checkpoint: the last good one is never deleted.
    ck0 = Checkpointer(str(tmp_path), cfg(keep_last=0, keep_every=0))
    ck0.save(10, state, {})
    ck0.wait()
    assert os.listdir(tmp_path) == ["10"] and ck0.latest_step() == 10


def test_failed_background_write_is_raised_and_reported(tmp_path, monkeypatch):
    mesh = mesh_of(data=1, fsdp=1, tensor=1)
    events = Events()
    ck = Checkpointer(str(tmp_path), cfg(), on_event=events)
    ck.save(1, to_device(host_state(seed=1), mesh), {})
    ck.wait()

    def disk_full(path, text):
        raise OSError("No space left on device")

    monkeypatch.setattr("jaxtrain.checkpoint.checkpointer.write_atomic", disk_full)
    assert ck.save(2, to_device(host_state(seed=2), mesh), {})  # fails later, in the background
    with pytest.raises(CheckpointError, match="No space left"):
        ck.wait()
    assert events.kinds("checkpoint_failed")[0][0] == 2
    assert ck.latest_step() == 1


def test_saving_a_committed_step_again_is_skipped(tmp_path):
    mesh = mesh_of(data=1, fsdp=1, tensor=1)
    events = Events()
    ck = Checkpointer(str(tmp_path), cfg(async_save=False), on_event=events)
    assert ck.save(7, to_device(host_state(seed=1), mesh), {})
    assert (tmp_path / "7" / layout.MARKER).exists()  # async_save=False: committed on return
    assert not ck.save(7, to_device(host_state(seed=2), mesh), {})
    assert "exists" in events.kinds("checkpoint_skipped")[0][1]["reason"]


def test_shape_mismatch_names_the_parameter_and_touches_nothing(saved):
    before = tree_hash(saved)
    wrong = abstract(host_state(0, d=12), mesh_of(data=1, fsdp=1, tensor=1))  # d_model 8 -> 12
    with pytest.raises(ConfigError, match=r"params\.embed' has shape \(16, 8\) in the checkpoint but \(16, 12\)"):
        Checkpointer(str(saved), cfg()).restore(5, wrong)
    with pytest.raises(ConfigError, match=r"params\.layers\.w"):
        checkpointer.restore_params_only(str(saved), wrong["params"])
    assert tree_hash(saved) == before


def test_restore_params_only_for_init_from(saved, tmp_path):
    mesh = mesh_of(data=1, fsdp=4, tensor=1)
    params = checkpointer.restore_params_only(str(saved.parent), abstract(host_state(0), mesh)["params"])
    assert matches(params, host_state(seed=5)["params"])
    with pytest.raises(ConfigError, match="no committed checkpoint"):
        checkpointer.restore_params_only(str(tmp_path), abstract(host_state(0), mesh)["params"])


def test_should_save_by_steps_time_and_end(tmp_path):
    by_steps = Checkpointer(str(tmp_path), cfg(every_steps=3, save_at_end=True))
    assert [s for s in range(0, 10) if by_steps.should_save(s)] == [3, 6, 9]
    assert by_steps.should_save(10, last=True)
    assert not Checkpointer(str(tmp_path), cfg(save_at_end=False)).should_save(10, last=True)
    by_time = Checkpointer(str(tmp_path), cfg(every_minutes=0.5 / 60))
    assert not by_time.time_due() and not by_time.should_save(1, time_due=by_time.time_due())
    time.sleep(0.6)
    assert by_time.time_due() and by_time.should_save(2, time_due=True)
    # The decision is the agreed one (the trainer's host sync), not this process's clock:
    assert not by_time.should_save(3, time_due=False)


def test_discard_after_deletes_newer_checkpoints_and_latest_before(tmp_path):
    """A rollback's tools: the newest good checkpoint before a step, and deleting what came after."""
    mesh = mesh_of(data=1, fsdp=4, tensor=2)
    with Checkpointer(str(tmp_path), cfg()) as ck:
        for step in (10, 20, 30):
            ck.save(step, to_device(host_state(seed=step), mesh), {})
        ck.wait()
        assert ck.latest_step(before=25) == 20 and ck.latest_step(before=10) is None
        assert ck.discard_after(20) == [30]
        assert ck.latest_step() == 20 and not (tmp_path / "30").exists()
        # Re-applying an old rollback deletes only what was committed before it.
        cutoff = time.time()
        ck.save(25, to_device(host_state(seed=25), mesh), {})
        ck.wait()
        assert ck.discard_after(10, committed_before=cutoff) == [20] and ck.latest_step() == 25


def test_paths_and_urls_pass_through():
    assert storage_paths.is_local("runs/a/checkpoints") and storage_paths.is_local("/abs/x")
    for url in ("gs://bucket/run/checkpoints", "s3://b/x"):
        assert not storage_paths.is_local(url) and str(storage_paths.to_path(url)) == url
    assert os.path.isabs(str(storage_paths.to_path("rel/dir")))


def test_the_cpu_multiprocess_cache_guard_reads_versions():
    """The cache stays on for one process; the guard's version parse orders releases as JAX numbers them."""
    assert compilation_cache.cache_is_safe_here()  # one process here
    guard = compilation_cache.CPU_MULTIPROCESS_CACHE_HANGS_FROM
    assert compilation_cache._version_tuple("0.12.0.1") < guard <= compilation_cache._version_tuple("0.12.1")
    assert compilation_cache._version_tuple("0.13.0rc1") == (0, 13, 0) >= guard


def test_compilation_cache_stores_small_programs(tmp_path):
    old = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                                               "jax_persistent_cache_min_entry_size_bytes")}
    try:
        assert compilation_cache.enable_compilation_cache(None) is None
        where = compilation_cache.enable_compilation_cache(str(tmp_path / "xla"))
        assert jax.config.jax_compilation_cache_dir == where
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(5)).block_until_ready()
        assert os.listdir(where), "a tiny CPU program should be cached"
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        from jax.experimental.compilation_cache import compilation_cache as jax_cache
        jax_cache.reset_cache()


BIG = (2048, 4096)  # 32 MB of float32: the background write takes long enough to be killed in


def test_kill_during_async_write_leaves_previous_checkpoint(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([sys.executable, __file__, "kill", str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in child.stdout:
            lines.append(line.strip())
            if line.startswith("INFLIGHT"):
                child.send_signal(signal.SIGKILL)  # save(2) returned; its write is in the background
                break
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert "COMMITTED 1" in lines, (lines, child.stderr.read()[-3000:])
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / "2" / layout.MARKER).exists()
    assert any(name.startswith("2") for name in os.listdir(tmp_path)), "the kill should land mid-write"

    events = Events()
    ck = Checkpointer(str(tmp_path), cfg(), on_event=events)
    assert ck.latest_step() == 1
    mesh = mesh_of(data=2, fsdp=2, tensor=2)
    expected = host_state(seed=1, big=BIG)
    state, _ = ck.restore(1, abstract(expected, mesh))
    assert matches(state, expected)


def _kill_child(directory: str) -> None:
    mesh = mesh_of(data=1, fsdp=2, tensor=1)
    ck = Checkpointer(directory, cfg())
    ck.save(1, to_device(host_state(seed=1, big=BIG), mesh), {})
    ck.wait()
    print("COMMITTED 1", flush=True)
    ck.save(2, to_device(host_state(seed=2, big=BIG), mesh), {})
    print("INFLIGHT 2", flush=True)
    time.sleep(60)  # killed before this ends


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        _kill_child(sys.argv[2])
