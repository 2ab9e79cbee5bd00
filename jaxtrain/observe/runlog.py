"""The run's logs: metrics.jsonl, events.jsonl, TensorBoard scalars and the console lines.

Only process 0 writes; other processes get a RunLog that drops everything. On a terminal the
progress line is rewritten in place; anywhere else (SLURM output files, Kubernetes logs, CI,
`| tee`) each logged step is one plain line. What the console lines say (short, for a person;
the logs keep every detail) is `jaxtrain.observe.console`'s.

Layout of the logs in a run directory (`read_log` reads either, and is what every reader uses):
  local:   metrics.jsonl, events.jsonl (appended line by line), tensorboard/events.out.tfevents.*
  gs://, s3://: metrics.jsonl.segments/000001.jsonl, 000002.jsonl, ... and the same for
           events.jsonl (segments of at most `appended_log.SEGMENT_BYTES`, read in order of their
           number after a whole metrics.jsonl / events.jsonl object that runs before segments
           wrote), and tensorboard/events.out.tfevents.<time>.<host>.<pid>.<n>: a new event
           file, with its own header record, wherever a segment would start.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from typing import IO, Any, Callable

from jaxtrain.storage import appended_log, small_files
from jaxtrain.storage.paths import is_remote, join
from jaxtrain.config import Config, save_config
from jaxtrain.observe.console import Console, write_line
from jaxtrain.observe.tensorboard import ScalarWriter

_log = logging.getLogger(__name__)


class RunLog:
    """metrics.jsonl, events.jsonl, TensorBoard and the progress line for one run directory.

    `output_dir` may be a local directory or a gs:// / s3:// URL. Locally each line reaches the
    OS as it is written (a killed run keeps every line). Object stores cannot append, so there
    the logs are written as bounded segment objects (see the module docstring and
    `jaxtrain.storage.appended_log.AppendOnlyFile`) by one background thread: metrics and
    TensorBoard records at most every `flush_interval_s`, and at once (without waiting for the
    upload) on every event, metrics before events. `sync()` and `close()` upload everything and
    wait. A killed run loses at most the lines written since the last upload (a resumed run
    writes the steps after its restore again) and continues in new segments after the existing
    ones. A failed upload never stops training: it is reported as one line on the console and
    retried at the next upload.
    """

    def __init__(self, output_dir: str | None, *, console: IO[str] | str | None = None, enabled: bool = True,
                 flush_interval_s: float = 5.0):
        """`console`: where the lines for a person go (None: nowhere; "auto": sys.stdout as it is now,
        which in a notebook is the cell's output). What they say is `console.Console`'s."""
        self.enabled = enabled and output_dir is not None
        self.console = sys.stdout if console == "auto" else console
        self._lines = Console()
        self._tty = bool(self.console is not None and hasattr(self.console, "isatty") and self.console.isatty())
        self._tb = None
        self._uploader = None
        self._reported: set[int] = set()  # ids of background upload errors already warned about
        if self.enabled:
            out = self.output_dir = os.fspath(output_dir)
            self.remote = is_remote(out)
            small_files.makedirs(out)
            # One uploader for the three logs: a pass stores the metrics before the event after them.
            self._uploader = appended_log.Uploader(flush_interval_s) if self.remote else None
            self._metrics = appended_log.AppendOnlyFile(join(out, "metrics.jsonl"), uploader=self._uploader)
            self._events = appended_log.AppendOnlyFile(join(out, "events.jsonl"), uploader=self._uploader)
            self._tb = ScalarWriter(join(out, "tensorboard"), uploader=self._uploader)

    def write_config(self, cfg: Config) -> None:
        """The resolved config as `config.yaml` (what a resumed or exported run is read back with)."""
        if not self.enabled:
            return
        if not self.remote:
            save_config(cfg, join(self.output_dir, "config.yaml"))
            return
        with tempfile.TemporaryDirectory() as tmp:  # config.py owns the format; upload what it writes
            save_config(cfg, os.path.join(tmp, "config.yaml"))
            with open(os.path.join(tmp, "config.yaml")) as f:
                small_files.write_text(join(self.output_dir, "config.yaml"), f.read())

    def event(self, kind: str, step: int, **details: Any) -> None:
        """One events.jsonl line with every detail, and its short console line (if it has one)."""
        if not self.enabled:
            return
        record = {"time": time.time(), "step": int(step), "kind": kind, **details}
        self._events.write(json.dumps(_finite_or_name(record), default=_jsonable) + "\n")
        if self._uploader is not None:  # remote: upload now, in the background; never wait for it here
            self._warn_background_errors()
            self._uploader.wake(urgent=True)
        if self.console is not None:
            line = self._lines.event(kind, step, details)
            if line is not None:
                self._print(line, keep=True)

    def metrics(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl line, its TensorBoard scalars and the progress line."""
        if not self.enabled:
            return
        self._metrics.write(json.dumps(_finite_or_name(record), default=_jsonable) + "\n")
        if self._tb is not None:
            self._tb.scalars(record["step"], {
                f"train/{k}": float(v) for k, v in record.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)})
        if self.console is not None:
            self._print(self._lines.progress(record), keep=not self._tty)

    def texts(self, step: int, values: dict[str, str]) -> None:
        """TensorBoard text summaries (samples of generated text)."""
        if self.enabled and self._tb is not None:
            self._tb.texts(step, values)

    def _print(self, line: str, keep: bool) -> None:
        write_line(self.console, line, tty=self._tty, keep=keep)

    def _warn(self, message: str) -> None:
        if self.console is not None:
            self._print(f"[warning] {message}", keep=True)
        else:
            _log.warning(message)

    def _files(self) -> tuple[Any, ...]:
        return (self._metrics, self._events, self._tb)

    def _warn_background_errors(self) -> None:
        for f in self._files():
            e = f.background_error
            if e is not None and id(e) not in self._reported:
                self._reported.add(id(e))
                self._warn(f"could not upload {f.path}: {_first_line(e)} (retried at the next upload)")

    def sync(self) -> bool:
        """Make every line logged so far durable now (remote: upload and wait; locally every line
        already reached the OS). Returns False, after one console line each, when an upload failed
        (the logs must not stop training; the next upload retries)."""
        if not self.enabled or not self.remote:
            return True
        ok = True
        for f in self._files():
            try:
                f.flush()
            except Exception as e:
                ok = False
                self._warn(f"could not upload {f.path}: {_first_line(e)}")
        return ok

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tty and self.console is not None:
            self.console.write("\n")
        for f in self._files():
            try:
                f.close()
            except Exception as e:  # remote: the last upload failed; say so, do not mask the run's result
                self._warn(f"could not upload {getattr(f, 'path', '')} at close: {_first_line(e)}")
        if self._uploader is not None:
            self._uploader.close()
        self.enabled = False


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _finite_or_name(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities as the strings "NaN", "Infinity", "-Infinity": JSON has no literal for
    them, and strict readers (jq, browsers) reject Python's bare NaN."""
    return {k: (str(v).replace("nan", "NaN").replace("inf", "Infinity") if isinstance(v, float) and not math.isfinite(v)
                else v) for k, v in record.items()}


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


class Events:
    """Every event of a run, in order, through one API: `write({"kind": ..., "step": ..., **details})`.

    The capabilities (checkpoint tiers, rollbacks, chaos, stragglers, health, preflight) receive the
    object itself as their `on_event`: called as `events(kind, step, **details)`, it writes that
    event. Where each event goes are the sinks (`attach`): the RunLog's events.jsonl, the exporter's
    count by kind. The run raises events before its sinks exist (a restore, a damaged checkpoint,
    a chaos drill at start-up): those are kept, and each sink attached gets them first, in order,
    until `attach(..., last=True)` says no other sink follows.
    """

    def __init__(self) -> None:
        self._sinks: list[Callable[[dict], None]] = []
        self._early: list[dict] | None = []  # every event so far, while a sink may still be attached

    def write(self, event: dict) -> None:
        """Deliver one event ({"kind", "step", **details}) to every sink (or keep it for the next one)."""
        if self._early is not None:
            self._early.append(event)
        for sink in self._sinks:
            sink(event)

    def __call__(self, kind: str, step: int, **details: Any) -> None:
        """The `on_event(kind, step, **details)` form the capabilities call."""
        self.write({"kind": kind, "step": step, **details})

    def attach(self, sink: Callable[[dict], None], *, last: bool = False) -> None:
        """Add `sink(event)`; it receives every event written so far, then each new one. `last`:
        no sink follows, so the events of the start-up are no longer kept."""
        for event in self._early or ():
            sink(event)
        self._sinks.append(sink)
        if last:
            self._early = None


def split_event(event: dict) -> tuple[str, int, dict]:
    """(kind, step, details) of an `Events` event."""
    details = dict(event)
    return details.pop("kind"), details.pop("step"), details


def append_event(output_dir: str | None, kind: str, step: int, **details: Any) -> None:
    """One event line appended to events.jsonl from outside the RunLog: the launcher (between
    attempts) and the hang watchdog of any process (while the loop is stuck). A single O_APPEND
    write, so lines of several writers never interleave on a local filesystem. Remote run
    directories: nothing (those writers report on stderr; the RunLog owns the remote objects)."""
    if output_dir is None or is_remote(output_dir):
        return
    os.makedirs(output_dir, exist_ok=True)
    record = {"time": time.time(), "step": int(step), "kind": kind, **details}
    line = json.dumps(_finite_or_name(record), default=_jsonable) + "\n"
    fd = os.open(os.path.join(output_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_log(run_dir: str | os.PathLike, name: str) -> list[dict]:
    """The records of the run log `name` ("metrics.jsonl" or "events.jsonl") of `run_dir`, oldest first.

    Reads every layout (module docstring): the local file, or in a bucket the whole object of a
    run written before segments followed by the segments in order. Torn lines (a writer killed
    mid-line) and lines that are not JSON objects are skipped. [] when the log does not exist.
    Every reader of the run logs (goodput, the launchers' blame) goes through here.
    """
    data = appended_log.read_appended(join(os.fspath(run_dir), name))
    out = []
    for line in data.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
