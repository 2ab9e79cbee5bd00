"""`jaxtrain launch`: start P local processes of one JAX job and supervise them.

    jaxtrain launch --num-processes 2 --cpu-devices 2 -- train --config configs/tiny.yaml train.steps=20

Each process runs `python -m jaxtrain.cli train ...` with JAXTRAIN_COORDINATOR (127.0.0.1:PORT),
JAXTRAIN_NUM_PROCESSES and JAXTRAIN_PROCESS_ID set (read by jaxtrain.distributed), plus
JAXTRAIN_RESTART_ATTEMPT (0 on the first attempt). Output lines are prefixed with `[p{i}]`.

Supervision (exit codes as in DESIGN §4):
- all processes exit 0 -> exit 0;
- one exits 2 (bad config/usage/input) -> stop the others, exit 2; a user error is never restarted;
- one exits 75 ("restart me"), exits non-zero otherwise, or dies from a signal -> stop the others
  (SIGTERM, SIGKILL after --grace-period-s) and restart the whole job with the same command on a
  new port, at most --max-restarts times. The trainer resumes from the latest checkpoint in
  run.output_dir by itself; the launcher appends a `restart` event to <run.output_dir>/events.jsonl.
- SIGTERM/SIGINT sent to the launcher are forwarded to every process; the job is then not restarted.

The launcher never imports JAX: it only parses the config (to find run.output_dir) and watches
processes, so it stays light and cannot grab devices its children need.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Sequence

from jaxtrain.arguments import Parser, parse, train_parser
from jaxtrain.config import ConfigError, load_config
from jaxtrain.exit_codes import EXIT_OK, EXIT_RESTART, EXIT_USAGE
from jaxtrain.paths import is_remote
RESTART_ATTEMPT_ENV = "JAXTRAIN_RESTART_ATTEMPT"  # 0 on the first attempt, n on the n-th restart
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


def append_event(output_dir: str | Path | None, kind: str, step: int, **details: object) -> None:
    """Append one event line (same shape as the trainer's: time, step, kind, details) to events.jsonl.

    Only called while no child runs, so the launcher is never a second concurrent writer.

    Args:
      output_dir: the run directory (None: nothing is written).
      kind: the event kind, e.g. "restart".
      step: the step the event refers to (-1 if unknown).
      details: more JSON-serializable fields.
    """
    if output_dir is None or is_remote(output_dir):
        return  # gs://... run directories: the trainer's own events are there; we only log to stderr
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    record = {"time": time.time(), "step": int(step), "kind": kind, **details}
    with open(Path(output_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


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
    """

    def __init__(self, command: Sequence[str], num_processes: int, *, output_dir: str | Path | None = None,
                 max_restarts: int = 3, port: int = 0, grace_period_s: float = 10.0,
                 env: dict[str, str] | None = None, out: IO[str] | None = None, err: IO[str] | None = None):
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
        """
        if num_processes < 1:
            raise ConfigError(f"--num-processes must be at least 1, got {num_processes}")
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, got {max_restarts}")
        self.command = list(command)
        self.num_processes = num_processes
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
        self._procs, self._threads = [], []
        for i in range(self.num_processes):
            env = {**self.env,
                   "JAXTRAIN_COORDINATOR": f"127.0.0.1:{port}",
                   "JAXTRAIN_NUM_PROCESSES": str(self.num_processes),
                   "JAXTRAIN_PROCESS_ID": str(i),
                   RESTART_ATTEMPT_ENV: str(attempt),
                   "PYTHONUNBUFFERED": "1"}  # lines reach us (and the user) as they are printed
            # start_new_session: each child leads its own process group, so signals we send reach
            # its helpers too (killpg), and a terminal's Ctrl-C reaches only us (we forward it once).
            self._procs.append(subprocess.Popen(
                self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_die_with_parent))
        # Reader threads start only after every fork: forking (with preexec_fn) while other threads
        # run is what Python warns against.
        for i, p in enumerate(self._procs):
            for stream, sink in ((p.stdout, self.out), (p.stderr, self.err)):
                t = threading.Thread(target=self._pump, args=(stream, f"[p{i}]", sink), daemon=True)
                t.start()
                self._threads.append(t)

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
        the failure that decides what happens next, after every other process has been stopped."""
        while True:
            if self._stop_signal is not None:
                return None  # run() handles the forwarded signal
            codes = [p.poll() for p in self._procs]
            failed = [(i, c) for i, c in enumerate(codes) if c is not None and c != EXIT_OK]
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
            if attempt >= self.max_restarts:
                self.say(f"{reason}; no restarts left (--max-restarts {self.max_restarts}): giving up")
                return code if code > 0 else 128 - code
            attempt += 1
            append_event(self.output_dir, "restart", last_known_step(self.output_dir), attempt=attempt,
                         max_restarts=self.max_restarts, process=proc, exit_code=code if code >= 0 else None,
                         signal=signal.Signals(-code).name if code < 0 else None, reason=reason)
            self.say(f"{reason}: restarting the job (restart {attempt} of {self.max_restarts})")


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
    return parser


def child_command(train_argv: list[str], cpu_devices: int | None) -> tuple[list[str], str]:
    """The command every process runs, and the run directory it writes to.

    Args:
      train_argv: what follows `--`: `train --config PATH [k=v ...] [--cpu-devices N] [--progress]`.
      cpu_devices: the launcher's --cpu-devices (None: not given).
    Returns:
      (argv for `python -m jaxtrain.cli`, run.output_dir as configured).
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
    return argv, cfg.run.output_dir


def main(argv: list[str]) -> int:
    """`jaxtrain launch [options] -- train --config PATH [key=value ...]`.

    Args:
      argv: the arguments after `launch`.
    Returns:
      The exit code (see Supervisor.run).
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
    command, output_dir = child_command(train_argv, args.cpu_devices)
    supervisor = Supervisor(command, args.num_processes, output_dir=output_dir, max_restarts=args.max_restarts,
                            port=args.port, grace_period_s=args.grace_period_s)
    return supervisor.run()
