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
from helpers import REPO, TINY

from jaxtrain.config import FaultConfig
from jaxtrain.runtime.exit_codes import EXIT_RESTART
from jaxtrain.fault.watchdog import Watchdog

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
stack_file = hangs / "a0" / f"p0-{socket.gethostname()}.txt"
count = 1
if case == "enospc":  # the disk is full: writing the stacks fails
    real_open = open
    def full_disk(path, *args, **kwargs):
        if hangs in Path(path).parents:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, *args, **kwargs)
    wd.open = full_disk  # shadows the builtin inside the watchdog module only
elif case == "fifo":  # a stalled filesystem: open() of the stacks file never returns
    stack_file.parent.mkdir(parents=True)
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
        def key_value_increment(self, *args, **kwargs):
            time.sleep(1e6)
    fake = types.ModuleType("jaxtrain.runtime.multihost")
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
    cfg = load_config(TINY, [
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


# ----------------------------------------------------------------------------- the hang verdict


def beat(step: int, started: int | None = None, ended: int | None = None, age_s: float = 0.5,
         phase: str = "step") -> dict:
    """A heartbeat as `Watchdog.heartbeat` publishes it, `age_s` old at NOW (marks: where given)."""
    out: dict = {"step": step, "phase": phase, "beat": NOW - age_s - 1.0, "time": NOW - age_s}
    if started is not None:
        out.update(started=[started, NOW - 2.0], ended=[ended, NOW - 2.5])
    return out


NOW = 1_000_000.0
STALE_S = 3.0


@pytest.mark.parametrize("heartbeats, behind, reason", [
    # a host stopped after step 6 (the after-step drill): its host and device are a step behind
    ({0: beat(6, 7, 6), 1: beat(5, 6, 6)}, [1], "device step not started"),
    # a process blocked inside step 5 (chaos.hang_in_step): the hosts are level, only the devices differ
    ({0: beat(3, 5, 4), 1: beat(3, 4, 4), 2: beat(3, 5, 4)}, [1], "device step not started"),
    # a device that hung before the step's end: the others finished it and wait in the next one
    ({0: beat(4, 6, 5), 1: beat(4, 5, 4), 2: beat(4, 6, 5), 3: beat(4, 6, 5)}, [1], "device step not started"),
    ({0: beat(4, 5, 5), 1: beat(4, 5, 4)}, [1], "device step not finished"),
    # a hang inside a collective every device entered: every process at the same place, nobody blamed
    ({0: beat(3, 5, 4), 1: beat(3, 5, 4)}, [], "every process at the same place"),
    # no step marks (fault.step_markers=never, or auto on the CPU): the host steps decide, as before
    ({0: beat(6), 1: beat(5), 2: beat(6)}, [1], "host behind"),
    ({0: beat(6), 1: beat(6)}, [], "every process at the same place"),
    # a frozen process (SIGSTOP): its heartbeat is stale, whatever its step says
    ({0: beat(3, 5, 4), 1: beat(9, 9, 9, age_s=STALE_S + 1), 2: beat(3, 5, 4)}, [1], "heartbeat stale"),
    ({0: beat(3, 5, 4), 2: beat(3, 5, 4)}, [1], "heartbeat stale"),  # none at all: silent
])
def test_hang_verdict_blames_exactly_the_process_that_stopped(heartbeats, behind, reason):
    from jaxtrain.fault.watchdog import hang_verdict

    v = hang_verdict(heartbeats, max(heartbeats) + 1, NOW, STALE_S)
    assert v.behind == behind and v.reason.startswith(reason), v


def test_hang_summary_stays_small_at_a_thousand_processes():
    """The event line used to carry every process's progress (~14 KB at P = 1,000); now counts,
    the blamed processes (listed up to LISTED_MAX, detailed up to DETAILED_MAX) and where the rest are."""
    from jaxtrain.fault.watchdog import DETAILED_MAX, LISTED_MAX, hang_verdict

    one = hang_verdict({p: beat(3, 4 if p == 417 else 5, 4) for p in range(1000)}, 1000, NOW, STALE_S).summary()
    assert one["behind"] == [417] and one["blamed_count"] == 1 and one["rest"]["count"] == 999
    assert len(json.dumps(one)) < 1000, one
    half = {p: beat(3, 5, 4, age_s=0.5 if p % 2 else 60.0) for p in range(1000)}  # 500 frozen
    many = hang_verdict(half, 1000, NOW, STALE_S).summary()
    assert many["blamed_count"] == 500 and len(many["behind"]) == LISTED_MAX and many["behind_truncated"]
    assert len(many["blamed"]) == DETAILED_MAX and many["stale"] == 500 and len(json.dumps(many)) < 3000


class FakeKV:
    """The three coordination calls the verdict makes, over a dict of heartbeats."""

    def __init__(self, heartbeats: dict[int, dict], fail: bool = False):
        self.heartbeats, self.fail, self.calls = heartbeats, fail, []

    def key_value_try_get(self, key: str) -> str:
        self.calls.append("try_get")
        if self.fail:
            raise RuntimeError("DEADLINE_EXCEEDED: no answer")
        p = int(key.rsplit("/", 1)[1])
        if p not in self.heartbeats:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return json.dumps(self.heartbeats[p])

    def key_value_dir_get(self, prefix: str) -> list:
        self.calls.append("dir_get")
        return [(f"{prefix}{p}", json.dumps(h)) for p, h in sorted(self.heartbeats.items())]

    def key_value_increment(self, key: str, increment: int) -> int:
        return len(self.heartbeats)  # every process declared: no lingering


def job_view(monkeypatch, tmp_path, process: int, kv: FakeKV, count: int = 3):
    from jaxtrain.runtime import multihost

    monkeypatch.setattr(multihost, "client", lambda: kv)
    w = Watchdog(FaultConfig(hang_timeout_s=4), output_dir=str(tmp_path), process_index=process, process_count=count)
    return w._job_view()


def test_the_lowest_live_process_alone_writes_the_hang_event(monkeypatch, tmp_path):
    import time as clock

    now = clock.time()
    live = {p: {"step": 3, "phase": "step", "beat": now - 2, "time": now - 0.5,
                "started": [5 if p else 4, now - 2], "ended": [4, now - 2]} for p in range(3)}
    kv = FakeKV(live)
    writes, verdict = job_view(monkeypatch, tmp_path, 0, kv)
    assert writes and verdict.behind == [0] and kv.calls == ["dir_get"]  # process 0 writes, blaming itself
    for p in (1, 2):  # process 0 is live: the others read its heartbeat only and write nothing
        kv = FakeKV(live)
        assert job_view(monkeypatch, tmp_path, p, kv) == (False, None) and kv.calls == ["try_get"]
    frozen = {**live, 0: {**live[0], "time": now - 60}}  # process 0 stopped: process 1 writes, blaming it
    kv = FakeKV(frozen)
    writes, verdict = job_view(monkeypatch, tmp_path, 1, kv)
    assert writes and verdict.behind == [0] and kv.calls == ["try_get", "dir_get"]
    assert job_view(monkeypatch, tmp_path, 2, FakeKV(frozen))[0] is False  # process 1 is live: not 2
    silent = {p: h for p, h in live.items() if p != 0}
    assert job_view(monkeypatch, tmp_path, 1, FakeKV(silent))[1].behind == [0]
    # the coordination service (inside process 0) does not answer: process 1 writes, blaming process 0
    writes, verdict = job_view(monkeypatch, tmp_path, 1, FakeKV(live, fail=True))
    assert writes and verdict.behind == [0] and "did not answer" in verdict.reason
    assert job_view(monkeypatch, tmp_path, 2, FakeKV(live, fail=True))[0] is False


def test_the_hang_event_as_written_is_read_by_blame_and_goodput(monkeypatch, tmp_path, capsys):
    """The one `hang` event of the job, written by the real reporting code of process 0 (process 1
    blocked inside step 5), read by `jaxtrain recovery blame` (policy.blamed_process, print_blame)
    and `jaxtrain goodput`, in place of the two lines per hang the old format had."""
    import time as clock

    from jaxtrain.runtime import multihost
    from jaxtrain.launch.policy import blamed_process
    from jaxtrain.commands.recovery import print_blame
    from jaxtrain.observe.goodput import goodput
    from goodput_run import EVENTS, METRICS, write_run

    now = clock.time()
    kv = FakeKV({p: {"step": 3, "phase": "step", "beat": now - 9, "time": now - 0.5,
                     "started": [4 if p == 1 else 5, now - 9], "ended": [4, now - 9]} for p in range(2)})
    monkeypatch.setattr(multihost, "client", lambda: kv)
    run = tmp_path / "written"
    Watchdog(FaultConfig(hang_timeout_s=4), output_dir=str(run), process_index=0,
             process_count=2)._report("step", 4, 10.0, 4.0, False)
    [hang] = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert hang["kind"] == "hang" and hang["behind"] == [1] and hang["stalled_s"] == 10.0
    assert Path(hang["stacks"]).parent == run / "hangs" / "a0" and hang["stacks_dir"] == str(run / "hangs" / "a0")

    hang["time"] = 124.0  # in place of the old format's two lines (one per process) in the goodput run
    events = [e for e in EVENTS if e["kind"] != "hang"]
    events.insert(next(i for i, e in enumerate(events) if e["kind"] == "restart"), hang)
    report = goodput(write_run(tmp_path / "run", events, METRICS))
    assert report["parts"]["hang_s"] == pytest.approx(10.0)
    assert [(h["process"], h["stalled_s"]) for h in report["hangs"]] == [(0, 10.0)]
    assert blamed_process(events) == 1 and blamed_process(events, since=125.0) is None
    assert print_blame(str(tmp_path / "run"), 0.0, "jaxtrain recovery") == 0 and capsys.readouterr().out == "1\n"
    nobody = {**hang, "behind": [], "blamed_count": 0}  # every process at the same place
    assert blamed_process([nobody, hang]) is None  # the first hang event that has a verdict decides


def test_step_marks_run_on_every_device_and_a_held_start_mark_holds_the_step():
    """The marks wrap a step on 8 devices: each device calls each mark once per step (the process is
    as far as its slowest device), a drill that blocks in the start mark holds the step (its end
    mark and results wait), and the step's results are unchanged."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxtrain.fault.step_marks import StepMarks, with_step_marks

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    calls: list[int] = []
    marks = StepMarks(8, before_start=calls.append)
    assert marks.snapshot() == {"started": [0, None], "ended": [0, None]}

    def step_fn(state, batch):
        return {"step": state["step"] + 1}, {"loss": jnp.sum(batch["tokens"]).astype(jnp.float32)}

    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(("data", "fsdp")))
    step = jax.jit(with_step_marks(step_fn, mesh, marks), in_shardings=({"step": rep}, {"tokens": rows}),
                   out_shardings=({"step": rep}, rep))
    state = {"step": jnp.int32(0)}
    tokens = jax.device_put(jnp.arange(32, dtype=jnp.int32).reshape(8, 4), rows)
    before = time.time()
    for _ in range(2):
        state, metrics = step(state, {"tokens": tokens})
    assert int(state["step"]) == 2 and float(metrics["loss"]) == float(np.arange(32).sum())
    assert sorted(calls) == [1] * 8 + [2] * 8  # the drill hook: once per device and step
    snap = marks.snapshot()
    assert snap["started"][0] == 2 and snap["ended"][0] == 2 and snap["started"][1] >= before
    marks._started[3] = (1, time.time())  # one device still in step 1: the process is
    assert marks.snapshot()["started"][0] == 1

    import threading

    gate = threading.Event()
    blocked = StepMarks(8, before_start=lambda number: number == 2 and gate.wait(60))  # the drill, released
    step = jax.jit(with_step_marks(step_fn, mesh, blocked))
    state, _ = step({"step": jnp.int32(0)}, {"tokens": tokens})
    done: list = []
    t = threading.Thread(target=lambda: done.append(jax.block_until_ready(step(state, {"tokens": tokens}))))
    t.start()
    time.sleep(1.0)
    # held in step 2's start mark: the step's loss (so its end mark) waits for it
    assert not done and blocked.snapshot()["started"][0] == 1 and blocked.snapshot()["ended"][0] == 1
    gate.set()
    t.join(60)
    assert done and blocked.snapshot()["started"][0] == 2 and blocked.snapshot()["ended"][0] == 2


def test_the_heartbeat_says_when_the_last_beat_was_and_where_the_devices_are(tmp_path):
    from jaxtrain.fault.step_marks import StepMarks

    w = Watchdog(FaultConfig(hang_timeout_s=4), output_dir=str(tmp_path), process_index=1, process_count=2)
    w.beat(7)
    time.sleep(0.05)
    with w.phase("checkpoint"):
        h = w.heartbeat()
    assert h["step"] == 7 and h["phase"] == "checkpoint" and h["time"] - h["beat"] >= 0.04
    assert "started" not in h and w.stale_after_s == 3 * w._publish_every_s < 4  # under the step deadline
    w.marks = StepMarks(1)
    w.marks.start(7, 0)
    assert w.heartbeat()["started"][0] == 8 and w.heartbeat()["ended"] == [0, None]
