"""The ways a run ends besides finishing: a Python error in the loop, a stop asked for during
start-up, the deadline of joining the job.

The multi-process tests start real local processes (`python -m jaxtrain train` with the
JAXTRAIN_* coordinates, gloo over jax.distributed), so that each one's stderr and exit time can be
read on its own. Run as a script (`python tests/fault/test_error_paths.py notice PID PORT ARGS...`)
this file is one process of `test_a_sigterm_before_the_trainer_exists_is_read_from_jax_s_notice`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import TINY, free_port, read_jsonl

SMALL = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=4", "data.seq_len=16",
         "train.log_every=1", "checkpoint.compilation_cache_dir=null"]


class Process:
    """One process of a local job: its stderr lines as they arrive, each with its arrival time,
    and the time it exited (both taken by threads, so neither waits for the other)."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.popen = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        self.exited_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stderr:
            self.lines.append((time.monotonic(), line))

    def _wait(self) -> None:
        self.popen.wait()
        self.exited_at = time.monotonic()

    def wait_for_line(self, text: str, timeout_s: float) -> float:
        """When a stderr line containing `text` arrived (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if text in line:
                    return t
            if self.popen.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no stderr line with {text!r}:\n{self.stderr[-3000:]}")

    def wait(self, timeout_s: float) -> int | None:
        """The exit code, or None if still running after `timeout_s`."""
        try:
            code = self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5)
        while self.exited_at is None:
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)


def child_env(pid: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXTRAIN_RESTART_ATTEMPT", "JAXTRAIN_SLOT")}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
                "JAXTRAIN_COORDINATOR": f"127.0.0.1:{port}", "JAXTRAIN_NUM_PROCESSES": "2",
                "JAXTRAIN_PROCESS_ID": str(pid)})
    return env


def start_job(out: Path, *overrides: str) -> list[Process]:
    port = free_port()
    args = ["train", "--cpu-devices", "1", "--config", TINY, *SMALL, f"run.output_dir={out}", *overrides]
    return [Process([sys.executable, "-m", "jaxtrain", *args], child_env(pid, port)) for pid in (0, 1)]


# ----------------------------------------------------------------------------- a Python error in the loop


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_python_error_in_the_loop_exits_at_once_with_its_own_traceback(tmp_path):
    """Process 1 raises after step 3 while process 0 goes on into the next step's collective.
    Process 1 must exit 1 within 2 s with the RuntimeError's traceback on stderr. Formerly close()
    waited in a checkpoint barrier for process 0 (checkpoint.barrier_timeout_s, here 30 s, without
    a watchdog), then raised a BarrierTimeoutError `from None` naming the healthy process 0."""
    procs = start_job(tmp_path / "run", "train.steps=100000", "fault.preflight=false",
                      "chaos.raise_at_step=3", "chaos.raise_process=1", "checkpoint.barrier_timeout_s=30",
                      "fault.hang_timeout_s=20")
    try:
        raised_at = procs[1].wait_for_line("chaos.raise_at_step: process 1 raises", timeout_s=240)
        code = procs[1].wait(timeout_s=60)
        assert code is not None, "process 1 still runs a minute after its error"
        exit_s = procs[1].exited_at - raised_at
        print(f"process 1 exited {exit_s:.2f} s after raising")
        err = procs[1].stderr
        assert code == 1, err[-3000:]
        assert exit_s < 2.0, err[-3000:]
        assert "Traceback (most recent call last)" in err
        assert "RuntimeError: chaos.raise_at_step: injected error on process 1 at step 3" in err
        assert "BarrierTimeoutError" not in err
        # Process 0 is not asked to wait for it either: its collective fails or its watchdog fires.
        code0 = procs[0].wait(timeout_s=60)
        print(f"process 0 exited {code0} {procs[0].exited_at - raised_at if code0 is not None else '-'} s later")
    finally:
        for p in procs:
            p.kill()


# ----------------------------------------------------------------------------- a stop asked for during start-up


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_during_start_up_stops_the_job_with_75_before_the_first_step(tmp_path):
    """Process 1 is still starting (chaos.start_delay_s) when it gets SIGTERM. Both processes agree
    to stop before preflight and the first step: a `signal` event naming process 1, `preempted`,
    exit 75, within seconds of the delay's end. Formerly JAX's own preemption handler took the
    signal (jaxtrain's was installed only when the loop started) and the job trained on."""
    delay = 6
    out = tmp_path / "run"
    procs = start_job(out, "train.steps=100000", f"chaos.start_delay_s={delay}", "chaos.slow_process=1")
    try:
        late = procs[1].wait_for_line("chaos.start_delay_s: process 1 starts", timeout_s=240)
        procs[1].popen.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout_s=delay + 60) for p in procs]
        assert codes == [75, 75], [p.stderr[-2000:] for p in procs]
        took = max(p.exited_at for p in procs) - late
        print(f"both exited {took:.2f} s after the signal (start-up delay {delay} s)")
        assert took < delay + 20
        events = read_jsonl(out / "events.jsonl", missing_ok=True)
        kinds = [e["kind"] for e in events]
        assert kinds[-2:] == ["signal", "preempted"], kinds
        assert events[-2]["signal"] == "SIGTERM" and events[-2]["processes"] == [1]
        assert events[-1]["exit_code"] == 75 and "start" not in kinds and "preflight" not in kinds
        assert "exiting 75 before the first step" in procs[1].stderr
    finally:
        for p in procs:
            p.kill()


def _notice_worker(pid: int, port: int, args: list[str]) -> None:
    """One process of the job below: process 0 gets SIGTERM right after joining the job, before the
    Trainer exists (JAX's own handler has it then), then runs `jaxtrain train` as usual."""
    from jaxtrain.commands import cli
    from jaxtrain.runtime import distributed

    real = distributed.initialize

    def initialize(**kwargs):
        real(**kwargs)
        if pid == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # JAX's notifier thread publishes the notice
    distributed.initialize = initialize
    sys.exit(cli.main(args))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_sigterm_before_the_trainer_exists_is_read_from_jax_s_notice(tmp_path):
    out = tmp_path / "run"
    port = free_port()
    args = ["train", "--cpu-devices", "1", "--config", TINY, *SMALL, f"run.output_dir={out}", "train.steps=100000"]
    procs = [Process([sys.executable, __file__, "notice", str(pid), str(port), *args], child_env(pid, port))
             for pid in (0, 1)]
    try:
        codes = [p.wait(timeout_s=240) for p in procs]
        assert codes == [75, 75], [p.stderr[-2000:] for p in procs]
        events = read_jsonl(out / "events.jsonl", missing_ok=True)
        assert [e["kind"] for e in events][-2:] == ["signal", "preempted"], events
        assert events[-2]["signal"] == "JAX preemption notice" and 0 in events[-2]["processes"]
    finally:
        for p in procs:
            p.kill()


def test_a_signal_before_fit_stops_a_single_process_before_the_first_step(tmp_path):
    """One process: the handler is the Trainer's from its construction on (formerly only inside the
    loop), and fit() reads the request before compiling or stepping."""
    import jax

    from jaxtrain.config import load_config
    from jaxtrain.trainer import Trainer
    previous = signal.getsignal(signal.SIGTERM)
    cfg = load_config(TINY, [*SMALL, f"run.output_dir={tmp_path / 'run'}", "train.steps=5"])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    try:
        assert signal.getsignal(signal.SIGTERM) == trainer.signals._handle
        os.kill(os.getpid(), signal.SIGTERM)  # "during start-up": after the handler, before the loop
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary == {"step": 0, "exit_code": 75} and trainer.compiled_step is None
    assert signal.getsignal(signal.SIGTERM) == previous  # given back
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "run" / "events.jsonl", missing_ok=True)]
    assert kinds == ["signal", "preempted"], kinds


def test_a_failed_construction_gives_the_signal_handlers_back(tmp_path):
    from jaxtrain.config import ConfigError, load_config
    from jaxtrain.trainer import Trainer
    previous = signal.getsignal(signal.SIGTERM)
    cfg = load_config(TINY, [*SMALL, f"run.output_dir={tmp_path / 'run'}", "mesh.data=3"])
    with pytest.raises(ConfigError):
        Trainer(cfg)
    assert signal.getsignal(signal.SIGTERM) == previous


def test_startup_agreement_of_one_process_needs_no_coordinator():
    from jaxtrain.fault.preemption import agree_on_startup_stop
    assert agree_on_startup_stop(None, 0, 1, name="1", timeout_s=1) == {}
    assert agree_on_startup_stop("SIGTERM", 0, 1, name="2", timeout_s=1) == {0: "SIGTERM"}


# ----------------------------------------------------------------------------- joining the job


def test_joining_the_job_waits_fault_startup_timeout_s(monkeypatch):
    """The `jaxtrain train` path hands fault.startup_timeout_s to jax.distributed.initialize
    (formerly a fixed 300 s outside the start-up deadline)."""
    import jax

    from jaxtrain.commands import cli
    from jaxtrain.runtime import distributed

    class Joined(Exception):
        pass

    seen = {}

    def initialize(**kwargs):
        seen.update(kwargs)
        raise Joined

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(distributed, "has_accelerator_hint", lambda: True)  # no gloo switch in this process
    monkeypatch.setenv("JAX_PLATFORMS", "")
    monkeypatch.setenv("JAXTRAIN_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("JAXTRAIN_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXTRAIN_PROCESS_ID", "1")
    with pytest.raises(Joined):
        cli.main(["train", "--config", TINY, "fault.startup_timeout_s=2400.5"])
    assert seen["initialization_timeout"] == 2401 and seen["process_id"] == 1
    seen.clear()
    monkeypatch.setenv("JAXTRAIN_COORDINATOR", "")  # SLURM's autodetection path gets it too
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(Joined):
        distributed.initialize(timeout_s=90)
    assert seen["initialization_timeout"] == 90


if __name__ == "__main__":
    if sys.argv[1] == "notice":
        _notice_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
