"""Elastic re-planning: the same run on fewer processes (`plan_shrink`), for isolating a bad node.

A JAX job cannot lose a process while it runs: continuing without a node is a restart with fewer
processes and a few overrides, which `plan_shrink` finds from the phase-1 config and the process
and device counts (no JAX: the mesh sizes come from `jaxtrain.parallel.mesh_shape`, the same code
the trainer builds its mesh with). Used by the Supervisor (`jaxtrain launch --isolate-after`) and by
`jaxtrain recovery shrink|decide` (train.sbatch, Kubernetes resizes by hand).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from jaxtrain.config import Config, ConfigError, load_config
from jaxtrain.parallel.mesh_shape import AXES, resolve_mesh_shape


class ShrinkRefused(Exception):
    """No smaller job trains the same thing; the message says why (the launcher then gives up)."""


@dataclasses.dataclass(frozen=True)
class Shrink:
    """A job with fewer processes that trains exactly what the larger one did.

    Attributes:
      processes: processes left.
      mesh: the resolved mesh sizes on the devices left (only `data` differs).
      grad_accum: the new `train.grad_accum`.
      overrides: `key=value` strings that turn the old command into the new one (later overrides win).
    """

    processes: int
    mesh: dict[str, int]
    grad_accum: int
    overrides: list[str]


def plan_shrink(cfg: Config, num_processes: int, devices_per_process: int, remove: int = 1) -> Shrink:
    """The job without `remove` of its processes, training the same run: same global batch, same data order.

    What stays: `data.global_batch_size` (so the data loader, whose global order depends only on the
    seed and the sample index, hands out the very same batches), and the model-parallel part of the
    mesh (`stage`, `fsdp`, `tensor`: each parameter keeps its sharding). What changes: `mesh.data`
    shrinks to the devices left, and `train.grad_accum` grows so that no device gets more rows per
    microbatch than before (memory stays within what the larger job used). The loss is the mean over
    all tokens of the step however it is split into microbatches, so the numbers change only by
    float summation order. The checkpoint restores onto the smaller mesh.

    Args:
      cfg: the config the job runs with now (phase-1 parsed, overrides applied).
      num_processes: processes in the job now.
      devices_per_process: devices each process drives.
      remove: processes to take away.
    Returns:
      The plan.
    Raises:
      ShrinkRefused: no process would be left, the devices left do not hold whole model replicas,
        FSDP or pipeline stages span hosts, or no `train.grad_accum` splits the global batch over the
        devices left.
    """
    left = num_processes - remove
    if left < 1:
        raise ShrinkRefused(f"no process would be left of {num_processes}")
    before, after = num_processes * devices_per_process, left * devices_per_process
    try:
        sizes = resolve_mesh_shape(cfg.mesh, before)
    except ConfigError as e:
        raise ShrinkRefused(f"the mesh does not fit {before} devices: {e}") from None
    model = sizes["stage"] * sizes["fsdp"] * sizes["tensor"]
    if after % model:
        raise ShrinkRefused(f"the {after} devices left ({left} processes x {devices_per_process}) do not split into "
                            f"model replicas of mesh.stage x mesh.fsdp x mesh.tensor = {model} devices")
    new = {**sizes, "data": after // model}
    overrides = ["mesh.data=-1"]
    # Any other axis set to -1 would grab the change instead of `data`: pin it to its current size.
    overrides += [f"mesh.{a}={sizes[a]}" for a in AXES[1:] if getattr(cfg.mesh, a) == -1]
    m = cfg.mesh
    if m.dcn_fsdp > 1:
        raise ShrinkRefused(f"mesh.dcn_fsdp={m.dcn_fsdp} spreads FSDP shards over hosts: without a host every "
                            "parameter would need another layout; isolation only shrinks data parallelism")
    if m.dcn_stage > 1:
        raise ShrinkRefused(f"mesh.dcn_stage={m.dcn_stage} spreads pipeline stages over hosts: without a host a "
                            "stage would be missing; isolation only shrinks data parallelism")
    if m.dcn_data > 1:  # the hybrid mesh needs one DCN slice per process (jaxtrain.parallel.mesh.build_mesh)
        if new["data"] % left:
            raise ShrinkRefused(f"mesh.data={new['data']} on the devices left is not divisible by the {left} "
                                "processes left (mesh.dcn_data must equal the process count)")
        overrides.append(f"mesh.dcn_data={left}")

    axes = cfg.mesh.rules.get("batch") or []
    axes = axes if isinstance(axes, list) else [axes]
    ways, ways_left = math.prod(sizes[a] for a in axes), math.prod(new[a] for a in axes)
    batch, accum = cfg.data.global_batch_size, cfg.train.grad_accum
    if batch % left:
        raise ShrinkRefused(f"data.global_batch_size={batch} is not divisible by the {left} processes left "
                            "(each process loads an equal share of every batch)")
    inner = [a for a in axes if a != "stage"]
    inner_ways = math.prod(new[a] for a in inner)
    lowest = -(-accum * ways // ways_left)  # no more rows per device and microbatch than before
    for candidate in range(lowest, batch + 1):
        micro = batch // candidate
        if batch % candidate or micro % ways_left:
            continue
        if new["stage"] > 1 and (micro % cfg.pipeline.microbatches
                                 or (micro // cfg.pipeline.microbatches) % inner_ways):
            continue
        overrides.append(f"train.grad_accum={candidate}")
        return Shrink(processes=left, mesh=new, grad_accum=candidate, overrides=overrides)
    raise ShrinkRefused(f"no train.grad_accum >= {lowest} splits data.global_batch_size={batch} into microbatches "
                        f"divisible by the {ways_left}-way data parallelism left "
                        f"({' x '.join(f'{a}={new[a]}' for a in axes)})")


def shrink_planner(config: str, overrides: list[str], devices_per_process: int) -> Callable[[int, list[str]], Shrink]:
    """`plan(processes_now, overrides_now)`: the job one process smaller, planned from the config as
    the processes run it now (the user's overrides, then those of earlier isolations).

    Args:
      config: the --config path of the `train` command.
      overrides: the user's `key=value` overrides.
      devices_per_process: devices each process drives.
    Returns:
      The planner; it raises ShrinkRefused when there is no smaller job, including when the shrunk
      config breaks a phase-1 rule.
    """
    def plan(processes: int, extra: list[str]) -> Shrink:
        try:
            cfg = load_config(config, [*overrides, *extra])
        except ConfigError as e:  # the shrunk config breaks a phase-1 rule: no valid shrink
            raise ShrinkRefused(str(e)) from None
        return plan_shrink(cfg, processes, devices_per_process)
    return plan
