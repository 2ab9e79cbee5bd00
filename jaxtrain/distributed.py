"""Joining a multi-process JAX job: one process per host.

Where the coordinates come from, in order:
1. `JAXTRAIN_COORDINATOR`, `JAXTRAIN_NUM_PROCESSES`, `JAXTRAIN_PROCESS_ID` (set by `jaxtrain launch`
   and by the Kubernetes / TPU VM recipes in tpu_gpu_setup/);
2. a cluster JAX detects by itself (SLURM `srun`, TPU pods, Open MPI): `jax.distributed.initialize()`;
3. otherwise a single process, no initialization.
On the CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import os

import jax


def cluster_env() -> dict[str, str | int] | None:
    """Explicit coordinates from JAXTRAIN_* variables, or None."""
    addr = os.environ.get("JAXTRAIN_COORDINATOR")
    if not addr:
        return None
    return {"coordinator_address": addr,
            "num_processes": int(os.environ["JAXTRAIN_NUM_PROCESSES"]),
            "process_id": int(os.environ["JAXTRAIN_PROCESS_ID"])}


def _autodetected_cluster() -> bool:
    # SLURM only counts when the job step has more than one task (a plain `salloc` shell has one).
    if int(os.environ.get("SLURM_NTASKS", os.environ.get("SLURM_STEP_NUM_TASKS", "1"))) > 1:
        return True
    return "OMPI_COMM_WORLD_SIZE" in os.environ and int(os.environ["OMPI_COMM_WORLD_SIZE"]) > 1


def initialize(timeout_s: int = 300) -> None:
    """Join the job if this process is part of one. Must run before any JAX computation."""
    explicit = cluster_env()
    if explicit is None and not _autodetected_cluster():
        return
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator_hint():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit is not None:
        jax.distributed.initialize(**explicit, initialization_timeout=timeout_s)
    else:
        jax.distributed.initialize(initialization_timeout=timeout_s)


def _has_accelerator_hint() -> bool:
    return any(k in os.environ for k in ("CUDA_VISIBLE_DEVICES", "TPU_NAME", "TPU_WORKER_ID")) or os.path.exists("/dev/nvidia0")
