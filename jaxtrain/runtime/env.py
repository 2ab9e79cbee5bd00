"""The `JAXTRAIN_*` environment variables: the one place their names are written in Python.

They are the contract between whoever starts a process (`jaxtrain launch`, `train.sbatch`, the
Kubernetes JobSet, the TPU launch script) and the process itself. The cluster recipes spell the
same names in shell/YAML; `tests/launch/test_env_contract.py` checks that every name they set is
one of these and that the ones a process needs are set. Only entry points read the environment
(`commands/`, `launch/`, and `trainer` at start-up, which hands the values down as arguments;
`host_malloc`, which `commands/startup.py` calls before JAX starts).
"""

from __future__ import annotations

import os

# Joining a job (`launch/distributed.py`).
COORDINATOR = "JAXTRAIN_COORDINATOR"  # host:port of process 0's coordination service
NUM_PROCESSES = "JAXTRAIN_NUM_PROCESSES"  # processes in the job
PROCESS_ID = "JAXTRAIN_PROCESS_ID"  # this process's index, 0 .. NUM_PROCESSES - 1
AUTO_DISTRIBUTED = "JAXTRAIN_AUTO_DISTRIBUTED"  # "1": a bare jax.distributed.initialize() (TPU pods, ...)

# Restarts and isolation.
RESTART_ATTEMPT = "JAXTRAIN_RESTART_ATTEMPT"  # 0 on the first attempt, n on the n-th restart
SLOT = "JAXTRAIN_SLOT"  # the launcher slot a process runs in; kept when another slot is isolated

# train.sbatch's bookkeeping (set and read by the script and its task wrapper).
SLURM_STATE = "JAXTRAIN_SLURM_STATE"  # folder of the job's attempts and failures
EXITS = "JAXTRAIN_EXITS"  # per-attempt file: one "time task node exit-code" line per task

# Tests: the host name this process reports in the job's host table (`stragglers.job_hosts`), in
# place of socket.gethostname(), so that processes on one machine can stand for several nodes
# (the preflight verdict compares intra-node with intra-node links). Never set on a cluster.
HOST = "JAXTRAIN_HOST"

# CPU runs: "default" leaves glibc malloc's settings as they are (`host_malloc.py` says why it
# changes them otherwise).
HOST_MALLOC = "JAXTRAIN_HOST_MALLOC"

# The file of measured peak FLOP/s (the MFU denominator where no datasheet peak is known), kept so that
# every run on a machine divides by the same number. Empty: measure at every start, keep nothing.
# Unset: `jaxtrain/peak_flops.json` in the user cache folder ($XDG_CACHE_HOME, else ~/.cache).
PEAK_CACHE = "JAXTRAIN_PEAK_CACHE"

# Where data files named by gs:// / s3:// URLs are copied before reading (`data/remote_files.py`).
# Unset: `jaxtrain/data` in the user cache folder ($XDG_CACHE_HOME, else ~/.cache).
DATA_CACHE = "JAXTRAIN_DATA_CACHE"

ALL = (COORDINATOR, NUM_PROCESSES, PROCESS_ID, AUTO_DISTRIBUTED, RESTART_ATTEMPT, SLOT, SLURM_STATE, EXITS, HOST,
       HOST_MALLOC, PEAK_CACHE, DATA_CACHE)

# Settings of the setup scripts themselves, never read by a jaxtrain process.
SCRIPT_SETTINGS = (
    "JAXTRAIN_VENV",  # train.sbatch: the virtualenv to activate on every node
    "JAXTRAIN_GPU_CHECK_PYTHON", "JAXTRAIN_GPU_CHECK_WHEELS", "JAXTRAIN_GPU_CHECK_TOTAL_S",  # gpu/check_all.sh
)


def restart_attempt(environ: os._Environ | dict = os.environ) -> int:
    """Which attempt of the job this process belongs to (0 unless a launcher says otherwise)."""
    return int(environ.get(RESTART_ATTEMPT, "0") or 0)


def launcher_slot(environ: os._Environ | dict = os.environ) -> int | None:
    """The `jaxtrain launch` slot of this process, or None outside the launcher."""
    value = environ.get(SLOT, "")
    return int(value) if value else None


def host_name(environ: os._Environ | dict = os.environ) -> str | None:
    """The host name this process stands for (JAXTRAIN_HOST), or None: the machine's own."""
    return environ.get(HOST) or None


def peak_cache_file(environ: os._Environ | dict = os.environ) -> str | None:
    """Where measured peak FLOP/s are kept (JAXTRAIN_PEAK_CACHE, else the user cache folder), or None."""
    if PEAK_CACHE in environ:
        return environ[PEAK_CACHE] or None
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxtrain", "peak_flops.json")


def data_cache_dir(environ: os._Environ | dict = os.environ) -> str:
    """Where remote data files are kept once copied (JAXTRAIN_DATA_CACHE, else the user cache folder)."""
    if environ.get(DATA_CACHE):
        return environ[DATA_CACHE]
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxtrain", "data")
