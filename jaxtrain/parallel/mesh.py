"""The device mesh (axes data, stage, fsdp, expert, context, tensor) and the phase-2 checks that need devices.

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

from jaxtrain.config import DCN_MESH_AXES, Config, ConfigError, MeshConfig, validate_context, validate_pipeline
from jaxtrain.parallel.mesh_shape import AXES, resolve_mesh_shape  # JAX-free: the launcher uses them too

DCN_AXES = DCN_MESH_AXES  # axes that may span the slow network (mesh.dcn_<axis>)


def build_mesh(mesh_cfg: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` over `devices` (default: all) with axes (data, stage, fsdp, expert, context, tensor).

    Raises:
      ConfigError: mesh sizes that do not fit the devices, or `mesh.dcn_*` that do not multiply
        to the number of slices or processes or do not divide their axis.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_mesh_shape(mesh_cfg, len(devices))
    return Mesh(device_grid(sizes, {a: getattr(mesh_cfg, f"dcn_{a}") for a in DCN_AXES}, devices), AXES)


def device_grid(sizes: dict[str, int], dcn: dict[str, int], devices: Sequence[Any]) -> np.ndarray:
    """The devices as an array of shape (data, stage, fsdp, expert, context, tensor) in hardware order (module doc).

    Works on anything with `platform`, `device_kind`, `id`, `process_index` and, on TPU, `coords`,
    `core_on_chip` and `slice_index` (tests pass fake devices to play multi-host topologies).
    """
    shape = tuple(sizes[a] for a in AXES)
    processes = len({d.process_index for d in devices})
    slices = len({d.slice_index for d in devices}) if all(hasattr(d, "slice_index") for d in devices) else 0
    asked = {a: n for a, n in dcn.items() if n > 1}
    if asked and processes == 1 and slices <= 1:
        asked = {}  # one process on one slice has no DCN: mesh.dcn_* apply to multi-host jobs only
    if asked:
        granules = math.prod(asked.values())
        if slices > 1 and granules == slices:
            by_process = False
        elif granules == processes:
            by_process = True  # one DCN granule per process (GPU nodes, CPU processes, or hosts asked for)
        else:
            where = f"{slices} slice(s) or {processes} process(es)" if slices else f"{processes} process(es)"
            product = " * ".join(f"mesh.dcn_{a}={n}" for a, n in asked.items())
            raise ConfigError(f"{product} = {granules} must equal the {where} (one DCN granule each)")
        for a, n in asked.items():
            if sizes[a] % n:
                raise ConfigError(f"mesh.{a}={sizes[a]} is not divisible by mesh.dcn_{a}={n}")
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


def validate_against_devices(cfg: Config, num_devices: int, num_processes: int = 1,
                             under_launcher: bool = False) -> dict[str, int]:
    """Phase 2: rules that need the device and process counts. Returns the resolved mesh sizes.

    Runs after distributed init and before anything is written (the counts are not known
    before that). Per-parameter divisibility is checked later by `sharding.param_shardings`.
    `under_launcher`: the processes run in `jaxtrain launch` slots (`chaos.crash_process` then
    names a slot, which may be an isolated one, not a process of this job).
    """
    c = cfg.chaos
    drills = {"chaos.kill_process": (c.kill_process, c.kill_at_step >= 0),
              "chaos.slow_process": (c.slow_process, c.slow_seconds > 0 or c.start_delay_s > 0),
              "chaos.hang_process": (c.hang_process, c.hang_at_step >= 0),
              "chaos.raise_process": (c.raise_process, c.raise_at_step >= 0),
              **{key: (p, True) for key, p in c.slow_link_ends().items()}}
    if not under_launcher:  # under `jaxtrain launch` it is a slot, which may be an isolated one
        drills["chaos.crash_process"] = (c.crash_process, c.crash_process >= 0)
    for key, (process, enabled) in drills.items():
        if enabled and not 0 <= process < num_processes:
            raise ConfigError(f"{key}={process} names no process of this job: it has {num_processes} "
                              f"process(es), numbered 0 to {num_processes - 1}")
    sizes = resolve_mesh_shape(cfg.mesh, num_devices)
    batch_axes = cfg.mesh.rules.get("batch") or []
    batch_axes = batch_axes if isinstance(batch_axes, list) else [batch_axes]
    batch_ways = math.prod(sizes[a] for a in batch_axes)
    micro = cfg.data.global_batch_size // cfg.train.grad_accum
    if micro % batch_ways:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} / train.grad_accum={cfg.train.grad_accum} "
            f"= {micro} sequences per microbatch is not divisible by the {batch_ways}-way data parallelism "
            f"({' x '.join(f'{a}={sizes[a]}' for a in batch_axes)})")
    validate_pipeline(cfg, sizes["stage"])  # again: mesh.stage=-1 is resolved only now
    validate_context(cfg, sizes["context"])  # again for mesh.context=-1
    if sizes["stage"] > 1:
        # Inside the pipeline each microbatch is split over the batch axes other than `stage`.
        inner = [a for a in batch_axes if a != "stage"]
        inner_ways = math.prod(sizes[a] for a in inner)
        rows = micro // cfg.pipeline.microbatches
        if rows % inner_ways:
            raise ConfigError(
                f"{micro} sequences per model call (global_batch_size / grad_accum) / pipeline.microbatches="
                f"{cfg.pipeline.microbatches} = {rows} per pipeline microbatch is not divisible by the "
                f"{inner_ways}-way data parallelism inside a stage ({' x '.join(f'{a}={sizes[a]}' for a in inner)}); "
                "use fewer microbatches or a larger batch")
    # Query heads must divide; kv heads need not: fewer kv heads than the tensor degree are
    # replicated (jaxtrain.parallel.sharding.REPLICATED_WHEN_SMALL), as MaxText does.
    axis = cfg.mesh.rules.get("heads")
    for a in (axis if isinstance(axis, list) else [axis]):
        if a is not None and cfg.model.num_heads % sizes[a]:
            raise ConfigError(
                f"model.num_heads={cfg.model.num_heads} is not divisible by mesh.{a}={sizes[a]} "
                f"(mesh.rules maps 'heads' to '{a}'); pick a {a} size that divides it")
    return sizes
