"""The mesh follows the hardware: on fake multi-host TPU slices, multislice pods and multi-node GPU
jobs, mesh-axis neighbours are physical neighbours and DCN axes cross slices (nodes) only.

Fake devices carry what `jax.experimental.mesh_utils` reads: `id`, `process_index`, `platform`,
`device_kind`, and on TPU `coords`, `core_on_chip`, `slice_index`. Hosts are laid out as on the
real slices: a TPU v4 / v5e host drives a 2x2 block of chips, ids run host by host.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxtrain.config import ConfigError, MeshConfig, load_config
from jaxtrain.parallel.mesh import AXES, axis_crossings, build_mesh, describe_crossings
from jaxtrain.parallel.sharding import batch_sharding, process_rows


@dataclasses.dataclass(frozen=True, eq=False)
class FakeTPU:
    id: int
    process_index: int
    coords: tuple[int, int, int]
    slice_index: int
    device_kind: str
    core_on_chip: int = 0
    platform: str = "tpu"


@dataclasses.dataclass(frozen=True, eq=False)
class FakeGPU:  # no coords, no slice_index: nodes are known only by their process
    id: int
    process_index: int
    device_kind: str = "NVIDIA H100 80GB HBM3"
    platform: str = "gpu"


def tpu_slice(dims: tuple[int, int, int], kind: str, *, slice_index: int = 0, first_id: int = 0,
              first_process: int = 0, host: tuple[int, int, int] = (2, 2, 1)) -> list[FakeTPU]:
    """A slice of dims chips; each host owns a `host` block; ids and processes run host by host."""
    X, Y, Z = dims
    chips = []
    for z in range(Z):
        for y in range(Y):
            for x in range(X):
                h = ((z // host[2]) * (Y // host[1]) + y // host[1]) * (X // host[0]) + x // host[0]
                chips.append((h, (x, y, z)))
    chips.sort()
    return [FakeTPU(first_id + i, first_process + h, c, slice_index, kind) for i, (h, c) in enumerate(chips)]


def multislice(n: int, dims, kind) -> list[FakeTPU]:
    per = int(np.prod(dims))
    hosts = per // 4
    return [d for s in range(n) for d in tpu_slice(dims, kind, slice_index=s, first_id=s * per,
                                                    first_process=s * hosts)]


def gpu_nodes(nodes: int, per_node: int = 8) -> list[FakeGPU]:
    return [FakeGPU(n * per_node + i, n) for n in range(nodes) for i in range(per_node)]


def hops(a: FakeTPU, b: FakeTPU, dims, wraps) -> int:
    """ICI hops between two chips of one slice: per dimension |d|, or min(|d|, n-|d|) where it wraps."""
    return sum(min(abs(p - q), n - abs(p - q)) if w else abs(p - q)
               for p, q, n, w in zip(a.coords, b.coords, dims, wraps))


def rings(grid: np.ndarray, axis: int):
    """Every 1-D line of devices along `axis` of the grid."""
    moved = np.moveaxis(grid, axis, -1)
    return moved.reshape(-1, moved.shape[-1])


def assert_rings_are_one_hop(grid, axes: tuple[str, ...], dims, wraps, closed: bool) -> None:
    for name in axes:
        for line in rings(grid, AXES.index(name)):
            steps = [hops(a, b, dims, wraps) for a, b in zip(line[:-1], line[1:])]
            assert steps == [1] * (len(line) - 1), (name, [d.coords for d in line], steps)
            if closed:  # the torus wraps this ring: the last device is one hop from the first
                assert hops(line[-1], line[0], dims, wraps) == 1, (name, [d.coords for d in line])


def mesh_of(devices, **sizes) -> Mesh:
    return build_mesh(MeshConfig(**sizes), devices)


# ------------------------------------------------------------------------------------------------
# One slice spanning several hosts: topology-aware, whatever the number of processes.
# ------------------------------------------------------------------------------------------------


def test_v5e_16_on_four_hosts_puts_fsdp_and_data_on_ici_lines():
    """v5litepod-16: a 4x4 grid of chips (no wraparound), 4 hosts of 2x2. Sorting by process put
    fsdp=4 on one host's 2x2 block: (0,0) (1,0) (0,1) (1,1), a 2-hop step in the middle."""
    devices = tpu_slice((4, 4, 1), "TPU v5 lite")
    assert len({d.process_index for d in devices}) == 4
    mesh = mesh_of(devices, data=4, fsdp=4)
    assert_rings_are_one_hop(mesh.devices, ("data", "fsdp"), (4, 4, 1), (False,) * 3, closed=False)
    crossings = axis_crossings(mesh)
    assert crossings["fsdp"] == {"crosses_hosts": True, "crosses_slices": False}
    assert crossings["data"] == {"crosses_hosts": True, "crosses_slices": False}
    assert not crossings["stage"]["crosses_hosts"] and not crossings["tensor"]["crosses_hosts"]


def test_v5e_16_fsdp_16_is_one_closed_ring_over_four_hosts():
    """fsdp=16 on the 4x4 grid: a snake through all 16 chips, each step one hop, back to the start."""
    mesh = mesh_of(tpu_slice((4, 4, 1), "TPU v5 lite"), data=1, fsdp=16)
    assert_rings_are_one_hop(mesh.devices, ("fsdp",), (4, 4, 1), (False,) * 3, closed=True)


def test_v4_full_cube_on_sixteen_hosts_uses_the_wraparound_rings():
    """v4-128: a 4x4x4 cube (a torus: every dimension wraps), 16 hosts of 2x2x1. data, stage and
    fsdp of 4 each get one torus dimension, a closed ring of one-hop steps."""
    devices = tpu_slice((4, 4, 4), "TPU v4")
    mesh = mesh_of(devices, data=4, stage=4, fsdp=4)
    assert_rings_are_one_hop(mesh.devices, ("data", "stage", "fsdp"), (4, 4, 4), (True,) * 3, closed=True)


def batch_owners(mesh: Mesh) -> dict[tuple, set[int]]:
    """(data, stage, fsdp) index -> the processes holding a device there."""
    out: dict[tuple, set[int]] = {}
    for index in np.ndindex(mesh.devices.shape):
        out.setdefault(index[:3], set()).add(mesh.devices[index].process_index)
    return out


def test_a_tensor_ring_across_hosts_follows_the_torus_and_both_hosts_load_its_rows():
    """Topology-aware tensor=4 on v5e-16 is a line of chips over two hosts. The mesh keeps it (it
    used to fall back to hosts as granules, a 2-hop tensor ring); both hosts then load the rows
    of every batch shard they touch, and only those."""
    mesh = mesh_of(tpu_slice((4, 4, 1), "TPU v5 lite"), data=1, fsdp=4, tensor=4)
    assert_rings_are_one_hop(mesh.devices, ("fsdp", "tensor"), (4, 4, 1), (False,) * 3, closed=False)
    assert axis_crossings(mesh)["tensor"]["crosses_hosts"]
    owners = batch_owners(mesh)
    assert any(len(p) > 1 for p in owners.values())  # hosts do share batch shards now
    batch = 16
    rows = {p: process_rows(mesh, MeshConfig().rules, batch, p) for p in range(4)}
    per_shard = batch // 4  # fsdp=4 splits the batch
    for (_, _, fsdp), processes in owners.items():
        shard = set(range(fsdp * per_shard, (fsdp + 1) * per_shard))
        for p in range(4):
            assert (shard <= set(rows[p].tolist())) == (p in processes), (fsdp, p)
    assert all(len(r) == 2 * per_shard for r in rows.values())  # each host: two shards, twice B/P


@pytest.mark.parametrize("sizes", [dict(data=4, fsdp=4), dict(data=1, fsdp=4, tensor=4), dict(data=2, fsdp=2, tensor=4),
                                   dict(data=2, stage=2, fsdp=4)])
def test_process_rows_are_the_rows_of_the_batch_shards_jax_places_on_each_process(sizes):
    """`process_rows` against JAX's own placement of a [batch] array under the batch sharding."""
    mesh = mesh_of(tpu_slice((4, 4, 1), "TPU v5 lite"), **sizes)
    rules, batch = MeshConfig().rules, 32
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(batch_sharding(mesh, rules).spec[0]))
    for p in range(4):
        want = sorted({r for d, (index,) in sharding.devices_indices_map((batch,)).items() if d.process_index == p
                       for r in range(*index.indices(batch))})
        assert process_rows(mesh, rules, batch, p).tolist() == want


def test_one_slice_of_several_hosts_has_no_dcn_axis():
    devices = tpu_slice((4, 4, 1), "TPU v5 lite")
    crossings = axis_crossings(mesh_of(devices, data=2, fsdp=4, tensor=2))
    assert not any(c["crosses_slices"] for c in crossings.values())
    assert all(len(p) == 1 for p in batch_owners(mesh_of(devices, data=2, fsdp=4, tensor=2)).values())


# ------------------------------------------------------------------------------------------------
# Multislice TPU and multi-node GPU: the hybrid mesh, DCN axes across slices / nodes only.
# ------------------------------------------------------------------------------------------------


def slice_of(grid: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: getattr(d, "slice_index", d.process_index), otypes=[int])(grid)


def assert_dcn_only_on(mesh: Mesh, dcn_axes: tuple[str, ...]) -> None:
    """Only `dcn_axes` cross slices, and each of them only at its outer (DCN) part: within one
    block of ici devices along the axis, the slice does not change."""
    crossings = axis_crossings(mesh)
    for name in AXES:
        assert crossings[name]["crosses_slices"] == (name in dcn_axes), (name, crossings)


@pytest.mark.parametrize("dcn", [{}, {"dcn_data": 2}])
def test_two_v5e_16_slices_put_data_across_slices_and_rings_inside(dcn):
    devices = multislice(2, (4, 4, 1), "TPU v5 lite")  # 32 chips, 8 hosts, 2 slices
    mesh = mesh_of(devices, data=2, fsdp=16, **dcn)
    assert_dcn_only_on(mesh, ("data",))
    for s in range(2):  # each slice holds one data index, with a closed ICI ring under fsdp
        block = mesh.devices[s:s + 1]
        assert (slice_of(block) == s).all()
        assert_rings_are_one_hop(block, ("fsdp",), (4, 4, 1), (False,) * 3, closed=True)


def test_dcn_fsdp_splits_fsdp_into_slices_outer_and_ici_inner():
    devices = multislice(2, (4, 4, 1), "TPU v5 lite")
    mesh = mesh_of(devices, data=1, fsdp=32, dcn_fsdp=2)
    assert_dcn_only_on(mesh, ("fsdp",))
    ids = slice_of(mesh.devices)[0, 0, :, 0]
    assert (ids[:16] == 0).all() and (ids[16:] == 1).all()  # fsdp 0-15 on slice 0, 16-31 on slice 1
    for s in range(2):
        assert_rings_are_one_hop(mesh.devices[:, :, 16 * s:16 * s + 16], ("fsdp",), (4, 4, 1), (False,) * 3,
                                 closed=True)


def test_dcn_stage_puts_pipeline_stages_across_slices():
    devices = multislice(2, (4, 4, 4), "TPU v4")  # 128 chips, 2 slices
    mesh = mesh_of(devices, data=16, stage=2, fsdp=4, dcn_stage=2)
    assert_dcn_only_on(mesh, ("stage",))
    assert (slice_of(mesh.devices[:, 0]) == 0).all() and (slice_of(mesh.devices[:, 1]) == 1).all()
    assert_rings_are_one_hop(mesh.devices[:, :1], ("fsdp",), (4, 4, 4), (True,) * 3, closed=True)


def test_multi_node_gpu_uses_processes_as_dcn_granules():
    devices = gpu_nodes(2)
    mesh = mesh_of(devices, data=1, stage=2, fsdp=8, dcn_stage=2)
    crossings = axis_crossings(mesh)
    assert crossings["stage"]["crosses_hosts"] and not crossings["fsdp"]["crosses_hosts"]
    assert (slice_of(mesh.devices[0, 0]) == 0).all() and (slice_of(mesh.devices[0, 1]) == 1).all()
    # No dcn_* set: the nodes go to the outermost axis that divides by them (data), NVLink inside.
    auto = axis_crossings(mesh_of(gpu_nodes(4), data=4, fsdp=8))
    assert [a for a, c in auto.items() if c["crosses_hosts"]] == ["data"]


@pytest.mark.parametrize("sizes", [dict(data=8), dict(data=1, fsdp=8), dict(data=2, fsdp=4),
                                   dict(data=2, fsdp=2, tensor=2), dict(data=1, stage=2, fsdp=4)])
def test_cpu_processes_keep_the_process_major_order(sizes):
    """CPU processes (`jaxtrain launch`, the tests) get exactly the old process-major mesh."""
    @dataclasses.dataclass(frozen=True, eq=False)
    class FakeCPU:
        id: int
        process_index: int
        platform: str = "cpu"
        device_kind: str = "cpu"
    devices = [FakeCPU(i, i // 2) for i in range(8)]  # 4 processes of 2 devices
    grid = build_mesh(MeshConfig(**sizes), devices).devices
    want = np.array(sorted(devices, key=lambda d: (d.process_index, d.id)), dtype=object).reshape(grid.shape)
    assert (grid == want).all()


def test_dcn_sizes_that_match_neither_slices_nor_processes_are_refused():
    with pytest.raises(ConfigError, match=r"= 4 must equal the 2 slice\(s\) or 8 process\(es\)"):
        mesh_of(multislice(2, (4, 4, 1), "TPU v5 lite"), data=4, fsdp=2, tensor=4, dcn_data=4)
    with pytest.raises(ConfigError, match="mesh.stage=1 is not divisible by mesh.dcn_stage=2"):
        mesh_of(multislice(2, (4, 4, 1), "TPU v5 lite"), data=2, fsdp=4, tensor=4, dcn_data=1, dcn_stage=2)


def test_dcn_keys_are_validated():
    with pytest.raises(ConfigError, match="mesh.dcn_stage"):
        load_config(None, ["mesh.dcn_stage=0"])


# ------------------------------------------------------------------------------------------------
# What `jaxtrain inspect` says.
# ------------------------------------------------------------------------------------------------


def test_inspect_reports_which_axes_cross_hosts_and_slices():
    assert describe_crossings(axis_crossings(mesh_of(multislice(2, (4, 4, 1), "TPU v5 lite"), data=2, fsdp=16))) == (
        "mesh axes across hosts: data, fsdp; across slices (DCN): data")
    from jaxtrain.observe.inspection import format_report, inspect_report
    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.num_layers=1", "model.num_heads=2",
                             "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.attention=xla",
                             "data.seq_len=8", "data.global_batch_size=2", "mesh.data=2",
                             "checkpoint.compilation_cache_dir=null"])
    report = inspect_report(cfg, jax.devices()[:2])
    assert report["mesh_crossings"] == {a: {"crosses_hosts": False, "crosses_slices": False} for a in AXES}
    assert "mesh axes across hosts: none; across slices (DCN): none" in format_report(report)


def test_isolating_a_host_refuses_a_job_whose_stages_span_hosts():
    from jaxtrain.launch.elastic import ShrinkRefused, plan_shrink
    cfg = load_config(None, ["data.global_batch_size=8", "mesh.stage=2", "mesh.dcn_stage=2", "pipeline.microbatches=2",
                             "model.num_layers=2"])
    with pytest.raises(ShrinkRefused, match="mesh.dcn_stage=2 spreads pipeline stages over hosts"):
        plan_shrink(cfg, 2, 2)
