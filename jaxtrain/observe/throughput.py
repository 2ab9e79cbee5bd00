"""How fast a run goes: model FLOPs per step, device peaks, and per-step throughput records.

`flops_per_step` counts model FLOPs (PaLM appendix B accounting); `peak_flops_per_device` gives
the denominator of MFU (a table for known accelerators, a measured matmul on the CPU, measured once
per machine and kept in a small JSON file so that every run there divides by the same number: a
re-measure at each start moved MFU by a third between two runs of the same steps on a busy host);
`Throughput` turns a finished step's device metrics plus the host clock into the `metrics.jsonl`
fields step_time_s, tokens_per_sec, tflops_per_device and mfu.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config import Config
from jaxtrain.model.llama import matmul_params
from jaxtrain.kernels import attention_flops

# Dense peak FLOP/s per device by device kind: (bf16, fp32). fp32 on GPUs means TF32 tensor cores.
# Matched by substring of `jax.Device.device_kind`, first hit wins (so "H200" before "H100").
PEAK_FLOPS: list[tuple[str, float, float]] = [
    ("H200", 989e12, 494e12),
    ("H100", 989e12, 494e12),
    ("A100", 312e12, 156e12),
    ("L4", 121e12, 60e12),
    ("TPU v6", 918e12, 918e12 / 2),
    ("TPU v5p", 459e12, 459e12 / 2),
    ("TPU v5 lite", 197e12, 197e12 / 2),
    ("TPU v5e", 197e12, 197e12 / 2),
    ("TPU v4", 275e12, 275e12 / 2),
]


def flops_per_step(cfg: Config) -> float:
    """Model FLOPs of one optimizer step over the global batch (forward + backward = 3x forward).

    Matmuls: 6 * params * tokens (PaLM appendix B). Attention: the causal QK^T and PV matmuls,
    counted as half the full score matrix, the same accounting the kernels use; a local layer
    (model.sliding_window) counts only its window's band, as the kernels skip the rest.
    """
    m, d = cfg.model, cfg.data
    tokens = d.global_batch_size * d.seq_len
    # QK^T runs over the q/k head size, PV over the value's (MLA: v_head_dim): their mean counts both.
    head_dim = (m.head_dim + m.v_head_dim) / 2 if m.mla else m.head_dim
    attn = sum(attention_flops(d.global_batch_size, d.seq_len, m.num_heads, head_dim, causal=True,
                               window=m.sliding_window if m.layer_is_local(i) else None)
               for i in range(m.num_layers))
    attn += m.mtp_depth * attention_flops(d.global_batch_size, d.seq_len, m.num_heads, head_dim, causal=True)
    return 6.0 * matmul_params(m) * tokens + 3.0 * attn


def measure_matmul_peak(dtype: Any = jnp.float32, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a plain jitted n x n matmul on the default device: the honest CPU peak."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n ** 3 / best


def peak_flops_per_device(device: jax.Device, policy: str, *, cache_file: str | None = None,
                          xla_flags: list[str] | tuple[str, ...] = ()) -> tuple[float, str]:
    """(peak FLOP/s, where the number came from) for MFU.

    Known accelerators: their datasheet peak ("table:H100"). Anything else: a measured matmul
    ("measured:cpu matmul"). With `cache_file`, the measurement is made once per machine, dtype and
    XLA flags and read back afterwards ("measured:cpu matmul (cached 2026-12-05)"); a cache that
    cannot be read or written is measured around, never an error.
    """
    kind = getattr(device, "device_kind", "")
    for name, bf16, fp32 in PEAK_FLOPS:
        if name.lower() in kind.lower():
            return (fp32 if policy == "fp32" else bf16), f"table:{name}"
    dtype = jnp.float32 if policy == "fp32" else jnp.bfloat16
    source = f"measured:{device.platform} matmul"
    if cache_file is None:
        return measure_matmul_peak(dtype), source
    key = peak_cache_key(device, policy, xla_flags)
    entry = read_peak_cache(cache_file).get(key)
    if entry is not None:
        return entry["flops"], f"{source} (cached {entry['date']})"
    peak = measure_matmul_peak(dtype, repeats=20)  # kept for good: the best of more tries (~1 s on 2 cores)
    today = datetime.date.today().isoformat()
    written = write_peak_cache(cache_file, key, {"flops": peak, "date": today, "time": time.time()})
    return peak, f"{source} ({'measured now, cached' if written else 'measured now, not cached'})"


def peak_cache_key(device: jax.Device, policy: str, xla_flags: list[str] | tuple[str, ...]) -> str:
    """What a measured matmul peak depends on: the device (on the CPU its model and the cores this
    process may use), JAX's version, the dtype policy and the XLA flags. The simulated device count
    is left out: the peak is measured on one device alone whatever the count."""
    what = [device.platform, getattr(device, "device_kind", ""), f"jax {jax.__version__}", f"policy {policy}"]
    if device.platform == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        what += [_cpu_model(), f"{cores} cores"]
    flags = sorted(f for f in xla_flags if not f.startswith("--xla_force_host_platform_device_count"))
    return " | ".join(what + flags)


def _cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_peak_cache(path: str) -> dict[str, dict]:
    """The peak cache's entries by key; {} when the file is missing, unreadable or not what we write."""
    try:
        with open(path) as f:
            data = json.load(f)
        peaks = data["peaks"]
        return {k: v for k, v in peaks.items() if isinstance(v, dict) and isinstance(v.get("flops"), (int, float))
                and math.isfinite(v["flops"]) and v["flops"] > 0 and isinstance(v.get("date"), str)}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}  # corrupt or foreign: measured again and overwritten


def write_peak_cache(path: str, key: str, entry: dict) -> bool:
    """Add one entry to the peak cache (atomically: a reader never sees half a file). False when it
    cannot be written (read-only home, full disk): the run goes on with the number it measured."""
    try:
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        peaks = {**read_peak_cache(path), key: entry}
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".peak_flops.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"peaks": peaks}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return True
    except OSError:
        return False


class Throughput:
    """Step time, tokens/s, TFLOP/s per device and MFU between two log points.

    Step time is wall time between log points divided by the steps in between, so it includes
    everything the loop does per step (data, dispatch, device) and nothing it does only at log
    points once `exclude()` is called after those (evaluation, for example).
    """

    def __init__(self, flops_per_step: float, peak_flops_per_device: float, num_devices: int, step: int):
        self.flops_per_step = flops_per_step
        self.peak = peak_flops_per_device
        self.num_devices = num_devices
        self._mark = (step, time.perf_counter())

    def restart(self, step: int) -> None:
        """Count from now, at `step` (after compiling, or in a notebook between calls)."""
        self._mark = (step, time.perf_counter())

    def exclude(self, step: int) -> None:
        """Time since the last mark up to now is not step time (evaluation, checkpoint restore)."""
        self.restart(step)

    def record(self, step: int, tokens: float) -> dict[str, float]:
        """The throughput fields for a log record at `step`, with `tokens` counted in that step."""
        now = time.perf_counter()
        last_step, last_time = self._mark
        step_time = (now - last_time) / max(step - last_step, 1)
        self._mark = (step, now)
        tflops = self.flops_per_step / step_time / self.num_devices / 1e12
        return {"step_time_s": step_time, "tokens_per_sec": tokens / step_time,
                "tflops_per_device": tflops, "mfu": tflops * 1e12 / self.peak}
