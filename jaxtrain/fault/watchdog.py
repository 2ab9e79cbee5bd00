"""The hang watchdog: a process that stops making progress is noticed, explained and restarted.

The loop reports progress (`beat(step)`) every step and says what it is doing (`phase`): starting
(restore, first compile and first step: `fault.startup_timeout_s`), an XLA compile in progress
(`compiling()`: see `compile_deadline_s`), a checkpoint save or restore (`fault.checkpoint_timeout_s`),
or ordinary steps (`fault.hang_timeout_s` between two steps). A daemon thread checks the deadline of
the current phase. Each key turns off only its own deadline: `fault.hang_timeout_s: 0` leaves the
start-up, compile and checkpoint deadlines running (those two keys must be positive). Only the
`enabled=False` argument (a Trainer with write_files=False) means "no watchdog at all". When a
deadline passes:

1. every Python thread's stack is written to `<run dir>/hangs/a<attempt>/p<process>-<host>.txt`
   (every process that notices; one folder per attempt);
2. ONE process of the job writes the job's `hang` event to events.jsonl: the lowest-numbered live
   one (process 0 unless its heartbeat is stale), with the verdict (`hang_verdict`): `behind`, the
   processes blamed, and a bounded summary (counts, the blamed processes' progress), never the
   whole job's progress, so the line stays small at any P (one writer: no interleaved appends of
   1,000 NFS clients);
3. the process exits with 75 ("restart me"), and the supervisor (`jaxtrain launch`, SLURM requeue,
   a Kubernetes restart policy) restarts the job from its last checkpoint.

A process stuck inside a collective because another process hung makes no progress either, so
every process of a hung job notices within its own deadline; and the first to notice declares the
hang to the coordination service, where the others' watchdogs see it within seconds and stop too
(each with its own stacks): the whole job restarts, not just the one that hung. The thread needs no cooperation from the main thread, which may be blocked in C++
(JAX releases the GIL while waiting on the device or a collective).

Multi-process jobs: a second daemon thread publishes this process's heartbeat to the coordination
service every few seconds (never from the training loop, never per step): the wall time of the
publish and of the last beat, the phase and step, and the step marks (`step_marks.py`: how far
this process's devices got through the compiled step, from host callbacks at its start and end).
One key set and one counter read per publish, whatever P. It is a thread of its own so that a
wedged coordinator connection cannot stop the deadline from being checked. The verdict
(`hang_verdict`, docs/fault.md "Who is blamed for a hang"):

- processes whose heartbeat is stale (older than `stale_after_s`, 3 publish periods) or missing are
  blamed: frozen (SIGSTOP), dead, or cut off, they are what the others wait for;
- otherwise the processes furthest behind by (device step started, device step ended, host step
  finished) are blamed, unless every process is at the same place: then nobody is (`behind: []`),
  as a hang inside a collective that every device entered blames no one.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from jaxtrain.storage.paths import is_remote
from jaxtrain.config import FaultConfig
from jaxtrain.runtime.exit_codes import EXIT_RESTART
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
STALE_PUBLISHES = 3  # a heartbeat older than this many publish periods is stale: that process stopped
LISTED_MAX = 64  # the `hang` event lists at most this many blamed processes (and counts them all)
DETAILED_MAX = 8  # ... and gives the progress of at most this many of them
PROGRESS_DIR = "jaxtrain/progress/"  # one heartbeat key per process
HANG_COUNT = "jaxtrain/hang_count"  # how many processes declared the hang (a counter: O(1) bytes to read)


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
        self._beat_time = time.time()  # wall time of the last beat (published: peers compare it)
        self.marks: Any = None  # a step_marks.StepMarks once the step carries them (the trainer sets it)
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

    @property
    def stale_after_s(self) -> float:
        """A heartbeat older than this is stale (its process stopped publishing). Shorter than any
        deadline above 4 s, so a process frozen when the others' deadline passes is seen as such."""
        return STALE_PUBLISHES * self._publish_every_s

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
            self._beat_time = time.time()

    def progress(self) -> None:
        """Progress inside the current step and phase (an evaluation read back batch by batch): its
        deadline counts anew, so long healthy work between two steps is not taken for a hang."""
        with self._lock:
            self._since = time.monotonic()
            self._beat_time = time.time()

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
        """The publisher thread (multi-process jobs): heartbeat out, peers' hang declarations in."""
        while not self._fired.is_set():
            if self._publish():
                self._job_hung.set()
                return
            if self._stop.wait(self._publish_every_s):
                return

    def heartbeat(self) -> dict[str, Any]:
        """What this process publishes: its phase, last finished step and that beat's wall time, the
        publish's wall time, and (when the step carries them) the step marks of its devices."""
        with self._lock:
            record: dict[str, Any] = {"step": self._step, "phase": self._phase, "beat": round(self._beat_time, 3)}
        if self.marks is not None:
            record.update(self.marks.snapshot())
        record["time"] = round(time.time(), 3)
        return record

    def _publish(self) -> bool:
        """Publish this process's heartbeat (one key set, one counter read: O(1) per process whatever
        P); True when another process of the job has declared a hang (then this one stops too: the
        job restarts as a whole)."""
        if self.process_count == 1:
            return False
        try:
            from jaxtrain.runtime.multihost import client
            kv = client()
            kv.key_value_set(f"{PROGRESS_DIR}{self.process_index}", json.dumps(self.heartbeat()), allow_overwrite=True)
            return kv.key_value_increment(HANG_COUNT, 0) > 0
        except Exception:  # the coordinator may be gone: that is for the deadline to notice
            return False

    def _declare_and_linger(self, expected: Optional[int] = None) -> None:
        """Tell the job, then give the other processes a moment to notice and dump their stacks too
        (exiting at once would break their collectives, and they would die without a word). Waits
        until `expected` processes (default: all; the verdict's live ones where known) declared, or
        LINGER_S; polls one counter (O(1) bytes a poll, whatever P)."""
        if self.process_count == 1:
            return
        expected = self.process_count if expected is None else expected
        try:
            from jaxtrain.runtime.multihost import client
            kv = client()
            kv.key_value_increment(HANG_COUNT, 1)
            deadline = time.monotonic() + LINGER_S
            while time.monotonic() < deadline and kv.key_value_increment(HANG_COUNT, 0) < expected:
                time.sleep(0.2)
        except Exception:
            pass

    def _job_view(self) -> tuple[bool, Optional["Verdict"]]:
        """(whether this process writes the job's `hang` event, the verdict where it was read).

        The writer is the lowest-numbered live process. Process 0 reads every heartbeat (one
        directory read) and writes; another process first reads process 0's heartbeat alone (one
        small read): fresh, and process 0 writes, this one does not. Only when process 0's is stale
        or missing does it read them all, and it writes when every process below it is stale. When
        the coordination service does not answer (it runs in process 0), process 1 writes, blaming
        process 0. Bounded RPCs: at most two per process; O(P) bytes in all unless process 0 stopped."""
        if self.process_count == 1:
            return True, None
        from jaxtrain.runtime.multihost import client
        kv = client()  # looked up here: the bounded reads run in threads of their own
        now = time.time
        if self.process_index > 0:
            first, error = _bounded(KV_TIMEOUT_S, lambda: kv.key_value_try_get(f"{PROGRESS_DIR}0"))
            if error is not None and "NOT_FOUND" not in error:  # no answer: the service (in process 0) is gone
                return self.process_index == 1, Verdict(
                    behind=[0], reason=f"the coordination service did not answer ({error}): it runs in process 0",
                    processes=self.process_count)
            if first is not None and now() - float(json.loads(first).get("time", 0.0)) <= self.stale_after_s:
                return False, None
        heartbeats, error = _bounded(KV_TIMEOUT_S, lambda: {
            int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in kv.key_value_dir_get(PROGRESS_DIR)})
        if error is not None:
            return self.process_index <= 1, None
        verdict = hang_verdict(heartbeats, self.process_count, now(), self.stale_after_s)
        stopped = set(verdict.stale) | set(verdict.silent)
        return all(p in stopped for p in range(self.process_index)), verdict

    def _report_budget_s(self) -> float:
        """How long the reporting may take in all, by its steps' bounds: the backstop's delay."""
        budget = STACKS_TIMEOUT_S + 2 * STDERR_TIMEOUT_S + EVENT_TIMEOUT_S + BACKSTOP_MARGIN_S  # stderr: stacks, message
        if self.process_count > 1:
            budget += 2 * KV_TIMEOUT_S + (KV_TIMEOUT_S + LINGER_S)  # heartbeat reads; declare and linger
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
        """Stacks, the verdict, `hang` event (one writer per job), coordinator, message: each step
        guarded and bounded on its own, so a full, read-only or stalled disk or a wedged coordinator
        costs that step only."""
        stacks, stacks_error = _bounded(STACKS_TIMEOUT_S, self.dump_stacks)
        if stacks_error is not None:  # stacks are the point of a hang report: stderr (the job log) then
            _bounded(STDERR_TIMEOUT_S, lambda: faulthandler.dump_traceback(file=sys.stderr, all_threads=True))
        view, _ = _bounded(2 * KV_TIMEOUT_S + 1.0, self._job_view)  # (each read inside is bounded too)
        writes, verdict = view if view is not None else (self.process_index <= 1, None)
        event_error: str | None = None
        if writes:
            details: dict[str, Any] = {
                "process": self.process_index, "host": self.host, "phase": phase, "stalled_s": round(stalled, 1),
                "deadline_s": deadline, "attempt": self.attempt, "stacks": stacks,
                "stacks_dir": str(Path(stacks).parent) if stacks else None,
                "detected_by": "another process" if job_hang else "deadline"}
            if stacks_error is not None:
                details["stacks_error"] = stacks_error
            if verdict is not None:
                details.update(verdict.summary())
            _, event_error = _bounded(EVENT_TIMEOUT_S, lambda: append_event(self.output_dir, "hang", step, **details))
        if self.process_count > 1:
            live = None if verdict is None else self.process_count - len(verdict.stale) - len(verdict.silent)
            _bounded(KV_TIMEOUT_S + LINGER_S, lambda: self._declare_and_linger(live))
        where = f"stacks in {stacks}" if stacks_error is None else f"stacks not written ({stacks_error}; on stderr)"
        if not writes:
            where += "; the job's hang event is written by a lower-numbered process"
        elif event_error is not None:
            where += f"; hang event not written ({event_error})"
        if verdict is not None:
            where += f"; blamed: {verdict.behind[:LISTED_MAX] or 'nobody'} ({verdict.reason})"
        limit = "none" if deadline is None else f"{deadline:g} s"
        # Straight to file descriptor 2: no Python lock (sys.stderr's, logging's) that a wedged thread may hold.
        report = (f"jaxtrain: process {self.process_index} on {self.host} made no progress for {stalled:.0f} s "
                  f"(phase {phase}, deadline {limit}, last step {step}); {where}; exiting 75 "
                  "so the job is restarted\n").encode("utf-8", errors="replace")
        _bounded(STDERR_TIMEOUT_S, lambda: os.write(2, report))

    def dump_stacks(self) -> str:
        """Every thread's Python stack into the run directory's hangs/a<attempt>/ folder (a remote run
        directory: ./hangs/a<attempt>/ on this host); returns the path."""
        name = f"p{self.process_index}-{self.host}.txt"
        base = Path(self.output_dir) / "hangs" if not is_remote(self.output_dir) else Path("hangs")
        folder = base / f"a{self.attempt}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        with open(path, "w") as f:
            f.write(f"process {self.process_index} on {self.host}, attempt {self.attempt}, {time.ctime()}\n")
            f.write(f"heartbeat: {json.dumps(self.heartbeat())}\n\n")
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                f.write(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)  # the C-level view as well
        return str(path)


@dataclass
class Verdict:
    """Who a hang is blamed on (`hang_verdict`), and the bounded summary the `hang` event carries."""

    behind: list[int]  # the processes blamed, exactly (empty: nobody)
    reason: str
    processes: int
    reporting: int = 0  # processes with a heartbeat
    stale: list[int] = field(default_factory=list)  # heartbeat older than stale_after_s
    silent: list[int] = field(default_factory=list)  # no heartbeat at all
    blamed: dict[int, dict] = field(default_factory=dict)  # progress of (at most DETAILED_MAX of) the blamed
    rest: Optional[dict] = None  # where most of the others are

    def summary(self) -> dict[str, Any]:
        """The `hang` event's verdict fields: O(1) in size whatever P (LISTED_MAX, DETAILED_MAX)."""
        out: dict[str, Any] = {"behind": self.behind[:LISTED_MAX], "blamed_count": len(self.behind),
                               "verdict": self.reason, "processes": self.processes, "reporting": self.reporting,
                               "stale": len(self.stale), "silent": len(self.silent)}
        if len(self.behind) > LISTED_MAX:
            out["behind_truncated"] = True
        if self.blamed:
            out["blamed"] = {str(p): v for p, v in self.blamed.items()}
        if self.rest is not None:
            out["rest"] = self.rest
        return out


def _position(heartbeat: Mapping[str, Any]) -> tuple[int, int, int]:
    """How far a process got: (device step started, device step ended, host step finished); -1
    where the step carries no marks (then all processes lack them and the host step decides)."""
    def mark(name: str) -> int:
        value = heartbeat.get(name)
        return int(value[0]) if value else -1
    return mark("started"), mark("ended"), int(heartbeat.get("step", 0))


def _progress(heartbeat: Mapping[str, Any], now: float) -> dict[str, Any]:
    started, ended, step = _position(heartbeat)
    out: dict[str, Any] = {"step": step, "phase": heartbeat.get("phase"),
                           "beat_age_s": round(now - float(heartbeat.get("beat", now)), 1),
                           "heartbeat_age_s": round(now - float(heartbeat.get("time", now)), 1)}
    if started >= 0:
        out.update(started=started, ended=ended)
    return out


def hang_verdict(heartbeats: Mapping[int, Mapping[str, Any]], process_count: int, now: float,
                 stale_after_s: float) -> Verdict:
    """Who the job's hang is blamed on, from every process's heartbeat (`Watchdog.heartbeat`).

    1. Processes without a heartbeat, or whose heartbeat is older than `stale_after_s` (wall clock,
       `now`), stopped publishing: a frozen (SIGSTOP), dead or cut-off host. They are blamed.
    2. Otherwise: the processes furthest behind by (device step started, device step ended, host
       step finished), compared in that order. A hung host or device never starts the step its
       peers' devices are in (they wait for it in the step's collectives); a device that hangs
       before the step's end leaves its peers' ends ahead. Blamed unless every process is at the
       same place, which blames nobody (`behind == []`: a hang inside a collective that every device
       entered, or a stall every host shares, says nothing about whose fault it is).
    """
    silent = [p for p in range(process_count) if p not in heartbeats]
    stale = sorted(p for p, h in heartbeats.items() if now - float(h.get("time", 0.0)) > stale_after_s)
    stopped = sorted(set(silent) | set(stale))
    verdict = Verdict(behind=[], reason="", processes=process_count, reporting=len(heartbeats),
                      stale=stale, silent=silent)
    live = {p: h for p, h in heartbeats.items() if p not in stopped}
    if stopped and live:
        verdict.behind = stopped
        verdict.reason = (f"heartbeat stale (older than {stale_after_s:g} s) or missing: stopped publishing "
                          "(frozen, dead or cut off)")
    elif not live:
        verdict.reason = "no live heartbeat at all: nobody can be told from the others"
        return verdict
    else:
        positions = {p: _position(h) for p, h in live.items()}
        lowest = min(positions.values())
        behind = sorted(p for p, at in positions.items() if at == lowest)
        if len(behind) == len(live):
            started, ended, step = lowest
            verdict.reason = (f"every process at the same place (host step {step}"
                              + (f", devices in step {started}, ended {ended}" if started >= 0 else "")
                              + "): nobody is behind")
        else:
            verdict.behind = behind
            ahead = max(positions.values())
            what = ("device step not started" if lowest[0] < ahead[0] else
                    "device step not finished" if lowest[1] < ahead[1] else "host behind")
            verdict.reason = f"{what}: furthest behind by (device step started, ended, host step) {list(lowest)}"
    verdict.blamed = {p: _progress(heartbeats[p], now) if p in heartbeats else {"heartbeat": None}
                      for p in verdict.behind[:DETAILED_MAX]}
    others = [p for p in live if p not in verdict.behind]
    if others:
        counts: dict[tuple, int] = {}
        for p in others:
            counts[_position(live[p])] = counts.get(_position(live[p]), 0) + 1
        common = max(counts, key=lambda at: counts[at])
        example = next(p for p in others if _position(live[p]) == common)
        verdict.rest = {**_progress(live[example], now), "count": counts[common], "of": len(others)}
    return verdict


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
