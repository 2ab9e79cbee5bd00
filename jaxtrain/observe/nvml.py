"""GPU health counters from NVML, the NVIDIA driver's management library, for the run-time health check.

Read through `pynvml` (the `nvidia-ml-py` package, `pip install 'jaxtrain[gpu]'`), which loads the
driver's libnvidia-ml.so.1. Each read is a handful of driver calls per GPU, no CUDA context and no
device work, so it can run on the loop thread between steps. What is read, per GPU:

  ecc_uncorrected   volatile uncorrected ECC errors since the driver loaded: a count going up is
                    memory that returns wrong data (the job's numbers are suspect; Xid 48/63/64)
  ecc_corrected     volatile corrected ECC errors (reported, not warned on: a few are normal)
  remap_pending     1 when a row remap waits for a GPU reset (A100 and later); remap_failure 1 when
                    a remap failed: both mean the GPU should be drained
  throttle          the clock-event reasons bitmask; only the hardware ones warn (HW slowdown,
                    HW thermal, HW power brake, SW thermal): the power cap and idle are normal
  temperature_c     the GPU die temperature

A counter the GPU does not support (ECC off, no row remapper) is left out rather than guessed.
Which GPUs: the ones CUDA_VISIBLE_DEVICES names (indices or GPU-UUIDs), else every GPU NVML shows
this process. NVML numbers GPUs in PCI bus order, CUDA by default fastest first, so series carry
the GPU's UUID beside NVML's index.
"""

from __future__ import annotations

import os
from typing import Any

# nvmlClocksEventReason* bits that mean the hardware is slowing itself down.
HARDWARE_THROTTLE = {0x08: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}
_UNCORRECTED, _CORRECTED, _VOLATILE = 1, 0, 0  # NVML_MEMORY_ERROR_TYPE_*, NVML_VOLATILE_ECC
_TEMPERATURE_GPU = 0


def throttle_names(mask: int) -> list[str]:
    """The hardware throttle reasons set in an NVML clock-event mask."""
    return [name for bit, name in HARDWARE_THROTTLE.items() if mask & bit]


def visible_selection(value: str | None) -> list[int | str] | None:
    """CUDA_VISIBLE_DEVICES as a list of NVML indices or UUIDs (None: not set, every GPU)."""
    if value is None or not value.strip():
        return None
    out: list[int | str] = []
    for item in value.split(","):
        item = item.strip()
        if item.isdigit():
            out.append(int(item))
        elif item.startswith(("GPU-", "MIG-")):
            out.append(item)
        else:
            break  # CUDA stops at the first entry it cannot read; so do we
    return out


class Nvml:
    """The GPUs of this process, opened once; `read()` at each health check.

    `Nvml.open()` returns (None, why) where there is no NVML (no bindings, no driver, no GPU), so
    the caller can say once why the GPU counters are missing and carry on.
    """

    def __init__(self, nvml: Any, handles: list[tuple[int, str, Any]]):
        self._nvml = nvml
        self.gpus = handles  # (NVML index, UUID, handle)

    @classmethod
    def open(cls, visible: str | None = None) -> tuple["Nvml | None", str]:
        """Initialise NVML and pick this process's GPUs (CUDA_VISIBLE_DEVICES by default)."""
        try:
            import pynvml
        except ImportError:
            return None, "nvidia-ml-py is not installed (pip install 'jaxtrain[gpu]')"
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            chosen = visible_selection(os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible)
            handles = []
            for position, item in enumerate(range(count) if chosen is None else chosen):
                if isinstance(item, int):
                    if item >= count:
                        continue
                    h = pynvml.nvmlDeviceGetHandleByIndex(item)
                else:
                    h = pynvml.nvmlDeviceGetHandleByUUID(item)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                index = item if isinstance(item, int) else _index_of(pynvml, h, position)
                handles.append((index, uuid, h))
        except pynvml.NVMLError as e:
            return None, f"NVML: {e}"
        if not handles:
            return None, "NVML shows no GPU to this process"
        return cls(pynvml, handles), ""

    def read(self) -> dict[int, dict[str, Any]]:
        """NVML index -> the counters above (those the GPU supports) and its `uuid`."""
        n = self._nvml
        out: dict[int, dict[str, Any]] = {}
        for index, uuid, h in self.gpus:
            gpu: dict[str, Any] = {"uuid": uuid}
            self._try(gpu, "ecc_uncorrected", n.nvmlDeviceGetTotalEccErrors, h, _UNCORRECTED, _VOLATILE)
            self._try(gpu, "ecc_corrected", n.nvmlDeviceGetTotalEccErrors, h, _CORRECTED, _VOLATILE)
            rows = self._call(n.nvmlDeviceGetRemappedRows, h)
            if rows is not None:
                gpu["remap_pending"], gpu["remap_failure"] = int(bool(rows[2])), int(bool(rows[3]))
            # The newer name (drivers >= 535), else the older one for the same mask.
            mask = self._call(getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None), h)
            if mask is None:
                mask = self._call(n.nvmlDeviceGetCurrentClocksThrottleReasons, h)
            if mask is not None:
                gpu["throttle"] = int(mask)
            self._try(gpu, "temperature_c", n.nvmlDeviceGetTemperature, h, _TEMPERATURE_GPU)
            out[index] = gpu
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass

    def _call(self, fn: Any, *args: Any) -> Any:
        if fn is None:
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError:  # not supported on this GPU, or the driver refused: leave it out
            return None

    def _try(self, gpu: dict[str, Any], key: str, fn: Any, *args: Any) -> None:
        v = self._call(fn, *args)
        if v is not None:
            gpu[key] = int(v)


def _index_of(pynvml: Any, handle: Any, position: int) -> int:
    """NVML's index of a handle obtained by UUID (its place in CUDA_VISIBLE_DEVICES where NVML
    will not say: still a distinct label, and the UUID names the GPU)."""
    try:
        return int(pynvml.nvmlDeviceGetIndex(handle))
    except pynvml.NVMLError:
        return position
