"""Numbers that show where time goes: FLOPs per step, device peaks, MFU, and the run's logs.

`RunLog` owns the run directory's metrics.jsonl, events.jsonl and TensorBoard scalars, plus the
live progress line. Only process 0 writes; other processes get a RunLog that drops everything.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

import jax
import jax.numpy as jnp

from jaxtrain.config import Config
from jaxtrain.model import matmul_params
from jaxtrain.tensorboard import ScalarWriter
from kernels import attention_flops

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
    counted as half the full score matrix, the same accounting the kernels use.
    """
    m, d = cfg.model, cfg.data
    tokens = d.global_batch_size * d.seq_len
    attn = attention_flops(d.global_batch_size, d.seq_len, m.num_heads, m.head_dim, causal=True)
    return 6.0 * matmul_params(m) * tokens + 3.0 * m.num_layers * attn


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


def peak_flops_per_device(device: jax.Device, policy: str) -> tuple[float, str]:
    """(peak FLOP/s, where the number came from) for MFU."""
    kind = getattr(device, "device_kind", "")
    for name, bf16, fp32 in PEAK_FLOPS:
        if name.lower() in kind.lower():
            return (fp32 if policy == "fp32" else bf16), f"table:{name}"
    dtype = jnp.float32 if policy == "fp32" else jnp.bfloat16
    return measure_matmul_peak(dtype), f"measured:{device.platform} matmul"


class RunLog:
    """metrics.jsonl, events.jsonl, TensorBoard and the progress line for one run directory."""

    def __init__(self, output_dir: str | None, *, console: IO[str] | None = None, enabled: bool = True):
        self.enabled = enabled and output_dir is not None
        self.console = console
        self._tty = bool(console is not None and hasattr(console, "isatty") and console.isatty())
        self._tb = None
        if self.enabled:
            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            self._metrics = open(out / "metrics.jsonl", "a", buffering=1)
            self._events = open(out / "events.jsonl", "a", buffering=1)
            self._tb = ScalarWriter(out / "tensorboard")

    def event(self, kind: str, step: int, **details: Any) -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), "step": int(step), "kind": kind, **details}
        self._events.write(json.dumps(record, default=_jsonable) + "\n")
        if self.console is not None and kind not in ("checkpoint_saved",):
            self._print(f"[{kind}] step {step} " + " ".join(f"{k}={_short(v)}" for k, v in details.items()), keep=True)

    def metrics(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps(record, default=_jsonable) + "\n")
        if self._tb is not None:
            self._tb.scalars(record["step"], {
                f"train/{k}": float(v) for k, v in record.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)})
            self._tb.flush()
        if self.console is not None:
            line = (f"step {record['step']:>6}  loss {record['loss']:.4f}  "
                    f"tok/s {record['tokens_per_sec']:,.0f}  MFU {100 * record['mfu']:.1f}%")
            if "eval_loss" in record:
                line += f"  eval {record['eval_loss']:.4f}"
            self._print(line, keep=not self._tty)

    def _print(self, line: str, keep: bool) -> None:
        if self._tty:
            self.console.write("\r\033[K" + line + ("\n" if keep else ""))
        else:
            self.console.write(line + "\n")
        self.console.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tty and self.console is not None:
            self.console.write("\n")
        self._metrics.close()
        self._events.close()
        if self._tb is not None:
            self._tb.close()
        self.enabled = False


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
