"""The mesh's axis names and sizes, from the config and a device count alone (no JAX).

The one implementation of "fill the `-1` axis with the devices left": `mesh.py` builds the device
mesh with it, and the launcher (`jaxtrain.launch.elastic`, which must not import JAX) plans a
smaller job with it. Also phase 2 of the config checks, `validate_against_devices`: every rule that
needs the device, process (and slice) counts, in one call made before anything is built.
"""

from __future__ import annotations

import math

from jaxtrain.config import (DCN_MESH_AXES, MESH_AXES, Config, ConfigError, MeshConfig, validate_context,
                             validate_pipeline)

AXES = MESH_AXES  # the mesh axes, outermost first: one list, kept in jaxtrain.config (which imports nothing here)


def resolve_mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Sizes for every mesh axis, filling the one `-1` axis with the remaining devices.

    Raises:
      ConfigError: a size that is neither positive nor -1, or sizes that do not multiply to `num_devices`.
    """
    sizes = {a: getattr(mesh_cfg, a) for a in AXES}
    for a, v in sizes.items():  # load_config checks this too; a MeshConfig built in Python may skip it
        if v == 0 or v < -1:
            raise ConfigError(f"config key 'mesh.{a}' must be a positive size or -1 (fill), got {v}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [a for a, v in sizes.items() if v == -1]
    described = ", ".join(f"{a}={v}" for a, v in sizes.items())
    if fill:
        if num_devices % fixed:
            raise ConfigError(f"mesh ({described}) does not divide the {num_devices} devices: "
                              f"the fixed axes multiply to {fixed}")
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(f"mesh ({described}) multiplies to {fixed} but there are {num_devices} devices; "
                          "make the product match or set one axis to -1")
    return sizes


def dcn_split(sizes: dict[str, int], dcn: dict[str, int], processes: int, slices: int) -> tuple[dict[str, int], bool]:
    """The DCN split `mesh.dcn_*` ask for, checked against the job: (axis -> ways, for the axes split
    more than 1 way; whether each process, not each slice, is a granule). ({}, False) when none is
    asked or the job has no DCN (one process on at most one slice). `slices`: the TPU slices, 0 for
    devices without slices (GPU, CPU).

    Raises:
      ConfigError: the split does not multiply to the slices or processes, or does not divide its axis.
    """
    asked = {a: n for a, n in dcn.items() if n > 1}
    if not asked or (processes == 1 and slices <= 1):
        return {}, False  # one process on one slice has no DCN: mesh.dcn_* apply to multi-host jobs only
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
    return asked, by_process


def validate_against_devices(cfg: Config, num_devices: int, num_processes: int = 1,
                             under_launcher: bool = False, *, num_slices: int | None = None) -> dict[str, int]:
    """Phase 2: every rule that needs the device and process counts. Returns the resolved mesh sizes.

    Runs once, after distributed init and before anything is built or written (the counts are not
    known before that). Per-parameter divisibility is checked later by `sharding.param_shardings`,
    the attention kernel against the platform by `jaxtrain.model.attention.resolve_attention`.
    `under_launcher`: the processes run in `jaxtrain launch` slots (`chaos.crash_process` then
    names a slot, which may be an isolated one, not a process of this job). `num_slices`: the TPU
    slices (0: devices without slices; `jaxtrain.parallel.mesh.slice_count`); given, the `mesh.dcn_*`
    split is checked here too, else only when the mesh is built.
    """
    cfg.chaos.validate_processes(num_processes, under_launcher)
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
    if num_slices is not None:
        dcn_split(sizes, {a: getattr(cfg.mesh, f"dcn_{a}") for a in DCN_MESH_AXES}, num_processes, num_slices)
    return sizes
