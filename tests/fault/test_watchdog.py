"""The hang watchdog cannot die or hang itself: whatever its reporting runs into (a full disk, a
stalled filesystem, a `hangs` path that is not a folder, a wedged coordinator), a hung process still
exits 75 within its deadline plus the reporting's bounds. Each case runs a real watchdog in a child
process (it ends with os._exit), with a hard timeout so that a broken watchdog fails the test
instead of hanging pytest.

Also each deadline on its own: an XLA compile in progress gets the compile deadline (longer than
start-up's, finite), `fault.hang_timeout_s=0` turns off the step deadline only, and only
`enabled=False` (a Trainer with write_files=False) turns the watchdog off (in-process, recording
watchdogs with small deadlines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxtrain.config import FaultConfig
from jaxtrain.exit_codes import EXIT_RESTART
from jaxtrain.fault.watchdog import Watchdog

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 1.0
HARD_TIMEOUT_S = 30.0  # a watchdog that never exits fails here

# The child: one watchdog, one finished step, then no progress. argv: output dir, case, deadline.
CHILD = r"""
import errno, os, socket, sys, time, types
from pathlib import Path
import jaxtrain.fault.watchdog as wd
from jaxtrain.config import FaultConfig

out, case, deadline = sys.argv[1], sys.argv[2], float(sys.argv[3])
fault, phase = {"hang_timeout_s": deadline}, "step"
hangs = Path(out) / "hangs"
stack_file = hangs / f"p0-{socket.gethostname()}-a0.txt"
count = 1
if case == "enospc":  # the disk is full: writing the stacks fails
    real_open = open
    def full_disk(path, *args, **kwargs):
        if Path(path).parent == hangs:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, *args, **kwargs)
    wd.open = full_disk  # shadows the builtin inside the watchdog module only
elif case == "fifo":  # a stalled filesystem: open() of the stacks file never returns
    hangs.mkdir(parents=True)
    os.mkfifo(stack_file)  # nobody ever opens it for reading
elif case == "hangs_is_a_file":
    Path(out).mkdir(parents=True, exist_ok=True)
    hangs.write_text("not a folder\n")
elif case == "wedged_coordinator":  # every key-value set blocks forever
    class Wedged:
        def key_value_set(self, *args, **kwargs):
            time.sleep(1e6)
        def key_value_dir_get(self, prefix):
            return []
    fake = types.ModuleType("jaxtrain.checkpoint.multihost")
    fake.client = Wedged
    sys.modules[fake.__name__] = fake  # no jax needed
    wd.LINGER_S = 1.0
    count = 2
elif case == "reporting_stuck":  # past every bound: only the backstop ends the process
    wd.Watchdog._report = lambda self, *args: time.sleep(1e6)
    wd.STACKS_TIMEOUT_S = wd.STDERR_TIMEOUT_S = wd.EVENT_TIMEOUT_S = wd.BACKSTOP_MARGIN_S = 0.5
elif case == "step_deadline_off":  # hang_timeout_s=0, stuck in start-up: start-up's deadline still holds
    fault, phase = {"hang_timeout_s": 0, "startup_timeout_s": deadline}, "startup"

w = wd.Watchdog(FaultConfig(**fault), output_dir=out, process_index=0,
                process_count=count, poll_s=0.05).start()
w.beat(1, phase)
print("beat", time.time(), flush=True)
time.sleep(1e6)
"""


def run_hung_child(tmp_path: Path, case: str) -> tuple[float, list[dict], str]:
    """Run the child until the watchdog ends it; (seconds from the last beat to the exit, the run's
    hang events, stderr). Fails unless it exits 75 before HARD_TIMEOUT_S."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, str(out), case, str(DEADLINE_S)], env=env,
                           capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{case}: the watchdog never ended the process ({HARD_TIMEOUT_S:g} s); stderr:\n{e.stderr}")
    ended = time.time()
    assert r.returncode == EXIT_RESTART, (case, r.returncode, r.stderr)
    beat = float(next(line for line in r.stdout.splitlines() if line.startswith("beat")).split()[1])
    events_file = out / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    return ended - beat, [e for e in events if e["kind"] == "hang"], r.stderr


def test_stack_dump_failing_with_enospc_still_exits_75(tmp_path):
    took, hangs, stderr = run_hung_child(tmp_path, "enospc")
    assert took < DEADLINE_S + 4, took
    assert len(hangs) == 1 and hangs[0]["stacks"] is None and "No space left" in hangs[0]["stacks_error"]
    assert "most recent call first" in stderr  # faulthandler's stacks went to stderr instead


def test_stack_dump_blocking_forever_still_exits_75(tmp_path):
    import jaxtrain.fault.watchdog as wd

    took, hangs, _ = run_hung_child(tmp_path, "fifo")
    assert took < DEADLINE_S + wd.STACKS_TIMEOUT_S + 3, took  # the stuck dump costs its bound only
    assert len(hangs) == 1 and "timed out" in hangs[0]["stacks_error"]


def test_hangs_path_being_a_regular_file_still_exits_75(tmp_path):
    took, hangs, _ = run_hung_child(tmp_path, "hangs_is_a_file")
    assert took < DEADLINE_S + 4, took
    assert len(hangs) == 1 and hangs[0]["stacks"] is None and hangs[0]["stacks_error"]


def test_wedged_coordinator_does_not_stop_the_deadline(tmp_path):
    """The progress publish blocks forever; the deadline fires anyway, and the declaration that
    blocks too costs its bound only."""
    import jaxtrain.fault.watchdog as wd

    took, hangs, _ = run_hung_child(tmp_path, "wedged_coordinator")
    assert took < DEADLINE_S + wd.KV_TIMEOUT_S + 1.0 + 3, took  # LINGER_S is 1 s in the child
    assert len(hangs) == 1 and hangs[0]["detected_by"] == "deadline" and hangs[0]["phase"] == "step"


def test_backstop_ends_reporting_stuck_past_its_bounds(tmp_path):
    """With the whole reporting stuck, the backstop armed before it exits 75 after its budget (2.5 s
    here): no earlier (nothing else exited), and not much later."""
    took, _, _ = run_hung_child(tmp_path, "reporting_stuck")
    assert DEADLINE_S + 2.5 - 0.2 < took < DEADLINE_S + 2.5 + 3, took


def test_step_deadline_off_still_ends_a_stuck_start_up(tmp_path):
    """fault.hang_timeout_s=0 used to turn the whole watchdog off: a start-up stuck forever hung the job."""
    took, hangs, _ = run_hung_child(tmp_path, "step_deadline_off")
    assert took < DEADLINE_S + 4, took
    assert len(hangs) == 1 and hangs[0]["phase"] == "startup" and hangs[0]["deadline_s"] == DEADLINE_S


# ----------------------------------------------------------------------------- each deadline on its own


class Recording(Watchdog):
    """A watchdog that records what it would have done instead of exiting the test process."""

    fired: list

    def _fire(self, phase: str, step: int, stalled: float, deadline: float | None, job_hang: bool = False) -> None:
        self.fired.append((phase, step, deadline))


def recording(tmp_path: Path, attempt: int = 0, enabled: bool = True, **fault: float) -> Recording:
    off = {} if enabled else {"enabled": False}  # (the default left out: the old signature had none)
    w = Recording(FaultConfig(**fault), output_dir=str(tmp_path), process_index=0, process_count=1,
                  attempt=attempt, poll_s=0.02, **off)
    w.fired = []
    return w


def test_compile_longer_than_startup_within_its_bound_does_not_fire(tmp_path):
    """A healthy compile longer than startup_timeout_s: killed at every attempt before (never cached)."""
    w = recording(tmp_path, hang_timeout_s=0.3, startup_timeout_s=0.3).start()
    w.beat(0, "startup")
    with w.compiling(last_compile_s=0.4):  # deadline max(0.3, 3 x 0.4) = 1.2 s
        time.sleep(0.7)  # past start-up's deadline, well within the compile's
    assert w.fired == []
    time.sleep(0.1)  # afterwards start-up's deadline counts anew (the first step)
    w.stop()
    assert w.fired == [] and w.deadline_s("compile") == pytest.approx(1.2)


def test_compile_stuck_past_its_bound_fires_as_compile(tmp_path):
    w = recording(tmp_path, hang_timeout_s=0.3, startup_timeout_s=0.3).start()
    w.beat(0, "startup")
    with w.compiling(last_compile_s=0.15):  # deadline max(0.3, 0.45) = 0.45 s
        time.sleep(1.2)
    w.stop()
    assert w.fired and w.fired[0][:2] == ("compile", 0) and w.fired[0][2] == pytest.approx(0.45)


def test_compile_deadline_without_a_record_doubles_per_attempt(tmp_path):
    """No compile recorded (every earlier attempt killed mid-compile records nothing): each restart
    gives the compile twice as long, bounded, so a healthy one eventually completes and a stuck one
    is still caught."""
    assert recording(tmp_path, startup_timeout_s=10).compile_deadline_s(None) == 10
    assert recording(tmp_path, attempt=2, startup_timeout_s=10).compile_deadline_s(None) == 40
    assert recording(tmp_path, attempt=50, startup_timeout_s=10).compile_deadline_s(None) == 160
    assert recording(tmp_path, startup_timeout_s=10).compile_deadline_s(1.0) == 10  # never below start-up's
    w = recording(tmp_path, attempt=2, hang_timeout_s=0.2, startup_timeout_s=0.2).start()
    w.beat(0, "startup")
    with w.compiling(None):  # 0.8 s
        time.sleep(0.5)
    w.stop()
    assert w.fired == []


def test_compile_while_idle_stays_without_a_deadline(tmp_path):
    """A compile between notebook calls (Trainer.step() outside fit()) had no deadline and gets none."""
    w = recording(tmp_path, hang_timeout_s=0.1, startup_timeout_s=0.1).start()
    w.beat(3, "idle")
    with w.compiling(0.01):
        time.sleep(0.4)
    w.stop()
    assert w.fired == []


def test_hang_timeout_zero_keeps_the_start_up_and_checkpoint_deadlines(tmp_path):
    stuck = recording(tmp_path, hang_timeout_s=0, startup_timeout_s=0.3).start()
    stuck.beat(0, "startup")
    time.sleep(0.8)
    stuck.stop()
    assert stuck.enabled and stuck.fired and stuck.fired[0] == ("startup", 0, 0.3)

    w = recording(tmp_path, hang_timeout_s=0, checkpoint_timeout_s=0.3).start()
    w.beat(1)  # steps: no deadline with hang_timeout_s=0
    time.sleep(0.5)
    assert w.fired == [] and w.deadline_s("step") is None
    with w.phase("checkpoint"):
        time.sleep(0.8)
    w.stop()
    assert w.fired and w.fired[0] == ("checkpoint", 1, 0.3)


def test_disabled_watchdog_never_fires(tmp_path):
    w = recording(tmp_path, enabled=False, hang_timeout_s=0.1, startup_timeout_s=0.1).start()
    w.beat(0, "startup")
    time.sleep(0.3)
    w.stop()
    assert w.fired == [] and w._thread is None


def test_trainer_without_files_runs_no_watchdog(tmp_path, monkeypatch):
    """write_files=False means no watchdog at all (it used to pass hang_timeout_s=0 for that, which
    now turns off the step deadline only): a construction longer than the deadlines fires nothing."""
    from jaxtrain.config import load_config
    from jaxtrain.trainer import Trainer

    fired: list = []
    monkeypatch.setattr(Watchdog, "_fire", lambda self, phase, *args, **kwargs: fired.append(phase))
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [
        f"run.output_dir={tmp_path}", "checkpoint.compilation_cache_dir=null", "model.num_layers=1",
        "data.global_batch_size=4", "data.seq_len=16", "fault.hang_timeout_s=0.05",
        "fault.startup_timeout_s=0.05", "fault.checkpoint_timeout_s=0.05"])
    import jax

    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    try:
        trainer.step()  # a compile and a step, far past 0.05 s
        time.sleep(0.2)
        assert fired == [] and not trainer.watchdog.enabled and trainer.watchdog._thread is None
    finally:
        trainer.close()
