"""Checkpoints across process counts: 2 local JAX processes (gloo) x 4 CPU devices each.

Run as a script (`python tests/checkpoint/test_checkpoint_multiprocess.py MODE PID PORT DIR...`) it is one
worker process of these tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import free_port  # noqa: E402
from helpers import mesh_of  # noqa: E402
from test_checkpoint import Events, abstract, cfg, host_state, matches, to_device  # noqa: E402

from jaxtrain.checkpoint.layout import MARKER  # noqa: E402
from jaxtrain.runtime.multihost import BarrierTimeoutError  # noqa: E402
from jaxtrain.checkpoint.checkpointer import Checkpointer  # noqa: E402


def run_workers(mode: str, *args: str, timeout: float = 120) -> list[str]:
    """Start the 2 worker processes of one job; return their outputs (both must exit 0)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, __file__, mode, str(pid), port, *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return outputs


@pytest.mark.multiprocess
def test_two_processes_save_and_restore_across_process_counts(tmp_path):
    one_proc, two_procs = tmp_path / "saved_by_1x8", tmp_path / "saved_by_2x4"
    with Checkpointer(str(one_proc), cfg()) as ck:  # 1 process x 8 devices ...
        assert ck.save(5, to_device(host_state(seed=5), mesh_of(data=2, fsdp=2, tensor=2)), {"from": "1x8"})

    # ... restored by 2 processes x 4 devices, which then save their own checkpoint (see _worker)
    outputs = run_workers("roundtrip", str(one_proc), str(two_procs))
    assert all("RESTORED OK" in out and "SAVED OK" in out for out in outputs), outputs
    assert "events=['checkpoint_saved', 'checkpoint_skipped']" in outputs[0]  # process 0 reports

    # ... and that 2-process checkpoint restores here on 1 process x 8 devices and on 1 device.
    assert os.path.isdir(two_procs / "7" / "state" / "ocdbt.process_1"), "each process writes its own shards"
    assert json.loads((two_procs / "7" / MARKER).read_text())["process_count"] == 2
    ck = Checkpointer(str(two_procs), cfg())
    assert ck.latest_step() == 7
    for sizes in ({"data": 2, "fsdp": 2, "tensor": 2}, {}):
        assert not matches(to_device(host_state(seed=0), mesh_of(**sizes)), host_state(seed=7))
        state, extra = ck.restore(7, abstract(host_state(0), mesh_of(**sizes)))
        assert matches(state, host_state(seed=7)) and extra == {"from": "2x4"}


@pytest.mark.multiprocess
def test_coordination_keys_do_not_grow_with_checkpoints(tmp_path):
    """Barrier and agreement keys live in the coordinator's memory until deleted: after 12 saves the
    store holds about as many keys as after 2 (one save generation's worth; a save leaves ~3 more
    keys when nothing is deleted, 30 over these 10 saves)."""
    outputs = run_workers("keys", str(tmp_path / "ck"))
    after_2, after_12 = map(int, outputs[0].split("KEYS ", 1)[1].split()[:2])
    assert 0 < after_2 and after_12 <= after_2 + 2, (after_2, after_12)


@pytest.mark.multiprocess
def test_barrier_timeout_names_the_missing_process(tmp_path):
    outputs = run_workers("absent", str(tmp_path))
    assert "TIMEOUT" in outputs[0], outputs[0][-3000:]
    message = outputs[0].split("TIMEOUT", 1)[1]
    assert "process(es) [1] of 2 never arrived" in message and "timed out after 2 s" in message


@pytest.mark.multiprocess
def test_restore_is_checked_once_by_process_0_for_all(tmp_path):
    """Process 1's view of the checkpoint folder is stale (its listing says "not committed"): it
    must not raise alone while process 0 waits at the barrier; process 0's check decides for all.
    Then process 0's listing fails with a throttling error: every process raises the same
    TransientStorageError (restart me), none waits out a timeout."""
    with Checkpointer(str(tmp_path / "ck"), cfg()) as ck:
        assert ck.save(5, to_device(host_state(seed=5), mesh_of(data=2, fsdp=2, tensor=2)), {})
    outputs = run_workers("verdict", str(tmp_path / "ck"), timeout=90)
    for out in outputs:
        assert "RESTORED OK" in out and "BOTH TRANSIENT" in out, out[-3000:]


def _worker(mode: str, pid: int, port: str, *dirs: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4

    if mode == "roundtrip":
        events = Events()
        ck = Checkpointer(dirs[0], cfg(), on_event=events)
        assert ck.latest_step() == 5
        state, extra = ck.restore(5, abstract(host_state(0), mesh_of(data=2, fsdp=2, tensor=2)))
        assert matches(state, host_state(seed=5)) and extra == {"from": "1x8"}
        print("RESTORED OK", flush=True)

        ck2 = Checkpointer(dirs[1], cfg(every_minutes=1e-9), on_event=events)
        assert ck2.should_save(1, time_due=ck2.time_due())  # time-based (the trainer agrees on time_due)
        mesh = mesh_of(data=1, fsdp=4, tensor=2)
        ck2.save(7, to_device(host_state(seed=7), mesh), {"from": "2x4"})
        ck2.wait()
        assert ck2.latest_step() == 7

        # A NaN that only process 1 holds: both processes must still agree to skip.
        bad = host_state(seed=8)
        bad["params"]["embed"][15, 7] = np.nan
        owners = {d.process_index for d, idx in _shard_indices(mesh, (16, 8)).items() if _holds(idx, (15, 7))}
        assert owners == {1}, owners
        assert not ck2.save(8, to_device(bad, mesh), {})
        ck2.wait()
        print(f"SAVED OK events={[k for k, _, _ in events]}", flush=True)

    elif mode == "keys":
        from jaxtrain.runtime.multihost import client
        ck = Checkpointer(dirs[0], cfg(keep_last=2))
        mesh = mesh_of(data=1, fsdp=4, tensor=2)

        def save_some(steps):
            for step in steps:
                ck.save(step, to_device(host_state(seed=step), mesh), {})
                ck.latest_step()
            ck.wait()
            return len(client().key_value_dir_get("jaxtrain/"))

        after_2, after_12 = save_some(range(1, 3)), save_some(range(3, 13))
        print(f"KEYS {after_2} {after_12}", flush=True)
        ck.close()

    elif mode == "verdict":
        from jaxtrain.checkpoint import checkpointer as module
        from jaxtrain.storage.object_store import TransientStorageError
        real = module.check_checkpoint
        if pid == 1:  # a stale view of the shared folder (the environment, not the code under test)
            module.check_checkpoint = lambda folder: (False, "no commit marker (stale view)", None)
        ck = Checkpointer(dirs[0], cfg(), barrier_timeout_s=20)
        state, _ = ck.restore(5, abstract(host_state(0), mesh_of(data=1, fsdp=4, tensor=2)))
        assert matches(state, host_state(seed=5))
        print("RESTORED OK", flush=True)

        def throttled(folder):
            raise OSError("503 SlowDown: please reduce your request rate")
        module.check_checkpoint = throttled if pid == 0 else real
        t = time.monotonic()
        try:
            ck.restore(5, abstract(host_state(0), mesh_of(data=1, fsdp=4, tensor=2)))
        except TransientStorageError as e:
            assert time.monotonic() - t < 15 and "SlowDown" in str(e), e
            print("BOTH TRANSIENT", flush=True)

    elif mode == "absent":
        done = os.path.join(dirs[0], "done")
        if pid == 0:
            ck = Checkpointer(os.path.join(dirs[0], "ck"), cfg(), barrier_timeout_s=2)
            try:
                ck.save(1, to_device(host_state(seed=1), mesh_of(data=1, fsdp=4, tensor=2)), {})
            except BarrierTimeoutError as e:
                print(f"TIMEOUT {e}", flush=True)
            open(done, "w").close()
        else:  # process 1 is alive but never reaches the save
            deadline = time.monotonic() + 60
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(0.1)
    elif mode == "s3_spread":  # tests/checkpoint/test_s3_ocdbt.py: OCDBT on s3://, replicated writes shared
        from jax.sharding import NamedSharding, PartitionSpec as P

        from jaxtrain.checkpoint import s3_arrays
        s3_arrays._MIN_SLICE_BYTES = 256  # the replicated (64, 8) float32 array: 8 slices of 8 rows
        mesh = mesh_of(data=1, fsdp=8, tensor=1)
        state = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, P() if k == "replicated" else P("fsdp")),
                                                 lambda i, v=v: v[i]) for k, v in spread_state().items()}
        with Checkpointer(dirs[0], cfg()) as ck:
            ck.save(3, state, {})
        print("SAVED OK", flush=True)
    jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (seconds of thread joins); everything is written


def spread_state() -> dict:
    """60 leaves of 8 rows (one per device under fsdp=8) and a (64, 8) array to replicate."""
    state = {f"w{i:02d}": np.arange(32, dtype=np.float32).reshape(8, 4) + i for i in range(60)}
    state["replicated"] = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    return state


def _shard_indices(mesh, shape: tuple) -> dict:
    from jax.sharding import NamedSharding
    from test_checkpoint import spec_for
    return NamedSharding(mesh, spec_for(shape, mesh)).devices_indices_map(shape)


def _holds(index: tuple, point: tuple) -> bool:
    return all((s.start or 0) <= p < (s.stop if s.stop is not None else p + 1) for s, p in zip(index, point))


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
