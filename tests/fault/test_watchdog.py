"""The hang watchdog cannot die or hang itself: whatever its reporting runs into (a full disk, a
stalled filesystem, a `hangs` path that is not a folder, a wedged coordinator), a hung process still
exits 75 within its deadline plus the reporting's bounds. Each case runs a real watchdog in a child
process (it ends with os._exit), with a hard timeout so that a broken watchdog fails the test
instead of hanging pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxtrain.exit_codes import EXIT_RESTART

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

w = wd.Watchdog(FaultConfig(hang_timeout_s=deadline), output_dir=out, process_index=0,
                process_count=count, poll_s=0.05).start()
w.beat(1, "step")
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
