"""Straggler detection: which process makes the whole job wait, compared every N steps.

In a synchronous SPMD job every process's step takes as long as the slowest one's: the others wait
for it inside the step's collectives. So wall time per step says nothing about who is slow; the
time each process spends *not* waiting does. The loop measures, per step, this process's busy time
(the step's wall time minus every wait that is not its own work: dispatching the step and reading
its results, which block on the device and, through its collectives, on peers; the preemption
agreement; a save's barriers and all-finite check; the resume report) and its data-wait time. The
first step after a start or restart is left out: it measures who arrived first, not who is slow.

Every `fault.straggler_every` steps the per-process means over the window are gathered in one tiny
device all-gather that is read a step later (`hostcomm.LateAllGather`: no per-step
synchronisation, the host never waits for it), and a process whose busy time exceeds
`fault.straggler_factor` x the median of the *other* processes (and by at least a tenth of a step:
milliseconds are noise) in PERSIST_WINDOWS windows running is reported in a `straggler` event naming
its index and host, with its times, and again in every later window it stays slow. One slow window
is not a straggler: a garbage-collection pause, a log flush or a neighbour's burst on a shared host
makes one window of a process slow without anything to fix (and the first window after a start
may hold a single step). Every process computes the same table, so they agree without talking
further.

What this sees: slow hosts (CPU contention, a slow input pipeline, swapping, a throttled host
process). A slow accelerator shows as everyone's wait inside the collectives instead: the
preflight check (`preflight.py`) measures each device's matmul rate for that.
"""

from __future__ import annotations

import collections
import socket
from typing import Any, Callable, Optional

import numpy as np
from jax.sharding import Mesh

from jaxtrain.config import FaultConfig
from jaxtrain.runtime.hostcomm import LateAllGather

MIN_COST = 0.1  # a straggler costs the job at least this fraction of a step
PERSIST_WINDOWS = 2  # slow in this many compared windows running before the first report


class Stragglers:
    """Feed `after_step(step, busy_s, data_wait_s)` every step; events come out every N steps."""

    def __init__(self, cfg: FaultConfig, mesh: Mesh, process_index: int, process_count: int,
                 hosts: list[str], event: Callable[..., None]):
        self.every, self.factor = cfg.straggler_every, cfg.straggler_factor
        self.process_index, self.process_count = process_index, process_count
        self.hosts = hosts
        self.event = event
        self.enabled = self.every > 0 and process_count > 1
        self.reports: collections.Counter[int] = collections.Counter()  # process -> straggler reports so far
        self.slow_windows: collections.Counter[int] = collections.Counter()  # process -> slow windows running
        self._busy: list[float] = []
        self._wait: list[float] = []
        self._wall: list[float] = []
        self._gather = LateAllGather(mesh) if self.enabled else None
        self.last_table: np.ndarray | None = None  # the last window's table, every process (live metrics read it)

    def after_step(self, step: int, busy_s: float, data_wait_s: float, wall_s: float) -> None:
        """This process's busy, data-wait and wall seconds of the step just taken."""
        if not self.enabled:
            return
        self._busy.append(busy_s)
        self._wait.append(data_wait_s)
        self._wall.append(wall_s)
        table = self._gather.result(step)
        if table is not None:
            self.last_table = table
            self._judge(step - 1, table)
        if step % self.every == 0:
            self._gather.start(step, np.array([np.mean(self._busy), np.mean(self._wait), len(self._busy),
                                               np.mean(self._wall)]))
            self._busy, self._wait, self._wall = [], [], []

    def ratio(self, process: int) -> Optional[float]:
        """`process`'s busy time over the median of the others' in the last compared window (None
        before the first comparison). Read by the live metrics, from another thread."""
        table = self.last_table
        if table is None or len(table) < 2:
            return None
        reference = float(busy_references(table[:, 0])[process])
        return float(table[process, 0]) / reference if reference > 0 else None

    def _judge(self, step: int, table: np.ndarray) -> None:
        slow = dict(slow_processes(table[:, 0], table[:, 3], self.factor))
        for process in range(len(table)):
            self.slow_windows[process] = self.slow_windows[process] + 1 if process in slow else 0
        for process, reference in slow.items():
            if self.slow_windows[process] < PERSIST_WINDOWS:
                continue
            b, w, n, _ = table[process]
            self.reports[process] += 1
            self.event("straggler", step, process=process, host=self.hosts[process], busy_s=round(float(b), 4),
                       median_busy_s=round(float(reference), 4), data_wait_s=round(float(w), 4), steps=int(n),
                       factor=round(float(b / reference), 2) if reference > 0 else None,
                       windows=self.slow_windows[process], reports=self.reports[process])


def busy_references(busy: np.ndarray) -> np.ndarray:
    """For each process, the median busy time of the *other* processes (NaN with one process).

    The reference leaves the candidate out: with the candidate in, two processes' median is their
    mean, which no process can exceed twice over (so factor 2 could never name anyone), and with
    three or four processes one slow value drags the median towards itself.
    """
    busy = np.asarray(busy, np.float64)
    if busy.size < 2:
        return np.full(busy.shape, np.nan)
    return np.array([np.median(np.delete(busy, p)) for p in range(busy.size)])


def slow_processes(busy: np.ndarray, wall: np.ndarray, factor: float) -> list[tuple[int, float]]:
    """The stragglers of one window: (process, reference busy seconds) for each process busier than
    `factor` x the median of the other processes (`busy_references`), and by at least MIN_COST of a
    step. Slower by the factor, and by enough to matter: a few milliseconds of extra logging on
    process 0 are not what makes a job wait (and a reference near 0 makes any ratio huge)."""
    busy = np.asarray(busy, np.float64)
    step = float(np.median(wall))
    return [(p, float(r)) for p, (b, r) in enumerate(zip(busy, busy_references(busy)))
            if not np.isnan(r) and b > factor * r and b - r > MIN_COST * step]


def job_hosts(process_index: int, process_count: int, timeout_s: float = 120.0, *, kv: Any = None,
              host: Optional[str] = None) -> list[str]:
    """Every process's host name, by process index (one key-value exchange at start-up).

    Three coordinator calls per process whatever the job's size: its own host key, one barrier in
    the coordination service, one read of the host-key directory (formerly P blocking reads each,
    P^2 for the job). The directory read returns all P names: that table is the result.

    Args:
      kv: the coordination client (`multihost.client()` by default); host: this process's name
        (`socket.gethostname()` by default). Both are given by the simulated-scale harness.
    Raises:
      BarrierTimeoutError: naming the processes whose host key never came.
    """
    host = socket.gethostname() if host is None else host
    if process_count == 1:
        return [host]
    from jaxtrain.runtime.multihost import barrier_timeout_error, client, next_call
    kv = client() if kv is None else kv
    name = f"hosts/{next_call('job_hosts')}"  # every process calls job_hosts equally often
    prefix = f"jaxtrain/barrier/{name}/"  # the host keys double as the barrier's arrival keys
    kv.key_value_set(prefix + str(process_index), host, allow_overwrite=True)
    try:
        kv.wait_at_barrier(prefix[:-1], max(1, int(timeout_s * 1000)))
    except Exception as e:
        raise barrier_timeout_error(kv, name, prefix, timeout_s, process_index, process_count, e) from None
    names = {int(k.rsplit("/", 1)[-1]): v for k, v in kv.key_value_dir_get(prefix)}
    return [names[p] for p in range(process_count)]
