"""Health during the run: every `fault.health_every_steps`, cheap checks of what each process's
host exposes, published as `health` events and Prometheus metrics (`jaxtrain_health_*`), with a
warning before it turns into a failure.

Checks (each one a few system calls, on the loop thread, no device access):
  memory  host memory pressure: MemAvailable / MemTotal from /proc/meminfo (Linux); warns below
          MEMORY_WARN_RATIO.
  disk    free space of the run directory's file system (a local run.output_dir; object stores
          have none to fill); warns below DISK_WARN_RATIO of it free.
  step    this process's own busy step time over the last `health_every_steps` against the median
          of the earlier checks' figures (a device or host getting slower); warns above
          STEP_WARN_RATIO, once enough history (MIN_HISTORY checks) is there.

Not covered: NVML's device counters (ECC errors, throttling) on GPUs.
"""

from __future__ import annotations

import collections
import os
import shutil
import statistics
from typing import Any, Callable

MEMORY_WARN_RATIO = 0.10  # less than 10% of host memory available
DISK_WARN_RATIO = 0.05  # less than 5% of the run directory's disk free
STEP_WARN_RATIO = 1.5  # this window's median step time 1.5x the running median of earlier windows
MIN_HISTORY = 3  # earlier windows needed before the step check can warn
HISTORY = 50  # windows the running median spans


def host_memory() -> tuple[float, float] | None:
    """(available bytes, total bytes) of host memory, or None where /proc/meminfo is absent."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: float(line.split()[1]) * 1024 for line in f if ":" in line}
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


class Health:
    """Feed `after_step(step, busy_s)` every step; checks run every `every` steps (0 = off)."""

    def __init__(self, every: int, event: Callable[..., None], *, disk_path: str | None = None,
                 memory: Callable[[], tuple[float, float] | None] = host_memory,
                 disk: Callable[[str], Any] = shutil.disk_usage):
        self.every, self.event = every, event
        self.disk_path = disk_path
        self._memory, self._disk = memory, disk
        self._busy: list[float] = []
        self._history: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.values: dict[str, float] = {}  # the last check's figures (read by the metrics thread)
        self.warnings: dict[str, bool] = {}  # check -> warning now

    def after_step(self, step: int, busy_s: float) -> None:
        if self.every <= 0:
            return
        self._busy.append(busy_s)
        if step % self.every == 0:
            self.check(step)

    def check(self, step: int) -> dict[str, Any]:
        """Run the checks now; returns (and raises as a `health` event) the figures and warnings."""
        values: dict[str, float] = {}
        warnings: dict[str, bool] = {}
        mem = self._memory()
        if mem is not None and mem[1] > 0:
            values["host_memory_available_ratio"] = mem[0] / mem[1]
            warnings["memory"] = values["host_memory_available_ratio"] < MEMORY_WARN_RATIO
        if self.disk_path is not None and os.path.isdir(self.disk_path):
            usage = self._disk(self.disk_path)
            values["disk_free_bytes"] = float(usage.free)
            values["disk_free_ratio"] = usage.free / usage.total if usage.total else 1.0
            warnings["disk"] = values["disk_free_ratio"] < DISK_WARN_RATIO
        if self._busy:
            window = statistics.median(self._busy)
            self._busy = []
            if len(self._history) >= MIN_HISTORY:
                reference = statistics.median(self._history)
                values["step_time_ratio"] = window / reference if reference > 0 else 1.0
                warnings["step"] = values["step_time_ratio"] > STEP_WARN_RATIO
            self._history.append(window)
        self.values, self.warnings = values, warnings
        record = {**{k: round(v, 4) for k, v in values.items()},
                  "warnings": sorted(k for k, w in warnings.items() if w)}
        self.event("health", step, **record)
        return record
