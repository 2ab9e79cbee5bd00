"""The device mesh (axes: `jaxtrain.config.MESH_AXES`), built from the config and the devices.

The phase-2 checks that need the device counts are `jaxtrain.parallel.mesh_shape.validate_against_devices`
(JAX-free; re-exported here).

Device order follows the hardware (docs: README "Configs and parallelism"):
- one TPU slice, however many hosts it spans: JAX's topology-aware `create_device_mesh`, so the
  innermost axes (tensor, then fsdp) run along the ICI torus rings;
- several TPU slices (multislice), or several processes without slices (multi-node GPU, CPU
  processes): `create_hybrid_device_mesh`, slices (else processes) as the DCN granules. The DCN
  part of each axis is its outer part: `mesh.dcn_data` / `dcn_stage` / `dcn_fsdp` say how it is
  split; when none is set, the granules go to the outermost axes that divide by them (data
  first), as a process-major order would.
The order is chosen for the links alone, never for the data: each process loads the rows of
whichever batch shards its devices hold (`sharding.process_rows`), so a tensor ring that follows
the torus across two hosts makes both load the same rows, and nothing else changes.
`axis_crossings` says which axes cross hosts and slices (`jaxtrain inspect` prints it).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxtrain.config import DCN_MESH_AXES, MeshConfig
# JAX-free, the launcher uses them too; validate_against_devices (phase 2) is re-exported for the callers.
from jaxtrain.parallel.mesh_shape import AXES, dcn_split, resolve_mesh_shape, validate_against_devices  # noqa: F401

DCN_AXES = DCN_MESH_AXES  # axes that may span the slow network (mesh.dcn_<axis>)


def build_mesh(mesh_cfg: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` over `devices` (default: all) with axes `AXES` (`jaxtrain.config.MESH_AXES`).

    Raises:
      ConfigError: mesh sizes that do not fit the devices, or `mesh.dcn_*` that do not multiply
        to the number of slices or processes or do not divide their axis.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_mesh_shape(mesh_cfg, len(devices))
    return Mesh(device_grid(sizes, {a: getattr(mesh_cfg, f"dcn_{a}") for a in DCN_AXES}, devices), AXES)


def device_grid(sizes: dict[str, int], dcn: dict[str, int], devices: Sequence[Any]) -> np.ndarray:
    """The devices as an array with one dimension per mesh axis (`AXES`), in hardware order (module doc).

    Works on anything with `platform`, `device_kind`, `id`, `process_index` and, on TPU, `coords`,
    `core_on_chip` and `slice_index` (tests pass fake devices to play multi-host topologies).
    """
    shape = tuple(sizes[a] for a in AXES)
    processes = len({d.process_index for d in devices})
    slices = slice_count(devices)
    asked, by_process = dcn_split(sizes, dcn, processes, slices)  # the same check as validate_against_devices
    if asked:
        dcn_shape = tuple(asked.get(a, 1) for a in AXES)
    elif slices > 1 or (processes > 1 and devices[0].platform != "tpu"):
        by_process = slices <= 1
        dcn_shape = _outermost(shape, slices if slices > 1 else processes)
    else:
        by_process, dcn_shape = False, None  # one slice (any hosts) or one process
    if dcn_shape is None:
        return _whole(shape, devices)
    return mesh_utils.create_hybrid_device_mesh(tuple(s // d for s, d in zip(shape, dcn_shape)), dcn_shape, devices,
                                                process_is_granule=by_process, allow_split_physical_axes=True)


def slice_count(devices: Sequence[Any]) -> int:
    """The TPU slices `devices` span; 0 for devices without slices (GPU, CPU)."""
    return len({d.slice_index for d in devices}) if all(hasattr(d, "slice_index") for d in devices) else 0


def _whole(shape: tuple[int, ...], devices: Sequence[Any]) -> np.ndarray:
    """One network: topology-aware on TPU and GPU (fast links under the innermost axes); on other
    platforms process-major, so each host holds a contiguous block of the leading axes."""
    if devices[0].platform in ("tpu", "gpu"):
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.array(ordered, dtype=object).reshape(shape)


def _outermost(shape: tuple[int, ...], granules: int) -> tuple[int, ...] | None:
    """DCN shape putting `granules` on the outermost axes that divide by them, or None."""
    out, left = [], granules
    for size in shape:
        n = math.gcd(left, size)
        out.append(n)
        left //= n
    return tuple(out) if left == 1 else None


def axis_crossings(mesh: Mesh) -> dict[str, dict[str, bool]]:
    """Per mesh axis: does a step along it reach another host (process) or another slice?

    Returns {axis: {"crosses_hosts": bool, "crosses_slices": bool}}. An axis of size 1 crosses
    nothing. Devices without `slice_index` (GPU, CPU) count as one slice.
    """
    out = {}
    for i, name in enumerate(mesh.axis_names):
        row = {}
        for key, attr in (("crosses_hosts", "process_index"), ("crosses_slices", "slice_index")):
            ids = np.moveaxis(np.vectorize(lambda d: getattr(d, attr, 0), otypes=[int])(mesh.devices), i, 0)
            row[key] = bool((ids != ids[:1]).any())
        out[name] = row
    return out


def describe_crossings(crossings: dict[str, dict[str, bool]]) -> str:
    """One line for `axis_crossings`, e.g. 'mesh axes across hosts: data, fsdp; across slices: data'."""
    hosts = [a for a, c in crossings.items() if c["crosses_hosts"]]
    slices = [a for a, c in crossings.items() if c["crosses_slices"]]
    return (f"mesh axes across hosts: {', '.join(hosts) or 'none'}; "
            f"across slices (DCN): {', '.join(slices) or 'none'}")
