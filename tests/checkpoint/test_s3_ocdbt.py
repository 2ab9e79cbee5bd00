"""s3:// checkpoints in Orbax's OCDBT format, against a real local S3 server (moto_server).

The number of objects a checkpoint writes does not grow with leaves x devices (the old zarr
layout wrote one object per shard per leaf); a replicated array is written in disjoint slices by
its replicas, on every process that holds one, not by replica 0's host alone; the checkpoint
restores onto other meshes; stock Orbax reads it once copied to local disk; and a checkpoint in
the old zarr layout (Orbax's non-OCDBT format) still restores from the bucket.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from storage_servers import objects, storage_servers  # noqa: E402
from helpers import mesh_of  # noqa: E402
from test_checkpoint import abstract, cfg, host_state, matches, to_device  # noqa: E402

from jaxtrain.checkpoint.checkpointer import Checkpointer  # noqa: E402
from jaxtrain.checkpoint import checkpointer as checkpointer_module  # noqa: E402
from jaxtrain.checkpoint import s3_arrays  # noqa: E402
from jaxtrain.storage import object_store  # noqa: E402

BUCKET = "jaxtrain-ocdbt"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with storage_servers(tmp_path_factory.mktemp("servers"), [BUCKET]) as env:
        yield env


def ocdbt_keys(url: str) -> list[str]:
    """The keys of the OCDBT database at `url` (a checkpoint's `state/` or one process's part)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": object_store.s3_kvstore(url)}).result()
    return sorted(k.decode() for k in kv.list().result())


def many_leaves(n: int, seed: int) -> dict:
    """`n` leaves of 8 rows (one row per device under fsdp=8), distinct values per leaf."""
    return {f"w{i:03d}": (np.arange(8 * 4, dtype=np.float32).reshape(8, 4) * (i + 1) + seed) for i in range(n)}


def fsdp_sharded(host: dict, mesh: jax.sharding.Mesh) -> dict:
    return {k: jax.device_put(v, NamedSharding(mesh, P("fsdp", None))) for k, v in host.items()}


def test_objects_do_not_grow_with_leaves_times_devices_and_restore_across_meshes(servers):
    """200 leaves, each sharded over 8 devices: the zarr layout wrote 200 x (8 chunks + .zarray)
    = 1800 objects; OCDBT writes a few per process plus the fixed files of a checkpoint."""
    leaves = 200
    url = f"s3://{BUCKET}/count/checkpoints"
    host = many_leaves(leaves, seed=3)
    with Checkpointer(url, cfg()) as ck:
        ck.save(1, fsdp_sharded(host, mesh_of(data=1, fsdp=8, tensor=1)), {"n": leaves})
    written = objects(f"{url}/1")
    state = [o for o in written if "/1/state/" in o]
    assert len(written) <= 30 and len(state) <= 20, (len(written), written)  # 1 process; not ~leaves x devices
    assert any(o.endswith("/1/state/manifest.ocdbt") for o in state), state
    assert any("/1/state/ocdbt.process_0/" in o for o in state), state

    ck = Checkpointer(url, cfg())
    assert ck.latest_step() == 1
    for target in (mesh_of(data=1, fsdp=1, tensor=1), mesh_of(data=2, fsdp=2, tensor=2)):  # 8 devices -> 1 device; fsdp 8 -> 2
        want = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(target, P("fsdp", "tensor")))
                for k, v in host.items()}
        restored, extra = ck.restore(1, want)
        assert extra == {"n": leaves}
        for k, v in host.items():
            assert restored[k].sharding.mesh.devices.size == target.devices.size
            np.testing.assert_array_equal(np.asarray(restored[k]), v, err_msg=k)


def test_a_replicated_array_is_written_in_slices_by_its_replicas(servers, monkeypatch):
    """On data=2 x fsdp=4, with slices of at least 256 bytes: a fully replicated (64, 8) float32
    array (8 replicas) is 8 disjoint chunks of 8 rows, one per replica; one sharded over fsdp (2
    replicas of each (16, 8) shard) is 8 chunks, each shard cut in two; a small one (below the
    slice size) stays one chunk. The zarr layout had one chunk per shard, all from replica 0."""
    monkeypatch.setattr(s3_arrays, "_MIN_SLICE_BYTES", 256)
    url = f"s3://{BUCKET}/replicated/checkpoints"
    mesh = mesh_of(data=2, fsdp=4, tensor=1)
    host = {"big": np.arange(64 * 8, dtype=np.float32).reshape(64, 8), "small": np.ones((8, 2), np.float32),
            "part": -np.arange(64 * 8, dtype=np.float32).reshape(64, 8)}
    specs = {"big": P(), "small": P(), "part": P("fsdp")}
    with Checkpointer(url, cfg()) as ck:
        ck.save(1, {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}, {})
    keys = ocdbt_keys(f"{url}/1/state")
    for name, chunks in (("big", 8), ("part", 8), ("small", 1)):
        assert sorted(k for k in keys if k.startswith(f"{name}/")) == [f"{name}/.zarray"] + [
            f"{name}/{i}.0" for i in range(chunks)], keys
    restored, _ = Checkpointer(url, cfg()).restore(1, abstract(host, mesh_of(data=1, fsdp=2, tensor=2)))
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(restored[k]), v, err_msg=k)


def test_stock_orbax_reads_an_s3_checkpoint_copied_to_disk(servers, tmp_path):
    """The OCDBT format is Orbax's own: the step folder, copied out of the bucket, restores with
    a plain Orbax PyTreeCheckpointer (no jaxtrain handler). An all-zero leaf too: stock Orbax
    reads a missing chunk as an error, not as zeros, so every chunk must be stored."""
    url = f"s3://{BUCKET}/stock/checkpoints"
    host = {**host_state(seed=4), "zeros": np.zeros((8, 4), np.float32)}
    with Checkpointer(url, cfg()) as ck:
        ck.save(4, to_device(host, mesh_of(data=2, fsdp=2, tensor=2)), {})
    fs = object_store.filesystem(url)
    fs.invalidate_cache()
    fs.get(f"{url}/4/", str(tmp_path / "4"), recursive=True)
    assert (tmp_path / "4" / "state" / "manifest.ocdbt").exists()
    item = abstract({**host_state(0), "zeros": np.ones((8, 4), np.float32)}, mesh_of(data=1, fsdp=4, tensor=1))
    restored = ocp.PyTreeCheckpointer().restore(tmp_path / "4" / "state", args=ocp.args.PyTreeRestore(
        item, ocp.checkpoint_utils.construct_restore_args(item)))
    assert matches(restored, host)


def _copy_to_bucket(local: Path, url: str) -> None:
    fs = object_store.filesystem(url)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{url}/{path.relative_to(local).as_posix()}")


def test_a_zarr_layout_checkpoint_still_restores_from_s3(servers, tmp_path, monkeypatch):
    """The layout s3:// checkpoints had before OCDBT (Orbax's non-OCDBT format: one zarr array
    per leaf, one object per chunk), made here by Orbax itself on disk and copied into the bucket."""
    def zarr_handler(directory):
        return ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    monkeypatch.setattr(checkpointer_module, "_pytree_handler", zarr_handler)
    local = tmp_path / "checkpoints"
    with Checkpointer(str(local), cfg()) as ck:
        ck.save(2, to_device(host_state(seed=2), mesh_of(data=1, fsdp=8, tensor=1)), {"step": 2})
    monkeypatch.undo()
    assert (local / "2" / "state" / "params.embed" / ".zarray").exists()
    assert not (local / "2" / "state" / "manifest.ocdbt").exists()
    url = f"s3://{BUCKET}/zarr-layout/checkpoints"
    _copy_to_bucket(local, url)
    ck = Checkpointer(url, cfg())
    assert ck.latest_step() == 2
    state, extra = ck.restore(2, abstract(host_state(0), mesh_of(data=2, fsdp=2, tensor=2)))
    assert matches(state, host_state(seed=2)) and extra == {"step": 2}


@pytest.mark.multiprocess
def test_two_processes_write_their_own_parts_and_share_replicated_writes(servers):
    """2 processes x 4 devices save 60 fsdp-sharded leaves and one replicated array: each process
    writes its own OCDBT database (a few objects each, not one per shard), both write half of
    the replicated array, and one process restores it all."""
    from test_checkpoint_multiprocess import run_workers
    url = f"s3://{BUCKET}/two/checkpoints"
    outputs = run_workers("s3_spread", url)
    assert all("SAVED OK" in out for out in outputs), outputs
    state = [o for o in objects(f"{url}/3/state")]
    assert len(state) <= 2 * 12 + 4, (len(state), state)  # was 60 x (8 + 1) + 2 zarr objects
    rows = {}
    for pid in (0, 1):
        keys = ocdbt_keys(f"{url}/3/state/ocdbt.process_{pid}")
        rows[pid] = sorted(k for k in keys if k.startswith("replicated/") and not k.endswith(".zarray"))
        assert sum(k.startswith("w") for k in keys) >= 60 * 4, keys  # its own shards of every leaf
    assert len(rows[0]) == len(rows[1]) == 4 and not set(rows[0]) & set(rows[1]), rows
    from test_checkpoint_multiprocess import spread_state
    host = spread_state()
    restored, _ = Checkpointer(url, cfg()).restore(3, abstract(host, mesh_of(data=1, fsdp=1, tensor=1)))
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(restored[k]), v, err_msg=k)
