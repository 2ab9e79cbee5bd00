"""The hang watchdog: a process that stops making progress is noticed, explained and restarted.

The loop reports progress (`beat(step)`) every step and says what it is doing (`phase`): starting
(restore, first compile and first step: `fault.startup_timeout_s`), a checkpoint save or restore
(`fault.checkpoint_timeout_s`), or ordinary steps (`fault.hang_timeout_s` between two steps). A
daemon thread checks the deadline of the current phase. When it passes:

1. every Python thread's stack is written to `<run dir>/hangs/p<process>-<host>-a<attempt>.txt`;
2. a `hang` event naming the process, host, phase and step goes to events.jsonl (from every process
   that notices, process 0 or not: a single appended line), with the last progress of every process
   of the job when there are several (so the one that stopped first stands out);
3. the process exits with 75 ("restart me"), and the supervisor (`jaxtrain launch`, SLURM requeue,
   a Kubernetes restart policy) restarts the job from its last checkpoint.

A process stuck inside a collective because another process hung makes no progress either, so
every process of a hung job notices within its own deadline; and the first to notice declares the
hang to the coordination service, where the others' watchdogs see it within seconds and stop too
(each with its own stacks): the whole job restarts, not just the one that hung. The thread needs no cooperation from the main thread, which may be blocked in C++
(JAX releases the GIL while waiting on the device or a collective).

Multi-process jobs: the thread also publishes this process's progress to the coordination service
every few seconds (never from the training loop, never per step), which is what the `hang` event
reads to say who stopped first.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Iterator

from jaxtrain.config import FaultConfig
from jaxtrain.exit_codes import EXIT_RESTART
from jaxtrain.checkpoint.paths import is_remote
from jaxtrain.observe.runlog import append_event

PHASES = ("startup", "checkpoint", "step", "idle")  # idle: between notebook calls, no deadline
LINGER_S = 10.0  # after declaring a hang, how long to wait for the other processes to notice it
PUBLISH_MAX_S = 4.0  # progress is shared, and peers' hang declarations read, at least this often


class Watchdog:
    """One per process. `start()` once; `phase(...)`/`beat(...)` from the loop; `stop()` at the end."""

    def __init__(self, cfg: FaultConfig, *, output_dir: str, process_index: int, process_count: int,
                 attempt: int = 0, poll_s: float | None = None):
        self.cfg = cfg
        self.output_dir = output_dir
        self.process_index, self.process_count, self.attempt = process_index, process_count, attempt
        self.host = socket.gethostname()
        self.enabled = cfg.hang_timeout_s > 0
        self._phase, self._step = "idle", 0
        self._since = time.monotonic()  # when the current deadline started counting
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        shortest = min(cfg.hang_timeout_s or 1.0, cfg.startup_timeout_s, cfg.checkpoint_timeout_s)
        self._poll_s = poll_s if poll_s is not None else max(0.05, min(1.0, shortest / 20))
        # Every few seconds whatever the deadlines: a peer that declared a hang lingers only LINGER_S.
        self._publish_every_s = min(PUBLISH_MAX_S, max(1.0, shortest / 4))
        self._last_publish = 0.0

    # -- the loop's side (cheap: a lock and two assignments)

    def deadline_s(self, phase: str) -> float | None:
        return {"startup": self.cfg.startup_timeout_s, "checkpoint": self.cfg.checkpoint_timeout_s,
                "step": self.cfg.hang_timeout_s, "idle": None}[phase]

    def beat(self, step: int, phase: str = "step") -> None:
        """Progress: `step` finished; the next deadline is that of `phase`, counted from now."""
        with self._lock:
            self._phase, self._step, self._since = phase, step, time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run a block under `name`'s deadline; afterwards the previous phase continues, counted anew."""
        with self._lock:
            previous = self._phase
            self._phase, self._since = name, time.monotonic()
        try:
            yield
        finally:
            self.beat(self._step, previous)

    def start(self) -> "Watchdog":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="jaxtrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -- the thread

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                phase, step, since = self._phase, self._step, self._since
            deadline = self.deadline_s(phase)
            stalled = time.monotonic() - since
            others_hung = self._publish(step, phase)
            if (deadline is not None and stalled > deadline) or others_hung:
                self._fire(phase, step, stalled, deadline, job_hang=others_hung and not (
                    deadline is not None and stalled > deadline))
                return

    def _publish(self, step: int, phase: str) -> bool:
        """Publish this process's progress (every few seconds); True when another process of the job
        has declared a hang (then this one stops too: the job restarts as a whole)."""
        if self.process_count == 1 or time.monotonic() - self._last_publish < self._publish_every_s:
            return False
        self._last_publish = time.monotonic()
        try:
            from jaxtrain.checkpoint.multihost import client
            kv = client()
            kv.key_value_set(f"jaxtrain/progress/{self.process_index}",
                             json.dumps({"step": step, "phase": phase, "time": time.time()}), allow_overwrite=True)
            return bool(kv.key_value_dir_get("jaxtrain/hang/"))
        except Exception:  # the coordinator may be gone: that is for the deadline to notice
            return False

    def _declare_and_linger(self) -> None:
        """Tell the job, then give the other processes a moment to notice and dump their stacks too
        (exiting at once would break their collectives, and they would die without a word)."""
        if self.process_count == 1:
            return
        try:
            from jaxtrain.checkpoint.multihost import client
            kv = client()
            kv.key_value_set(f"jaxtrain/hang/{self.process_index}", self.host, allow_overwrite=True)
            deadline = time.monotonic() + LINGER_S
            while time.monotonic() < deadline and len(kv.key_value_dir_get("jaxtrain/hang/")) < self.process_count:
                time.sleep(0.2)
        except Exception:
            pass

    def _progress_of_all(self) -> dict[int, dict]:
        if self.process_count == 1:
            return {}
        try:
            from jaxtrain.checkpoint.multihost import client
            return {int(k.rsplit("/", 1)[1]): json.loads(v)
                    for k, v in client().key_value_dir_get("jaxtrain/progress/")}
        except Exception:
            return {}

    def _fire(self, phase: str, step: int, stalled: float, deadline: float | None, job_hang: bool = False) -> None:
        stacks = self.dump_stacks()
        progress = self._progress_of_all()
        details = {"process": self.process_index, "host": self.host, "phase": phase, "stalled_s": round(stalled, 1),
                   "deadline_s": deadline, "attempt": self.attempt, "stacks": stacks,
                   "detected_by": "another process" if job_hang else "deadline"}
        if progress:
            details["progress"] = {str(p): v["step"] for p, v in sorted(progress.items())}
            lowest = min(v["step"] for v in progress.values())
            details["behind"] = sorted(p for p, v in progress.items() if v["step"] == lowest)
        append_event(self.output_dir, "hang", step, **details)
        self._declare_and_linger()
        print(f"jaxtrain: process {self.process_index} on {self.host} made no progress for {stalled:.0f} s "
              f"(phase {phase}, deadline {deadline:g} s, last step {step}); stacks in {stacks}; exiting 75 "
              "so the job is restarted", file=sys.stderr, flush=True)
        os._exit(EXIT_RESTART)  # the main thread may be stuck in C++: no clean shutdown is possible

    def dump_stacks(self) -> str:
        """Every thread's Python stack into the run directory's hangs/ folder; returns the path."""
        name = f"p{self.process_index}-{self.host}-a{self.attempt}.txt"
        folder = Path(self.output_dir) / "hangs" if not is_remote(self.output_dir) else Path("hangs")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        with open(path, "w") as f:
            f.write(f"process {self.process_index} on {self.host}, attempt {self.attempt}, {time.ctime()}\n\n")
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                f.write(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)  # the C-level view as well
        return str(path)
