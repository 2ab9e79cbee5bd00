"""Start P local processes of one JAX job and supervise them (what `jaxtrain launch` runs;
its parser and `main` are `jaxtrain/commands/launch.py`).

    jaxtrain launch --num-processes 2 --cpu-devices 2 -- train --config configs/tiny.yaml train.steps=20

Each process runs `python -m jaxtrain train ...` with JAXTRAIN_COORDINATOR (127.0.0.1:PORT),
JAXTRAIN_NUM_PROCESSES and JAXTRAIN_PROCESS_ID set (read by jaxtrain.runtime.distributed), plus
JAXTRAIN_RESTART_ATTEMPT (0 on the first attempt). Output lines are prefixed with `[p{i}]`.

This module owns the processes: starting them, forwarding their output and signals, stopping them
(SIGTERM, SIGKILL after --grace-period-s), and the `restart` / `isolate` / `isolate_refused` events.
What to do when an attempt ends is `policy.decide` (exit codes as in DESIGN §4):
- all processes exit 0 -> exit 0;
- one exits 2 (bad config/usage/input) -> stop the others, exit 2; a user error is never restarted;
- one exits 78 ("stop, a human is needed": the rollback budget is spent, ...) -> the same, exit 78;
- the same Python error (its `error` event: type, innermost jaxtrain frame, step) ends two attempts
  in a row that made no progress (no checkpoint saved past the one resumed from) -> a deterministic
  failure: exit 78, not restarted;
- one exits 75 ("restart me"), exits non-zero otherwise, or dies from a signal -> stop the others
  and restart the whole job with the same command on a new port, at most --max-restarts times. The
  trainer resumes from the latest checkpoint in run.output_dir by itself; the launcher appends a
  `restart` event to <run.output_dir>/events.jsonl.
- SIGTERM/SIGINT sent to the launcher are forwarded to every process; the job is then not restarted.
- Node isolation (`--isolate-after K`): when the same slot (process position) is blamed for K
  attempts in a row, it is treated as a bad node: the job continues from its checkpoint without it, on
  fewer processes, with the data-parallel part of the mesh shrunk and `train.grad_accum` raised so that
  the global batch and the data order stay exactly the same (`elastic.plan_shrink`). An `isolate`
  event names the slot and host. Each process sees JAXTRAIN_SLOT, the slot it runs in (kept when
  other slots go).

The launcher never imports JAX: it only parses the config (to find run.output_dir) and watches
processes, so it stays light and cannot grab devices its children need.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Sequence

from jaxtrain.runtime import env
from jaxtrain.config import ConfigError
from jaxtrain.runtime.exit_codes import EXIT_HUMAN, EXIT_OK, EXIT_RESTART
from jaxtrain.launch.elastic import Shrink, ShrinkRefused
from jaxtrain.launch.policy import (Attempt, Done, Exit, GiveUp, History, Isolate, Limits, Stop, attempt_steps, decide,
                                    exit_after_signal, made_progress)
from jaxtrain.launch.runfiles import count_events, last_known_step, read_events
from jaxtrain.observe.runlog import append_event

POLL_INTERVAL_S = 0.1
KILL_WAIT_S = 10.0  # how long to wait for a process after SIGKILL before going on without it


# ----------------------------------------------------------------------------- small helpers


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it).

    Returns:
      The port number. Another program may still take it before the coordinator binds it; the
      window is milliseconds, and a restart picks a new one anyway.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(returncode: int) -> str:
    """Human words for a Popen return code ('exited with code 75 (restart requested)', 'killed by SIGKILL').

    Args:
      returncode: Popen.returncode; negative means the process died from that signal.
    Returns:
      A short phrase for logs and the `restart` event's reason.
    """
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    if returncode == EXIT_RESTART:
        return f"exited with code {returncode} (restart requested)"
    return f"exited with code {returncode}"


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it if the launcher dies (Linux only).

    Without this a SIGKILLed launcher would leave its children training (and holding devices) as
    orphans. The children start in their own sessions, so no terminal signal reaches them either.
    """
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _load_prctl():
    # Resolved once in the parent: the child between fork and exec should do as little as possible.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


# ----------------------------------------------------------------------------- the supervisor


class Supervisor:
    """Runs one job of P local processes, restarting it as a whole when a process fails.

    Usable without the CLI (tests give it any command): `Supervisor(cmd, 2).run()`.

    Slots: process i of the first attempt runs in slot i. When a slot is isolated, the others keep
    their slot numbers (and are renumbered 0..P-2 as processes), so "the same slot failed again"
    means the same place, as a node would be.
    """

    def __init__(self, command: Sequence[str], num_processes: int, *, output_dir: str | Path | None = None,
                 max_restarts: int = 3, port: int = 0, grace_period_s: float = 10.0,
                 env: dict[str, str] | None = None, out: IO[str] | None = None, err: IO[str] | None = None,
                 isolate_after: int = 0, plan_isolation: Callable[[int, list[str]], Shrink] | None = None,
                 host: str | None = None):
        """Args:
          command: the argv every process runs (the per-process part is the environment).
          num_processes: P, the processes of the job.
          output_dir: run.output_dir, where `restart` events go (None: none are written).
          max_restarts: how many times the whole job may be restarted after failures.
          port: the coordinator port of the first attempt, attempt n uses port + n (0: a free port
            each attempt; a killed coordinator's port may linger in TIME_WAIT, so never reuse one).
          grace_period_s: how long processes get after SIGTERM before SIGKILL.
          env: base environment of the processes (default: this process's).
          out, err: where the prefixed stdout/stderr lines go (default: sys.stdout / sys.stderr).
          isolate_after: K > 0: a slot that is blamed for K attempts in a row is isolated and the
            job continues without it (0: never). Counts against max_restarts like any restart.
          plan_isolation: `plan(processes_now, overrides_now) -> Shrink` for the job one process smaller
            (overrides_now: those of earlier isolations); raises ShrinkRefused when there is none. Its
            overrides replace the earlier ones at the end of `command`.
          host: the host name the `isolate` event gives for a slot (default: this machine's).
        """
        if num_processes < 1:
            raise ConfigError(f"--num-processes must be at least 1, got {num_processes}")
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, got {max_restarts}")
        if isolate_after < 0:
            raise ConfigError(f"--isolate-after must be 0 (off) or more, got {isolate_after}")
        if isolate_after > max_restarts:
            raise ConfigError(f"--isolate-after {isolate_after} needs --max-restarts >= {isolate_after}: "
                              f"{isolate_after - 1} restart(s) to see {isolate_after} failures in a row, and one "
                              "to continue without the slot")
        if isolate_after and plan_isolation is None:
            raise ValueError("isolate_after needs plan_isolation")
        self.command = list(command)
        self.extra_args: list[str] = []  # overrides of the latest isolation, appended to `command`
        self.num_processes = num_processes
        self.slots = list(range(num_processes))  # slot of process i; an isolated slot is removed
        self.isolate_after = isolate_after
        self.plan_isolation = plan_isolation
        self.host = host or socket.gethostname()
        self.history = History()  # which slot each failed attempt counted against (policy.History)
        self._last_step = -1  # the latest step an attempt resumed from or saved (for policy.made_progress)
        self.output_dir = output_dir  # kept as given: Path() would mangle gs://...
        self.max_restarts = max_restarts
        self.port = port
        self.grace_period_s = grace_period_s
        self.env = dict(os.environ if env is None else env)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self._print_lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._exit_order: list[int] = []  # processes of this attempt in the order they exited
        self._exit_lock = threading.Lock()
        self._events_at_start = 0  # events.jsonl lines before this attempt started
        self._stop_signal: int | None = None  # set when the launcher itself was told to stop

    # -- output

    def say(self, message: str) -> None:
        """One line from the launcher itself, on stderr, prefixed `[launch]`."""
        with self._print_lock:
            self.err.write(f"[launch] {message}\n")
            self.err.flush()

    def _pump(self, stream: IO[bytes], prefix: str, sink: IO[str]) -> None:
        # One thread per child stream: lines are forwarded as they come, whole, under one lock so
        # lines of different processes never interleave mid-line.
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self._print_lock:
                sink.write(f"{prefix} {line}\n")
                sink.flush()
        stream.close()

    # -- processes

    def _start(self, attempt: int, port: int) -> None:
        self._procs, self._threads, self._exit_order = [], [], []
        self._events_at_start = count_events(self.output_dir)  # this attempt's events come after
        for i in range(self.num_processes):
            child_env = {**self.env,
                         env.COORDINATOR: f"127.0.0.1:{port}",
                         env.NUM_PROCESSES: str(self.num_processes),
                         env.PROCESS_ID: str(i),
                         env.SLOT: str(self.slots[i]),
                         env.RESTART_ATTEMPT: str(attempt),
                         "PYTHONUNBUFFERED": "1"}  # lines reach us (and the user) as they are printed
            # start_new_session: each child leads its own process group, so signals we send reach
            # its helpers too (killpg), and a terminal's Ctrl-C reaches only us (we forward it once).
            self._procs.append(subprocess.Popen(
                self.command + self.extra_args, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_die_with_parent))
        # Threads start only after every fork: forking (with preexec_fn) while other threads run is
        # what Python warns against.
        for i, p in enumerate(self._procs):
            for stream, sink in ((p.stdout, self.out), (p.stderr, self.err)):
                t = threading.Thread(target=self._pump, args=(stream, f"[p{i}]", sink), daemon=True)
                t.start()
                self._threads.append(t)
            # One waiter per process records the exit order: when a crash makes its peers fail too
            # (a broken collective), the first to exit is the cause, even within one poll interval.
            t = threading.Thread(target=self._reap, args=(i, p), daemon=True)
            t.start()
            self._threads.append(t)

    def _reap(self, i: int, p: subprocess.Popen) -> None:
        p.wait()
        with self._exit_lock:
            self._exit_order.append(i)

    def _signal_all(self, sig: int) -> None:
        for p in self._procs:
            if p.returncode is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass  # already gone

    def _stop_all(self, already_signalled: bool = False) -> None:
        """SIGTERM every live process, SIGKILL whatever is left after the grace period, reap all.

        Args:
          already_signalled: the processes were just sent SIGTERM/SIGINT (forwarded): don't send SIGTERM again.
        """
        if not already_signalled:
            self._signal_all(signal.SIGTERM)
        # Note: a process inside jax.distributed catches SIGTERM (JAX's preemption notifier) and keeps
        # running unless the trainer acts on it, so SIGKILL after the grace period is the usual end.
        deadline = time.monotonic() + self.grace_period_s
        while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        if any(p.poll() is None for p in self._procs):
            self.say(f"processes still running {self.grace_period_s:g} s after the signal: sending SIGKILL")
        self._signal_all(signal.SIGKILL)
        for i, p in enumerate(self._procs):
            try:
                p.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                # SIGKILL does not end a process in uninterruptible sleep (D state: a hung NFS or GPU
                # driver call): waiting for it would block the launcher forever. Say so and go on;
                # its exit code stays unknown (None) and the kernel reaps it whenever it wakes.
                self.say(f"process {i} (pid {p.pid}) still alive {KILL_WAIT_S:g} s after SIGKILL "
                         "(uninterruptible sleep?): going on without it")
        self._join_output()

    def _join_output(self) -> None:
        # The pipes close when the processes are gone. One deadline for all: the threads of a process
        # that outlived SIGKILL never end, and must not hold the launcher 5 s each.
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _wait(self) -> list[Exit] | None:
        """Wait for the job. Returns None when the launcher was signalled; else the exits known when
        the first process failed (in the order they happened; every other process has then been
        stopped), or every process's exit 0."""
        while True:
            if self._stop_signal is not None:
                return None  # run() handles the forwarded signal
            with self._exit_lock:
                order = list(self._exit_order)
            codes = [p.returncode for p in self._procs]  # set by the waiter threads
            if any(codes[i] != EXIT_OK for i in order):
                self._stop_all()
                return [Exit(i, codes[i]) for i in order]
            if all(c == EXIT_OK for c in codes):
                self._join_output()
                return [Exit(i, EXIT_OK) for i in range(len(codes))]
            time.sleep(POLL_INTERVAL_S)

    # -- signals

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum
            self._signal_all(signum)  # children save / exit cleanly on their own terms
        else:
            self._signal_all(signal.SIGKILL)  # asked twice: stop now

    def _finish_after_signal(self) -> int:
        signum = self._stop_signal
        self.say(f"received {signal.Signals(signum).name}: forwarded to all processes; not restarting")
        self._stop_all(already_signalled=True)
        return exit_after_signal([p.returncode for p in self._procs], signum)

    # -- the loop

    def run(self) -> int:
        """Run the job until it succeeds, hits a user error, runs out of restarts, or is signalled.

        Returns:
          0 when every process exited 0; 2 on a user error; 78 when a human is needed (a process exited
          78, or the same Python error ended two attempts in a row); 75 or 128+signal after SIGTERM/SIGINT;
          otherwise the failing process's exit code (128+signal for a signal) once restarts are spent.
        """
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            return self._run()
        finally:
            self._signal_all(signal.SIGKILL)  # a no-op unless an exception got here: leave no orphans
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        attempt = 0
        while True:
            if self._stop_signal is not None:  # signalled between two attempts
                return self._finish_after_signal()
            port = self.port + attempt if self.port else free_port()
            self.say(f"attempt {attempt}: starting {self.num_processes} processes, coordinator 127.0.0.1:{port}")
            self._start(attempt, port)
            exits = self._wait()
            if self._stop_signal is not None or exits is None:
                return self._finish_after_signal()
            events = tuple(read_events(self.output_dir, self._events_at_start))
            restored, saved = attempt_steps(events, self._last_step)
            self._last_step = max(restored, saved)
            ended = Attempt(exits=tuple(exits), slots=tuple(self.slots), events=events,
                            progress=made_progress(restored, saved))
            decision = decide(ended, self.history,
                              Limits(restarts_left=self.max_restarts - attempt, isolate_after=self.isolate_after))
            if isinstance(decision, Done):
                self.say("all processes exited 0")
                return EXIT_OK
            if isinstance(decision, Stop):
                what = "a human is needed" if decision.code == EXIT_HUMAN else "user error"
                self.say(f"process {decision.process} {describe_exit(decision.code)} ({what}): stopped the others; "
                         "not restarting")
                return decision.code
            self.history = decision.history
            failure = decision.failure
            reason = f"process {failure.process} {describe_exit(failure.code)}"
            if isinstance(decision, GiveUp) and decision.code == EXIT_HUMAN:  # the same failure twice
                self.say(f"{reason}: {decision.reason} (a human is needed): not restarting")
                return decision.code
            if isinstance(decision, GiveUp):
                self.say(f"{reason}; no restarts left (--max-restarts {self.max_restarts}): giving up")
                return decision.code
            if isinstance(decision, Isolate) and not self._isolate(decision.slot, decision.history.streak):
                return decision.fallback.code  # no smaller job exists: the original failure stands
            attempt += 1
            code = failure.code
            append_event(self.output_dir, "restart", last_known_step(self.output_dir), attempt=attempt,
                         max_restarts=self.max_restarts, process=failure.process, slot=failure.slot,
                         exit_code=code if code >= 0 else None,
                         signal=signal.Signals(-code).name if code < 0 else None, reason=reason)
            self.say(f"{reason}: restarting the job (restart {attempt} of {self.max_restarts})")

    # -- isolation

    def _isolate(self, slot: int, failures: int) -> bool:
        """Continue without `slot`: plan the smaller job, log an `isolate` event. False when refused."""
        step = last_known_step(self.output_dir)
        try:
            plan = self.plan_isolation(self.num_processes, list(self.extra_args))
        except ShrinkRefused as e:
            self.say(f"slot {slot} (host {self.host}) failed {failures} attempts in a row, but the job cannot "
                     f"continue without it: {e}; giving up")
            append_event(self.output_dir, "isolate_refused", step, slot=slot, host=self.host, failures=failures,
                         processes=self.num_processes, reason=str(e))
            return False
        self.say(f"slot {slot} (host {self.host}) failed {failures} attempts in a row: isolating it; continuing "
                 f"on {plan.processes} process(es) with {' '.join(plan.overrides)}")
        append_event(self.output_dir, "isolate", step, slot=slot, host=self.host, failures=failures,
                     from_processes=self.num_processes, processes=plan.processes, mesh=plan.mesh,
                     grad_accum=plan.grad_accum, overrides=plan.overrides)
        self.slots.remove(slot)
        self.num_processes = plan.processes
        self.extra_args = list(plan.overrides)
        return True
