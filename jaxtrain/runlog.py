"""The run's logs: metrics.jsonl, events.jsonl, TensorBoard scalars and the progress line.

Only process 0 writes; other processes get a RunLog that drops everything. On a terminal the
progress line is rewritten in place; anywhere else (SLURM output files, Kubernetes logs, CI,
`| tee`) each logged step is one plain line.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

from jaxtrain.config import Config, save_config
from jaxtrain.tensorboard import ScalarWriter


class RunLog:
    """metrics.jsonl, events.jsonl, TensorBoard and the progress line for one run directory."""

    def __init__(self, output_dir: str | None, *, console: IO[str] | None = None, enabled: bool = True):
        self.enabled = enabled and output_dir is not None
        self.console = console
        self._tty = bool(console is not None and hasattr(console, "isatty") and console.isatty())
        self._tb = None
        if self.enabled:
            out = self.output_dir = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            self._metrics = open(out / "metrics.jsonl", "a", buffering=1)
            self._events = open(out / "events.jsonl", "a", buffering=1)
            self._tb = ScalarWriter(out / "tensorboard")

    def write_config(self, cfg: Config) -> None:
        """The resolved config as `config.yaml` (what a resumed or exported run is read back with)."""
        if self.enabled:
            save_config(cfg, self.output_dir / "config.yaml")

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
