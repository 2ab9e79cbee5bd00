"""The device mesh (axes data, stage, fsdp, tensor) and the phase-2 checks that need devices.

On one host the mesh is the devices reshaped in order; on several hosts the slow data-centre
network (DCN) axes are outermost, so only `data`/`fsdp` traffic crosses hosts and each host's
devices form a contiguous block of the batch (the data loader relies on that).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxtrain.config import Config, ConfigError, MeshConfig, validate_pipeline
from jaxtrain.parallel.mesh_shape import AXES, resolve_mesh_shape  # JAX-free: the launcher uses them too


def build_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` over `devices` (default: all) with axes (data, stage, fsdp, tensor)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_mesh_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    num_processes = len({d.process_index for d in devices})
    dcn = {"data": mesh_cfg.dcn_data, "fsdp": mesh_cfg.dcn_fsdp}
    if num_processes > 1 and math.prod(dcn.values()) > 1:
        if math.prod(dcn.values()) != num_processes:
            raise ConfigError(f"mesh.dcn_data * mesh.dcn_fsdp = {math.prod(dcn.values())} must equal the "
                              f"{num_processes} processes (one DCN slice per host)")
        for a, n in dcn.items():
            if sizes[a] % n:
                raise ConfigError(f"mesh.{a}={sizes[a]} is not divisible by mesh.dcn_{a}={n}")
        dcn_shape = tuple(dcn.get(a, 1) for a in AXES)
        ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape))
        # TPU multislice groups devices by slice; GPU and CPU hosts have no slices: group by process.
        by_process = devices[0].platform != "tpu"
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices, process_is_granule=by_process,
                                                    allow_split_physical_axes=True)
    elif devices[0].platform in ("tpu", "gpu") and num_processes == 1:
        # Topology-aware placement puts the fast links under the innermost (tensor) axis.
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        # Process-major order: each host owns a contiguous block of the leading axes.
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        grid = np.array(ordered, dtype=object).reshape(shape)
    return Mesh(grid, AXES)


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
