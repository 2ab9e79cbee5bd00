"""Health during the run: every `fault.health_every_steps`, cheap checks of what each process's
host exposes, published as `health` events and Prometheus metrics (`jaxtrain_health_*`), with a
warning before it turns into a failure.

Checks (each one a few system calls, on the loop thread, no device access):
  memory  host memory pressure: MemAvailable / MemTotal from /proc/meminfo (Linux); warns below
          MEMORY_WARN_RATIO.
  disk    free space of the run directory's file system (a local run.output_dir; object stores
          have none to fill); warns below DISK_WARN_RATIO of it free. `local_disk`: the same for
          checkpoint.local_dir when the local tier is on (node-local storage filling up).
  step    this process's own busy step time over the last `health_every_steps` against the median
          of the earlier checks' figures (a device or host getting slower); warns above
          STEP_WARN_RATIO, once enough history (MIN_HISTORY checks) is there.
  matmul  the TFLOP/s of a small matmul on this process's slowest local device (the preflight
          measurement, best of a few calls: milliseconds on a GPU) against the median of the earlier
          checks' figures; warns below MATMUL_WARN_RATIO. Beside it, the ratio to this process's
          preflight figure (`matmul_preflight_ratio`) where a preflight ran: a figure, not a warning,
          since the preflight measured an idle device and this one shares it with training.
  gpu     NVML's counters per GPU (observe/nvml.py, `fault.health_nvml`): warns `gpu_memory` once
          uncorrected ECC errors count up during the run or a row remap is pending or failed, and
          `gpu_throttle` while the hardware slows its clocks (thermal, power brake, HW slowdown).
"""

from __future__ import annotations

import collections
import os
import shutil
import statistics
from typing import Any, Callable

from jaxtrain.observe.nvml import throttle_names

MEMORY_WARN_RATIO = 0.10  # less than 10% of host memory available
DISK_WARN_RATIO = 0.05  # less than 5% of the run directory's disk free
STEP_WARN_RATIO = 1.5  # this window's median step time 1.5x the running median of earlier windows
MATMUL_WARN_RATIO = 0.7  # a matmul at 70% of the running median of earlier checks (fault.preflight_factor's default)
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
    """Feed `after_step(step, busy_s)` every step; checks run every `every` steps (0 = off).

    Args:
      every: fault.health_every_steps.
      event: the loop's event writer (`health` events).
      disk_path: a local directory whose file system is watched (None: none).
      memory, disk: the host's figures (stand-ins in tests).
      matmul: measures this process's slowest local device now, in TFLOP/s (None: no matmul check).
      gpus: an observe.nvml.Nvml (None: no GPU counters); `gpu_note` says once why they are missing.
    """

    def __init__(self, every: int, event: Callable[..., None], *, disk_path: str | None = None,
                 memory: Callable[[], tuple[float, float] | None] = host_memory,
                 disk: Callable[[str], Any] = shutil.disk_usage, matmul: Callable[[], float] | None = None,
                 gpus: Any = None, gpu_note: str = ""):
        self.every, self.event = every, event
        self.disk_path = disk_path
        self.local_disk_path: str | None = None  # checkpoint.local_dir, when the local tier is on
        self._memory, self._disk, self._matmul, self._gpus = memory, disk, matmul, gpus
        self._gpu_note = gpu_note
        self._busy: list[float] = []
        self._history: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self._matmul_history: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.matmul_preflight: float | None = None  # this process's preflight TFLOP/s, when one ran
        self._ecc_at_start: dict[int, int] = {}
        self.values: dict[str, float] = {}  # the last check's figures (read by the metrics thread)
        self.gpu_values: dict[int, dict[str, Any]] = {}  # NVML index -> the last check's counters
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
        for check, path in (("disk", self.disk_path), ("local_disk", self.local_disk_path)):
            if path is not None and os.path.isdir(path):
                usage = self._disk(path)
                values[f"{check}_free_bytes"] = float(usage.free)
                values[f"{check}_free_ratio"] = usage.free / usage.total if usage.total else 1.0
                warnings[check] = values[f"{check}_free_ratio"] < DISK_WARN_RATIO
        if self._busy:
            window = statistics.median(self._busy)
            self._busy = []
            if len(self._history) >= MIN_HISTORY:
                reference = statistics.median(self._history)
                values["step_time_ratio"] = window / reference if reference > 0 else 1.0
                warnings["step"] = values["step_time_ratio"] > STEP_WARN_RATIO
            self._history.append(window)
        if self._matmul is not None:
            tflops = self._matmul()
            values["matmul_tflops"] = tflops
            if len(self._matmul_history) >= MIN_HISTORY:
                reference = statistics.median(self._matmul_history)
                values["matmul_ratio"] = tflops / reference if reference > 0 else 1.0
                warnings["matmul"] = values["matmul_ratio"] < MATMUL_WARN_RATIO
            if self.matmul_preflight:
                values["matmul_preflight_ratio"] = tflops / self.matmul_preflight
            self._matmul_history.append(tflops)
        gpus = self._check_gpus(warnings)
        self.values, self.warnings, self.gpu_values = values, warnings, gpus
        record = {**{k: round(v, 4) for k, v in values.items()},
                  "warnings": sorted(k for k, w in warnings.items() if w)}
        if gpus:
            record["gpus"] = {str(i): g for i, g in gpus.items()}
        if self._gpu_note:
            record["gpu_note"], self._gpu_note = self._gpu_note, ""  # said once
        self.event("health", step, **record)
        return record

    def close(self) -> None:
        """Let go of NVML."""
        if self._gpus is not None:
            self._gpus.close()
            self._gpus = None

    def _check_gpus(self, warnings: dict[str, bool]) -> dict[int, dict[str, Any]]:
        """NVML's counters now (each GPU's own warning reasons with them); sets the gpu_memory and
        gpu_throttle warnings."""
        if self._gpus is None:
            return {}
        gpus = self._gpus.read()
        memory, throttled = [], []
        for index, g in gpus.items():
            start = self._ecc_at_start.setdefault(index, g.get("ecc_uncorrected", 0))
            g["ecc_uncorrected_in_run"] = g.get("ecc_uncorrected", start) - start
            if g["ecc_uncorrected_in_run"] > 0 or g.get("remap_pending") or g.get("remap_failure"):
                memory.append(index)
            reasons = throttle_names(g.get("throttle", 0))
            if reasons:
                g["throttle_reasons"] = reasons
                throttled.append(index)
        warnings["gpu_memory"], warnings["gpu_throttle"] = bool(memory), bool(throttled)
        return gpus
