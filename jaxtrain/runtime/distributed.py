"""Joining a multi-process JAX job: one process per host.

Where the coordinates come from, in order:
1. `JAXTRAIN_COORDINATOR`, `JAXTRAIN_NUM_PROCESSES`, `JAXTRAIN_PROCESS_ID` (set by `jaxtrain launch`
   and by the Kubernetes / TPU VM recipes in tpu_gpu_setup/);
2. a cluster JAX detects by itself: SLURM `srun` or Open MPI `mpirun` with more than one task, or
   any cluster JAX knows (TPU pods, ...) when `JAXTRAIN_AUTO_DISTRIBUTED=1` forces a bare
   `jax.distributed.initialize()`;
3. otherwise a single process, no initialization.
On the CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import math
import os

import jax

from jaxtrain.runtime import env
from jaxtrain.config import FaultConfig
from jaxtrain.runtime.xla_cpu import has_accelerator_hint


def cluster_env() -> dict[str, str | int] | None:
    """Explicit coordinates from JAXTRAIN_* variables, or None."""
    addr = os.environ.get(env.COORDINATOR)
    if not addr:
        return None
    return {"coordinator_address": addr,
            "num_processes": int(os.environ[env.NUM_PROCESSES]),
            "process_id": int(os.environ[env.PROCESS_ID])}


def _autodetected_cluster() -> bool:
    if os.environ.get(env.AUTO_DISTRIBUTED) == "1":
        return True
    # SLURM only counts when the job step has more than one task (a plain `salloc` shell has one).
    if int(os.environ.get("SLURM_NTASKS", os.environ.get("SLURM_STEP_NUM_TASKS", "1"))) > 1:
        return True
    return "OMPI_COMM_WORLD_SIZE" in os.environ and int(os.environ["OMPI_COMM_WORLD_SIZE"]) > 1


def initialize(timeout_s: float = FaultConfig.startup_timeout_s) -> None:
    """Join the job if this process is part of one. Must run before any JAX computation.

    `timeout_s`: how long to wait for every process to join, which is part of start-up, so the
    `jaxtrain` command passes fault.startup_timeout_s (on Kubernetes, pods of one job may start
    minutes apart); JAX takes whole seconds.
    """
    explicit = cluster_env()
    if explicit is None and not _autodetected_cluster():
        return
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not has_accelerator_hint():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = max(1, math.ceil(timeout_s))
    if explicit is not None:
        jax.distributed.initialize(**explicit, initialization_timeout=timeout)
    else:
        jax.distributed.initialize(local_device_ids=_slurm_local_device_ids(), initialization_timeout=timeout)


def _slurm_local_device_ids() -> list[int] | None:
    """All of the node's GPUs when SLURM runs one task per node.

    JAX's SLURM detection gives each task the single GPU numbered SLURM_LOCALID (right for one
    task per GPU); with one task per node that would leave all but GPU 0 idle.
    """
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", os.environ.get("SLURM_NTASKS_PER_NODE", ""))
    if per_node.split("(")[0] != "1":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        count = len(visible.split(","))
    else:  # /dev/nvidia0, /dev/nvidia1, ... (not nvidiactl, nvidia-uvm)
        count = sum(1 for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit())
    return list(range(count)) if count else None

