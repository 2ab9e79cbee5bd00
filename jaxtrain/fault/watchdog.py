"""The hang watchdog: a process that stops making progress is noticed, explained and restarted.

The loop reports progress (`beat(step)`) every step and says what it is doing (`phase`): starting
(restore, first compile and first step: `fault.startup_timeout_s`), an XLA compile in progress
(`compiling()`: see `compile_deadline_s`), a checkpoint save or restore (`fault.checkpoint_timeout_s`),
or ordinary steps (`fault.hang_timeout_s` between two steps). A daemon thread checks the deadline of
the current phase. Each key turns off only its own deadline: `fault.hang_timeout_s: 0` leaves the
start-up, compile and checkpoint deadlines running (those two keys must be positive). Only the
`enabled=False` argument (a Trainer with write_files=False) means "no watchdog at all". When a
deadline passes:

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

Multi-process jobs: a second daemon thread publishes this process's progress to the coordination
service every few seconds (never from the training loop, never per step), which is what the `hang`
event reads to say who stopped first. It is a thread of its own so that a wedged coordinator
connection cannot stop the deadline from being checked.

The watchdog must not die or hang itself: a hang is often a stalled shared filesystem, and a full or
read-only disk must not keep a hung process alive. So when a deadline passes a backstop is armed
first (a daemon thread that calls `os._exit(75)` once the reporting has had its time), and each
reporting step (stacks, event, coordinator) runs on its own, guarded and, where it can block,
bounded in time: a failed or stuck step is skipped, never the exit.
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
from typing import Any, Callable, Iterator

from jaxtrain.checkpoint.paths import is_remote
from jaxtrain.config import FaultConfig
from jaxtrain.exit_codes import EXIT_RESTART
from jaxtrain.observe.runlog import append_event

PHASES = ("startup", "compile", "checkpoint", "step", "idle")  # idle: between notebook calls, no deadline
# The compile deadline (see `Watchdog.compile_deadline_s`).
COMPILE_FACTOR = 3.0  # a known compile time, times this: room for a slower host or a busier machine
COMPILE_GROWTH_MAX = 16.0  # no compile time known: startup_timeout_s doubles per attempt, up to this factor
LINGER_S = 10.0  # after declaring a hang, how long to wait for the other processes to notice it
PUBLISH_MAX_S = 4.0  # progress is shared, and peers' hang declarations read, at least this often
# Time bounds of the reporting steps once a deadline has passed (each step that overruns is given up).
STACKS_TIMEOUT_S = 5.0  # writing the stacks file (a stalled shared filesystem blocks open() forever)
STDERR_TIMEOUT_S = 2.0  # the fallback when that fails: faulthandler's stacks on stderr
EVENT_TIMEOUT_S = 5.0  # appending the `hang` event
KV_TIMEOUT_S = 5.0  # one coordination-service step (reading progress; declaring, on top of LINGER_S)
BACKSTOP_MARGIN_S = 3.0  # the backstop fires this long after all the bounds above have run out


class Watchdog:
    """One per process. `start()` once; `phase(...)`/`beat(...)` from the loop; `stop()` at the end."""

    def __init__(self, cfg: FaultConfig, *, output_dir: str, process_index: int, process_count: int,
                 attempt: int = 0, poll_s: float | None = None, enabled: bool = True):
        """`enabled=False`: no thread, nothing ever fires (notebooks, tests: write_files=False). A
        separate argument because a zero deadline turns off only its own phase (see the module doc)."""
        self.cfg = cfg
        self.output_dir = output_dir
        self.process_index, self.process_count, self.attempt = process_index, process_count, attempt
        self.host = socket.gethostname()
        self.enabled = enabled
        self._phase, self._step = "idle", 0
        self._compile_deadline_s = cfg.startup_timeout_s  # set by compiling()
        self._since = time.monotonic()  # when the current deadline started counting
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # (the compile deadline is never shorter than start-up's; a step deadline of 0 is none)
        shortest = min(cfg.hang_timeout_s or cfg.startup_timeout_s, cfg.startup_timeout_s, cfg.checkpoint_timeout_s)
        self._poll_s = poll_s if poll_s is not None else max(0.05, min(1.0, shortest / 20))
        # Every few seconds whatever the deadlines: a peer that declared a hang lingers only LINGER_S.
        self._publish_every_s = min(PUBLISH_MAX_S, max(1.0, shortest / 4))
        self._publisher: threading.Thread | None = None
        self._job_hung = threading.Event()  # set by the publisher: another process declared a hang
        self._fired = threading.Event()  # set when a deadline passed: the publisher stops

    # -- the loop's side (cheap: a lock and two assignments)

    def deadline_s(self, phase: str) -> float | None:
        """The current deadline of `phase`; None: none (idle, or a step deadline of 0)."""
        return {"startup": self.cfg.startup_timeout_s, "compile": self._compile_deadline_s,
                "checkpoint": self.cfg.checkpoint_timeout_s, "step": self.cfg.hang_timeout_s or None,
                "idle": None}[phase]

    def compile_deadline_s(self, last_compile_s: float | None) -> float:
        """The deadline of an XLA compile in progress: never shorter than the start-up deadline, so a
        healthy compile longer than it is not killed at every attempt (and so never cached), yet
        finite, so a process stuck forever in a compile is still caught.

        - a compile time is recorded (`compilation_cache.last_compile_s`, the longest of the run):
          max(startup_timeout_s, COMPILE_FACTOR x it);
        - none is (the first attempt, the cache off, or every earlier attempt killed mid-compile,
          which records nothing): startup_timeout_s x 2^attempt, at most x COMPILE_GROWTH_MAX, so
          the attempts after a killed compile give it twice as long each time until it completes.
        """
        if last_compile_s is not None and last_compile_s > 0:
            return max(self.cfg.startup_timeout_s, COMPILE_FACTOR * last_compile_s)
        return self.cfg.startup_timeout_s * min(2.0 ** max(self.attempt, 0), COMPILE_GROWTH_MAX)

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

    @contextlib.contextmanager
    def compiling(self, last_compile_s: float | None = None) -> Iterator[None]:
        """Run an XLA compile under the compile deadline (`compile_deadline_s(last_compile_s)`)
        instead of the current phase's; afterwards that phase continues, counted anew. Idle stays
        idle: a compile between notebook calls had no deadline before and gets none now."""
        with self._lock:
            idle = self._phase == "idle"
            if not idle:
                self._compile_deadline_s = self.compile_deadline_s(last_compile_s)
        if idle:
            yield
            return
        with self.phase("compile"):
            yield

    def start(self) -> "Watchdog":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="jaxtrain-watchdog", daemon=True)
            self._thread.start()
            if self.process_count > 1:
                self._publisher = threading.Thread(target=self._share, name="jaxtrain-watchdog-publish", daemon=True)
                self._publisher.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._publisher is not None:
            self._publisher.join(timeout=1)  # it may be stuck in a coordinator call: it is a daemon
            self._publisher = None

    # -- the threads

    def _watch(self) -> None:
        """The deadline check: local state only, never the network, so nothing can keep it from firing."""
        while not self._stop.wait(self._poll_s):
            with self._lock:
                phase, step, since = self._phase, self._step, self._since
            deadline = self.deadline_s(phase)
            stalled = time.monotonic() - since
            overdue = deadline is not None and stalled > deadline
            if overdue or self._job_hung.is_set():
                self._fire(phase, step, stalled, deadline, job_hang=not overdue)
                return

    def _share(self) -> None:
        """The publisher thread (multi-process jobs): progress out, peers' hang declarations in."""
        while not self._fired.is_set():
            with self._lock:
                phase, step = self._phase, self._step
            if self._publish(step, phase):
                self._job_hung.set()
                return
            if self._stop.wait(self._publish_every_s):
                return

    def _publish(self, step: int, phase: str) -> bool:
        """Publish this process's progress; True when another process of the job has declared a hang
        (then this one stops too: the job restarts as a whole)."""
        if self.process_count == 1:
            return False
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

    def _report_budget_s(self) -> float:
        """How long the reporting may take in all, by its steps' bounds: the backstop's delay."""
        budget = STACKS_TIMEOUT_S + 2 * STDERR_TIMEOUT_S + EVENT_TIMEOUT_S + BACKSTOP_MARGIN_S  # stderr: stacks, message
        if self.process_count > 1:
            budget += KV_TIMEOUT_S + (KV_TIMEOUT_S + LINGER_S)  # progress read; declare and linger
        return budget

    def _fire(self, phase: str, step: int, stalled: float, deadline: float | None, job_hang: bool = False) -> None:
        self._fired.set()
        _arm_backstop(self._report_budget_s())  # before any I/O: whatever it does, the process ends with 75
        try:
            self._report(phase, step, stalled, deadline, job_hang)
        except BaseException:  # noqa: BLE001 -- nothing may stand between a hang and the exit
            pass
        os._exit(EXIT_RESTART)  # the main thread may be stuck in C++: no clean shutdown is possible

    def _report(self, phase: str, step: int, stalled: float, deadline: float | None, job_hang: bool) -> None:
        """Stacks, `hang` event, coordinator, message: each step guarded and bounded on its own, so a
        full, read-only or stalled disk or a wedged coordinator costs that step only."""
        stacks, stacks_error = _bounded(STACKS_TIMEOUT_S, self.dump_stacks)
        if stacks_error is not None:  # stacks are the point of a hang report: stderr (the job log) then
            _bounded(STDERR_TIMEOUT_S, lambda: faulthandler.dump_traceback(file=sys.stderr, all_threads=True))
        progress, _ = _bounded(KV_TIMEOUT_S, self._progress_of_all) if self.process_count > 1 else ({}, None)
        details: dict[str, Any] = {
            "process": self.process_index, "host": self.host, "phase": phase, "stalled_s": round(stalled, 1),
            "deadline_s": deadline, "attempt": self.attempt, "stacks": stacks,
            "detected_by": "another process" if job_hang else "deadline"}
        if stacks_error is not None:
            details["stacks_error"] = stacks_error
        if progress:
            details["progress"] = {str(p): v["step"] for p, v in sorted(progress.items())}
            lowest = min(v["step"] for v in progress.values())
            details["behind"] = sorted(p for p, v in progress.items() if v["step"] == lowest)
        _, event_error = _bounded(EVENT_TIMEOUT_S, lambda: append_event(self.output_dir, "hang", step, **details))
        if self.process_count > 1:
            _bounded(KV_TIMEOUT_S + LINGER_S, self._declare_and_linger)
        where = f"stacks in {stacks}" if stacks_error is None else f"stacks not written ({stacks_error}; on stderr)"
        if event_error is not None:
            where += f"; hang event not written ({event_error})"
        limit = "none" if deadline is None else f"{deadline:g} s"
        _bounded(STDERR_TIMEOUT_S, lambda: print(
            f"jaxtrain: process {self.process_index} on {self.host} made no progress for {stalled:.0f} s "
            f"(phase {phase}, deadline {limit}, last step {step}); {where}; exiting 75 "
            "so the job is restarted", file=sys.stderr, flush=True))

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


def _bounded(timeout_s: float, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """`fn()` in a daemon thread, waited for at most `timeout_s`: (its result, None), or (None, why
    not). A step that blocks (open() on a stalled filesystem releases the GIL) is left behind: the
    exit that follows ends it."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 -- reported to the caller, never raised in a thread
            box["error"] = f"{type(e).__name__}: {e}"

    try:
        t = threading.Thread(target=run, name="jaxtrain-watchdog-report", daemon=True)
        t.start()
    except Exception as e:  # no thread to be had: the step is given up, not run unbounded
        return None, f"{type(e).__name__}: {e}"
    t.join(timeout_s)
    if t.is_alive():
        return None, f"timed out after {timeout_s:g} s"
    return box.get("result"), box.get("error")


def _arm_backstop(after_s: float) -> None:
    """End the process with 75 in `after_s` whatever happens meanwhile (reporting stuck past its
    bounds, a blocked stderr). A thread, not faulthandler.dump_traceback_later(exit=True), which
    exits 1: the supervisor must see "restart me"."""
    def backstop() -> None:
        time.sleep(after_s)
        os._exit(EXIT_RESTART)

    try:
        threading.Thread(target=backstop, name="jaxtrain-watchdog-backstop", daemon=True).start()
    except Exception:  # no thread to be had: the bounded reporting still ends in os._exit
        pass
