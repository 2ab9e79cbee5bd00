"""`jaxtrain launch`: start P local processes of one JAX job and supervise them.

    jaxtrain launch --num-processes 2 --cpu-devices 2 -- train --config configs/tiny.yaml train.steps=20

Each process runs `python -m jaxtrain.cli train ...` with JAXTRAIN_COORDINATOR (127.0.0.1:PORT),
JAXTRAIN_NUM_PROCESSES and JAXTRAIN_PROCESS_ID set (read by jaxtrain.launch.distributed), plus
JAXTRAIN_RESTART_ATTEMPT (0 on the first attempt). Output lines are prefixed with `[p{i}]`.

Supervision (exit codes as in DESIGN §4):
- all processes exit 0 -> exit 0;
- one exits 2 (bad config/usage/input) -> stop the others, exit 2; a user error is never restarted;
- one exits 75 ("restart me"), exits non-zero otherwise, or dies from a signal -> stop the others
  (SIGTERM, SIGKILL after --grace-period-s) and restart the whole job with the same command on a
  new port, at most --max-restarts times. The trainer resumes from the latest checkpoint in
  run.output_dir by itself; the launcher appends a `restart` event to <run.output_dir>/events.jsonl.
- SIGTERM/SIGINT sent to the launcher are forwarded to every process; the job is then not restarted.
- Node isolation (`--isolate-after K`): when the same slot (process position) is the first to crash K
  attempts in a row, it is treated as a bad node: the job continues from its checkpoint without it, on
  fewer processes, with the data-parallel part of the mesh shrunk and `train.grad_accum` raised so that
  the global batch and the data order stay exactly the same (`plan_shrink`). An `isolate` event names
  the slot and host. Each process sees JAXTRAIN_SLOT, the slot it runs in (kept when other slots go).

The launcher never imports JAX: it only parses the config (to find run.output_dir) and watches
processes, so it stays light and cannot grab devices its children need.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Sequence

from jaxtrain.arguments import Parser, parse, train_parser
from jaxtrain.config import Config, ConfigError, load_config
from jaxtrain.exit_codes import EXIT_OK, EXIT_RESTART, EXIT_USAGE
from jaxtrain.checkpoint.paths import is_remote
from jaxtrain.observe.runlog import append_event

RESTART_ATTEMPT_ENV = "JAXTRAIN_RESTART_ATTEMPT"  # 0 on the first attempt, n on the n-th restart
SLOT_ENV = "JAXTRAIN_SLOT"  # the launcher slot a process runs in; slots keep their number when one is isolated
POLL_INTERVAL_S = 0.1


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


def _last_step_in(path: Path) -> int:
    # Only the file's tail: run files of long runs are large. A process killed mid-write may leave
    # a torn last line, which is skipped.
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # torn or foreign line: look further back
    return -1


def last_known_step(output_dir: str | Path | None) -> int:
    """The last step the run recorded: the later of metrics.jsonl's and events.jsonl's last lines.

    Args:
      output_dir: the run directory (None: unknown).
    Returns:
      That step, or -1 when nothing was recorded (or the directory is remote). Metrics are logged
      every train.log_every steps, events such as checkpoint_saved in between: either may be later.
    """
    if output_dir is None or is_remote(output_dir):
        return -1
    return max(_last_step_in(Path(output_dir) / "metrics.jsonl"), _last_step_in(Path(output_dir) / "events.jsonl"))


def _event_lines(output_dir: str | Path | None) -> list[str]:
    if output_dir is None or is_remote(output_dir) or not (Path(output_dir) / "events.jsonl").exists():
        return []
    return (Path(output_dir) / "events.jsonl").read_text().splitlines()


def blamed_process(output_dir: str | Path | None, since_line: int = 0, since_time: float = 0.0) -> int | None:
    """The one process the run's own events blame for an exit 75: events from line `since_line`
    on, logged at UNIX time `since_time` or later.

    A `hang` event names the processes furthest behind (`behind`), a failed preflight the slow
    ones (`named`); exactly one is evidence against its node. None when no event blames, when it
    blames several, or when the run directory is remote (the launcher reads local files only).
    """
    for line in _event_lines(output_dir)[since_line:]:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if event.get("time", 0.0) < since_time:
            continue
        blamed = event.get("behind") if event.get("kind") == "hang" else (
            event.get("named") if event.get("kind") == "preflight_failed" else None)
        if blamed is not None:
            return blamed[0] if len(blamed) == 1 else None
    return None


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


# ----------------------------------------------------------------------------- isolation: a smaller job

MESH_AXES = ("data", "stage", "fsdp", "tensor")  # as jaxtrain.parallel.mesh.AXES, which imports JAX


class ShrinkRefused(Exception):
    """No smaller job trains the same thing; the message says why (the launcher then gives up)."""


@dataclasses.dataclass(frozen=True)
class Shrink:
    """A job with fewer processes that trains exactly what the larger one did.

    Attributes:
      processes: processes left.
      mesh: the resolved mesh sizes on the devices left (only `data` differs).
      grad_accum: the new `train.grad_accum`.
      overrides: `key=value` strings that turn the old command into the new one (later overrides win).
    """

    processes: int
    mesh: dict[str, int]
    grad_accum: int
    overrides: list[str]


def _resolved_mesh(cfg: Config, num_devices: int) -> dict[str, int]:
    """The mesh sizes on `num_devices` devices, the one -1 axis filled (`jaxtrain.parallel.mesh.resolve_mesh_shape`
    without JAX). Raises ShrinkRefused when they do not fit."""
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [a for a, v in sizes.items() if v == -1]
    if (fill and num_devices % fixed) or (not fill and fixed != num_devices):
        described = ", ".join(f"{a}={v}" for a, v in sizes.items())
        raise ShrinkRefused(f"the mesh ({described}) does not fit {num_devices} devices")
    if fill:
        sizes[fill[0]] = num_devices // fixed
    return sizes


def plan_shrink(cfg: Config, num_processes: int, devices_per_process: int, remove: int = 1) -> Shrink:
    """The job without `remove` of its processes, training the same run: same global batch, same data order.

    What stays: `data.global_batch_size` (so the data loader, whose global order depends only on the
    seed and the sample index, hands out the very same batches), and the model-parallel part of the
    mesh (`stage`, `fsdp`, `tensor`: each parameter keeps its sharding). What changes: `mesh.data`
    shrinks to the devices left, and `train.grad_accum` grows so that no device gets more rows per
    microbatch than before (memory stays within what the larger job used). The loss is the mean over
    all tokens of the step however it is split into microbatches, so the numbers change only by
    float summation order. The checkpoint restores onto the smaller mesh.

    Args:
      cfg: the config the job runs with now (phase-1 parsed, overrides applied).
      num_processes: processes in the job now.
      devices_per_process: devices each process drives.
      remove: processes to take away.
    Returns:
      The plan.
    Raises:
      ShrinkRefused: no process would be left, the devices left do not hold whole model replicas,
        FSDP spans hosts, or no `train.grad_accum` splits the global batch over the devices left.
    """
    left = num_processes - remove
    if left < 1:
        raise ShrinkRefused(f"no process would be left of {num_processes}")
    before, after = num_processes * devices_per_process, left * devices_per_process
    sizes = _resolved_mesh(cfg, before)
    model = sizes["stage"] * sizes["fsdp"] * sizes["tensor"]
    if after % model:
        raise ShrinkRefused(f"the {after} devices left ({left} processes x {devices_per_process}) do not split into "
                            f"model replicas of mesh.stage x mesh.fsdp x mesh.tensor = {model} devices")
    new = {**sizes, "data": after // model}
    overrides = ["mesh.data=-1"]
    # Any other axis set to -1 would grab the change instead of `data`: pin it to its current size.
    overrides += [f"mesh.{a}={sizes[a]}" for a in MESH_AXES[1:] if getattr(cfg.mesh, a) == -1]
    m = cfg.mesh
    if m.dcn_fsdp > 1:
        raise ShrinkRefused(f"mesh.dcn_fsdp={m.dcn_fsdp} spreads FSDP shards over hosts: without a host every "
                            "parameter would need another layout; isolation only shrinks data parallelism")
    if m.dcn_data > 1:  # the hybrid mesh needs one DCN slice per process (jaxtrain.parallel.mesh.build_mesh)
        if new["data"] % left:
            raise ShrinkRefused(f"mesh.data={new['data']} on the devices left is not divisible by the {left} "
                                "processes left (mesh.dcn_data must equal the process count)")
        overrides.append(f"mesh.dcn_data={left}")

    axes = cfg.mesh.rules.get("batch") or []
    axes = axes if isinstance(axes, list) else [axes]
    ways, ways_left = math.prod(sizes[a] for a in axes), math.prod(new[a] for a in axes)
    batch, accum = cfg.data.global_batch_size, cfg.train.grad_accum
    if batch % left:
        raise ShrinkRefused(f"data.global_batch_size={batch} is not divisible by the {left} processes left "
                            "(each process loads an equal share of every batch)")
    inner = [a for a in axes if a != "stage"]
    inner_ways = math.prod(new[a] for a in inner)
    lowest = -(-accum * ways // ways_left)  # no more rows per device and microbatch than before
    for candidate in range(lowest, batch + 1):
        micro = batch // candidate
        if batch % candidate or micro % ways_left:
            continue
        if new["stage"] > 1 and (micro % cfg.pipeline.microbatches
                                 or (micro // cfg.pipeline.microbatches) % inner_ways):
            continue
        overrides.append(f"train.grad_accum={candidate}")
        return Shrink(processes=left, mesh=new, grad_accum=candidate, overrides=overrides)
    raise ShrinkRefused(f"no train.grad_accum >= {lowest} splits data.global_batch_size={batch} into microbatches "
                        f"divisible by the {ways_left}-way data parallelism left "
                        f"({' x '.join(f'{a}={new[a]}' for a in axes)})")


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
          isolate_after: K > 0: a slot that is the first to crash K attempts in a row is isolated and
            the job continues without it (0: never). Counts against max_restarts like any restart.
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
        self._streak: tuple[int | None, int] = (None, 0)  # (slot, how many attempts in a row it crashed first)
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
        self._events_at_start = len(_event_lines(self.output_dir))  # this attempt's events come after
        for i in range(self.num_processes):
            env = {**self.env,
                   "JAXTRAIN_COORDINATOR": f"127.0.0.1:{port}",
                   "JAXTRAIN_NUM_PROCESSES": str(self.num_processes),
                   "JAXTRAIN_PROCESS_ID": str(i),
                   SLOT_ENV: str(self.slots[i]),
                   RESTART_ATTEMPT_ENV: str(attempt),
                   "PYTHONUNBUFFERED": "1"}  # lines reach us (and the user) as they are printed
            # start_new_session: each child leads its own process group, so signals we send reach
            # its helpers too (killpg), and a terminal's Ctrl-C reaches only us (we forward it once).
            self._procs.append(subprocess.Popen(
                self.command + self.extra_args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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
        for p in self._procs:
            p.wait()
        self._join_output()

    def _join_output(self) -> None:
        for t in self._threads:
            t.join(timeout=5.0)  # the pipes close when the processes are gone

    def _wait(self) -> tuple[int, int] | None:
        """Wait for the job. Returns None when every process exited 0, else (process, returncode) of
        the failure that decides what happens next (the first to exit), after every other process
        has been stopped."""
        while True:
            if self._stop_signal is not None:
                return None  # run() handles the forwarded signal
            with self._exit_lock:
                order = list(self._exit_order)
            codes = [p.returncode for p in self._procs]  # set by the waiter threads
            failed = [(i, codes[i]) for i in order if codes[i] != EXIT_OK]
            if failed:
                # A user error anywhere wins: restarting would only fail the same way again.
                user = [f for f in failed if f[1] == EXIT_USAGE]
                first = (user or failed)[0]
                self._stop_all()
                return first
            if all(c == EXIT_OK for c in codes):
                self._join_output()
                return None
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
        codes = [p.returncode for p in self._procs]
        if codes and all(c == EXIT_OK for c in codes):
            return EXIT_OK
        if EXIT_RESTART in codes:
            return EXIT_RESTART  # e.g. preempted after an emergency save: the scheduler should requeue
        return 128 + signum

    # -- the loop

    def run(self) -> int:
        """Run the job until it succeeds, hits a user error, runs out of restarts, or is signalled.

        Returns:
          0 when every process exited 0; 2 on a user error; 75 or 128+signal after SIGTERM/SIGINT;
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
            failure = self._wait()
            if self._stop_signal is not None:
                return self._finish_after_signal()
            if failure is None:
                self.say("all processes exited 0")
                return EXIT_OK
            proc, code = failure
            reason = f"process {proc} {describe_exit(code)}"
            if code == EXIT_USAGE:
                self.say(f"{reason} (user error): stopped the others; not restarting")
                return EXIT_USAGE
            slot = suspect = self.slots[proc]
            if code == EXIT_RESTART:  # a decision, not a crash: blame only whom the run's events name
                blamed = blamed_process(self.output_dir, self._events_at_start)
                suspect = self.slots[blamed] if blamed is not None and blamed < len(self.slots) else None
            failures = self._count_failure(suspect)
            if attempt >= self.max_restarts:
                self.say(f"{reason}; no restarts left (--max-restarts {self.max_restarts}): giving up")
                return code if code > 0 else 128 - code
            if self.isolate_after and failures >= self.isolate_after and not self._isolate(suspect, failures):
                return code if code > 0 else 128 - code  # no smaller job exists: the original failure stands
            attempt += 1
            append_event(self.output_dir, "restart", last_known_step(self.output_dir), attempt=attempt,
                         max_restarts=self.max_restarts, process=proc, slot=slot,
                         exit_code=code if code >= 0 else None,
                         signal=signal.Signals(-code).name if code < 0 else None, reason=reason)
            self.say(f"{reason}: restarting the job (restart {attempt} of {self.max_restarts})")

    # -- isolation

    def _count_failure(self, slot: int | None) -> int:
        """Record that `slot` failed first in this attempt; returns how many attempts in a row it has.

        None: nobody is to blame. Exit 75 ("restart me": preempted, rollback budget) is a decision
        the process took, not evidence against its node, so it breaks the streak, unless the run's
        events name one process: the one a hang left furthest behind, or the one a preflight named.
        """
        if slot is None:
            self._streak = (None, 0)
            return 0
        previous, count = self._streak
        self._streak = (slot, count + 1 if previous == slot else 1)
        return self._streak[1]

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
        self._streak = (None, 0)
        return True


# ----------------------------------------------------------------------------- the CLI verb


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="jaxtrain launch",
        description="Start and supervise P local processes of one job; restart it when a process dies.",
        epilog="example: jaxtrain launch --num-processes 2 --cpu-devices 2 -- train --config configs/tiny.yaml")
    parser.add_argument("--num-processes", type=int, required=True, metavar="P", help="processes in the job")
    parser.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                        help="simulate N CPU devices in each process (passed on to `train`)")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="R",
                        help="restarts of the whole job after failures (default 3; user errors never restart)")
    parser.add_argument("--port", type=int, default=0,
                        help="coordinator port of the first attempt; attempt n uses PORT+n (default: a free port)")
    parser.add_argument("--grace-period-s", type=float, default=10.0, metavar="S",
                        help="seconds between SIGTERM (or a forwarded signal) and SIGKILL when stopping "
                             "processes (default 10)")
    parser.add_argument("--isolate-after", type=int, default=0, metavar="K",
                        help="a slot that is the first to crash K attempts in a row is isolated: the job "
                             "continues from its checkpoint on one process fewer, same global batch "
                             "(default 0: never)")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="N",
                        help="devices each process drives, for planning an isolation (default: --cpu-devices)")
    parser.add_argument("--print-shrink", action="store_true",
                        help="print the overrides that continue this job on one process fewer, and exit "
                             "(for SLURM/Kubernetes resizes; exit 1 with the reason when there are none)")
    parser.add_argument("--print-blame", type=float, default=None, metavar="T",
                        help="print the process that the run's events since UNIX time T blame for an exit 75 "
                             "(a hang's process furthest behind, a failed preflight's slow one), and exit "
                             "(for SLURM scripts; exit 1 when they blame no single process)")
    return parser


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """What the launched processes run, and what the launcher needs to know about it.

    Attributes:
      argv: the command of every process (`python -m jaxtrain.cli train ...`).
      config: the --config path.
      overrides: the `key=value` overrides as given.
      cpu_devices: --cpu-devices, from `launch` or from `train` (None: not given).
      cfg: the phase-1 parsed config.
    """

    argv: list[str]
    config: str
    overrides: list[str]
    cpu_devices: int | None
    cfg: Config


def child_command(train_argv: list[str], cpu_devices: int | None) -> TrainCommand:
    """The command every process runs, with its config parsed (phase 1).

    Args:
      train_argv: what follows `--`: `train --config PATH [k=v ...] [--cpu-devices N] [--progress]`.
      cpu_devices: the launcher's --cpu-devices (None: not given).
    Returns:
      The command and what it was made of.
    Raises:
      ConfigError: not a `train` command, --cpu-devices given twice, or a bad config (phase 1).
    """
    if not train_argv or train_argv[0] != "train":
        raise ConfigError("expected `jaxtrain launch [options] -- train --config PATH [key=value ...]`")
    args = parse(train_parser(), train_argv[1:])  # the same parser `jaxtrain train` uses: same rules
    if cpu_devices is not None and args.cpu_devices is not None:
        raise ConfigError("--cpu-devices given both to `launch` and to `train`: give it once")
    # Phase-1 config check here, once, so a typo fails fast instead of in P processes. Phase 2 (mesh
    # vs devices) needs JAX and happens in the children, which then exit 2.
    cfg = load_config(args.config, args.overrides)
    argv = [sys.executable, "-m", "jaxtrain.cli", *train_argv]
    if cpu_devices is not None:
        argv += ["--cpu-devices", str(cpu_devices)]
    return TrainCommand(argv=argv, config=args.config, overrides=list(args.overrides),
                        cpu_devices=cpu_devices if cpu_devices is not None else args.cpu_devices, cfg=cfg)


def isolation_planner(train: TrainCommand, devices_per_process: int) -> Callable[[int, list[str]], Shrink]:
    """`plan(processes_now, overrides_now)` for the Supervisor: the job one process smaller, planned
    from the config as the processes run it now (the user's overrides, then earlier isolations')."""
    def plan(processes: int, extra: list[str]) -> Shrink:
        try:
            cfg = load_config(train.config, [*train.overrides, *extra])
        except ConfigError as e:  # the shrunk config breaks a phase-1 rule: no valid shrink
            raise ShrinkRefused(str(e)) from None
        return plan_shrink(cfg, processes, devices_per_process)
    return plan


def main(argv: list[str]) -> int:
    """`jaxtrain launch [options] -- train --config PATH [key=value ...]`.

    Args:
      argv: the arguments after `launch`.
    Returns:
      The exit code (see Supervisor.run); with --print-shrink 0 (overrides printed) or 1 (none exist);
      with --print-blame 0 (a process index printed) or 1 (nobody blamed).
    Raises:
      ConfigError: bad options or config (the CLI prints it and exits 2).
    """
    if "--" in argv:
        split = argv.index("--")
        own, train_argv = argv[:split], argv[split + 1:]
    else:
        own, train_argv = argv, []
    try:
        args = parse(build_parser(), own)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if not train_argv:
        raise ConfigError("expected `jaxtrain launch [options] -- train --config PATH [key=value ...]`")
    train = child_command(train_argv, args.cpu_devices)
    if args.print_blame is not None:
        blamed = blamed_process(train.cfg.run.output_dir, since_time=args.print_blame)
        if blamed is None:
            print("jaxtrain launch: the run's events blame no single process", file=sys.stderr)
            return 1
        print(blamed)
        return EXIT_OK
    devices = args.devices_per_process if args.devices_per_process is not None else train.cpu_devices
    if devices is not None and devices < 1:
        raise ConfigError(f"--devices-per-process must be at least 1, got {devices}")
    if (args.isolate_after or args.print_shrink) and devices is None:
        raise ConfigError("--isolate-after and --print-shrink need the devices of each process to shrink the mesh: "
                          "give --cpu-devices N or --devices-per-process N (the launcher never starts JAX to count them)")
    planner = isolation_planner(train, devices) if devices is not None else None
    if args.print_shrink:
        try:
            print(" ".join(planner(args.num_processes, []).overrides))
        except ShrinkRefused as e:
            print(f"jaxtrain launch: no smaller job: {e}", file=sys.stderr)
            return 1
        return EXIT_OK
    supervisor = Supervisor(train.argv, args.num_processes, output_dir=train.cfg.run.output_dir,
                            max_restarts=args.max_restarts, port=args.port, grace_period_s=args.grace_period_s,
                            isolate_after=args.isolate_after, plan_isolation=planner)
    if args.isolate_after:
        try:  # say at once when isolation could never help, rather than after K failures
            planner(args.num_processes, [])
        except ShrinkRefused as e:
            supervisor.say(f"note: --isolate-after {args.isolate_after}: this job cannot lose a process: {e}")
    return supervisor.run()
