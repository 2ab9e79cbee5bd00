"""`jaxtrain launch`: local multi-process jobs, supervision, restarts.

Two layers:
- the Supervisor with tiny stand-in children (plain Python, no JAX: milliseconds each) for every
  supervision rule: exit 0, user error, crash -> restart, restarts spent, SIGTERM -> SIGKILL, signal
  forwarding, ports and environment, who is blamed, node isolation (streaks, refusal); the shrink
  planning (`plan_shrink`) on configs alone;
- end to end (`python -m jaxtrain launch ...`): 2 processes x 2 simulated CPU devices train the
  tiny config as one job; a user error exits 2 without a restart; a killed process restarts the job,
  which ends bitwise equal to an uninterrupted run; a slot that crashes on every attempt is isolated
  and the run finishes on one process with the same global batch, its losses matching the reference.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import TINY, read_jsonl
from trees import assert_trees_close, assert_trees_equal, final_params

from jaxtrain.config import ConfigError, load_config
from jaxtrain.runtime.env import RESTART_ATTEMPT as RESTART_ATTEMPT_ENV, SLOT as SLOT_ENV
from jaxtrain.launch.elastic import Shrink, ShrinkRefused, plan_shrink
from jaxtrain.launch.runfiles import last_known_step
from jaxtrain.commands.launch import main
from jaxtrain.launch.supervisor import Supervisor

TINY_OVERRIDES = ["train.steps=4", "train.log_every=1", "data.global_batch_size=8"]


# ----------------------------------------------------------------------------- stand-in children

def fake(body: str) -> list[str]:
    """A child command: Python that sees PID (process id), ATTEMPT and the JAXTRAIN_* environment."""
    prelude = ("import os, signal, sys, time\n"
               "PID = int(os.environ['JAXTRAIN_PROCESS_ID'])\n"
               "N = int(os.environ['JAXTRAIN_NUM_PROCESSES'])\n"
               f"SLOT = int(os.environ['{SLOT_ENV}'])\n"
               f"ATTEMPT = int(os.environ['{RESTART_ATTEMPT_ENV}'])\n")
    return [sys.executable, "-c", prelude + textwrap.dedent(body)]


def supervise(command: list[str], num_processes: int = 2, **kwargs) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    kwargs.setdefault("grace_period_s", 2.0)
    code = Supervisor(command, num_processes, out=out, err=err, **kwargs).run()
    return code, out.getvalue(), err.getvalue()


def test_all_exit_zero_with_prefixed_output_and_job_environment():
    code, out, err = supervise(fake("""
        print(os.environ['JAXTRAIN_COORDINATOR'], os.environ['JAXTRAIN_NUM_PROCESSES'], PID, ATTEMPT)
        print('to stderr', file=sys.stderr)
    """), num_processes=3)
    assert code == 0, err
    lines = sorted(out.splitlines())
    assert [line.split()[0] for line in lines] == ["[p0]", "[p1]", "[p2]"]
    coordinators = {line.split()[1] for line in lines}
    assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")  # one job, one coordinator
    assert [line.split()[2:] for line in lines] == [["3", "0", "0"], ["3", "1", "0"], ["3", "2", "0"]]
    assert sorted(line for line in err.splitlines() if "to stderr" in line) == [
        "[p0] to stderr", "[p1] to stderr", "[p2] to stderr"]


def test_user_error_stops_the_others_and_is_never_restarted(tmp_path):
    code, _, err = supervise(fake("""
        if PID == 1:
            sys.exit(2)
        time.sleep(60)   # process 0 would run on: the launcher must stop it
    """), output_dir=tmp_path, max_restarts=3)
    assert code == 2
    assert err.count("starting 2 processes") == 1 and "process 1 exited with code 2 (user error)" in err
    assert read_jsonl(tmp_path / "events.jsonl", missing_ok=True) == []


def test_crash_restarts_the_whole_job_and_logs_a_restart_event(tmp_path):
    # A previous attempt logged up to step 7; the torn last line of a killed writer is skipped.
    (tmp_path / "metrics.jsonl").write_text('{"step": 6}\n{"step": 7}\n{"step": 8, "lo')
    (tmp_path / "events.jsonl").write_text('{"step": 0, "kind": "start"}\n{"step": 5, "kind": "checkpoint_saved"}\n')
    code, out, err = supervise(fake("""
        if ATTEMPT == 0 and PID == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if ATTEMPT == 0:
            time.sleep(60)  # a survivor stuck on its dead peer: stopped by the launcher
        print('attempt', ATTEMPT, 'port', os.environ['JAXTRAIN_COORDINATOR'])
    """), output_dir=tmp_path, max_restarts=1)
    assert code == 0, err
    *_, event = read_jsonl(tmp_path / "events.jsonl", missing_ok=True)
    assert event["kind"] == "restart" and event["attempt"] == 1 and event["step"] == 7
    assert event["process"] == 1 and event["signal"] == "SIGKILL" and "process 1 killed by SIGKILL" in event["reason"]
    assert set(out.split()) >= {"[p0]", "[p1]", "attempt", "1"}


def test_restarts_are_bounded_and_each_attempt_gets_a_new_port(tmp_path):
    code, out, err = supervise(fake("""
        if PID == 0:
            print(os.environ['JAXTRAIN_COORDINATOR'])
            sys.exit(75)
    """), output_dir=tmp_path, max_restarts=2)
    assert code == 75  # the last failure's code: an outer scheduler may restart us in turn
    events = read_jsonl(tmp_path / "events.jsonl", missing_ok=True)
    assert [e["attempt"] for e in events] == [1, 2] and all(e["exit_code"] == 75 for e in events)
    assert "restart requested" in events[0]["reason"] and events[0]["step"] == -1  # no metrics yet
    assert len(set(out.split())) == 1 + 3  # "[p0]" and three different coordinator addresses
    assert "no restarts left" in err


def test_a_fixed_port_counts_up_per_attempt():
    code, out, _ = supervise(fake("""
        if PID == 0:
            print(os.environ['JAXTRAIN_COORDINATOR'])
        sys.exit(1 if ATTEMPT == 0 else 0)
    """), port=23456, max_restarts=1)
    assert code == 0 and out.split()[1::2] == ["127.0.0.1:23456", "127.0.0.1:23457"]


def test_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    t = time.monotonic()
    code, _, err = supervise(fake("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a JAX process: SIGTERM is only noted
        if PID == 1:
            sys.exit(1)
        time.sleep(60)
    """), max_restarts=0, grace_period_s=0.5)
    assert code == 1 and "sending SIGKILL" in err and time.monotonic() - t < 20


def test_a_process_that_needs_a_human_stops_the_job_with_78_and_is_never_restarted(tmp_path):
    """Exit 78 (the rollback budget is spent, ...) is treated like 2: a restart would hit the same wall."""
    code, _, err = supervise(fake("""
        if PID == 1:
            sys.exit(78)
        time.sleep(60)
    """), max_restarts=3, output_dir=tmp_path, grace_period_s=0.5)
    assert code == 78 and "(a human is needed): stopped the others; not restarting" in err, err
    assert "restarting the job" not in err and not (tmp_path / "events.jsonl").exists()


def test_the_same_python_error_twice_without_progress_stops_the_job_with_78(tmp_path):
    """Process 1 fails with the same Python error on every attempt, and no attempt saves a checkpoint:
    a deterministic failure. The launcher restarts once (one error is not yet a pattern), then stops
    with 78 instead of spending the other restarts."""
    code, _, err = supervise(fake(f"""
        from jaxtrain.commands.train import _record_error
        if PID == 1:
            try:
                raise RuntimeError("a bug")
            except RuntimeError as e:
                _record_error({str(tmp_path)!r}, PID, 3, e)
            sys.exit(1)
        time.sleep(60)
    """), max_restarts=5, output_dir=tmp_path, grace_period_s=0.5)
    assert code == 78, err
    assert "the same error twice without progress: RuntimeError at ?, step 3 (a human is needed): not restarting" in err
    events = read_jsonl(tmp_path / "events.jsonl", missing_ok=True)
    assert [e["kind"] for e in events] == ["error", "restart", "error"]
    assert events[0]["process"] == 1 and events[0]["message"] == "a bug" and events[0]["step"] == 3


def test_a_different_error_or_progress_in_between_restarts(tmp_path):
    """Errors that change (the step here), and the same error after an attempt that saved a checkpoint:
    restarts, until the restarts are spent."""
    code, _, err = supervise(fake(f"""
        from jaxtrain.commands.train import _record_error
        from jaxtrain.observe.runlog import append_event
        if PID == 1:
            if ATTEMPT == 2:
                append_event({str(tmp_path)!r}, "checkpoint_saved", 2)
            try:
                raise RuntimeError("a bug")
            except RuntimeError as e:
                _record_error({str(tmp_path)!r}, PID, 3 + (ATTEMPT < 2) * ATTEMPT, e)
            sys.exit(1)
        time.sleep(60)
    """), max_restarts=3, output_dir=tmp_path, grace_period_s=0.5)
    assert code == 1 and "no restarts left" in err, err  # steps 3, 4, 3 (after progress), 3: never twice in a row


def test_the_error_event_names_the_innermost_jaxtrain_frame(tmp_path):
    from jaxtrain.commands.train import _record_error, error_details
    from jaxtrain.launch.policy import exit_status
    try:
        exit_status(None)  # a TypeError inside jaxtrain/launch/policy.py
    except TypeError as e:
        error = e
    details = error_details(error)
    assert details["type"] == "TypeError" and details["where"] == "jaxtrain/launch/policy.py:exit_status"
    assert error_details(RuntimeError("x" * 500 + "\nsecond line"))["message"] == "x" * 197 + "..."
    t = time.monotonic()
    _record_error(str(tmp_path), 2, 7, error)
    _record_error("gs://bucket/run", 2, 7, error)  # remote: nothing, no error
    _record_error(str(tmp_path), 2, 7, KeyboardInterrupt())  # an interrupt is no error
    _record_error(str(tmp_path), 2, 7, ConfigError("bad"))  # a user error writes nothing, as ever
    assert time.monotonic() - t < 1.0
    (event,) = read_jsonl(tmp_path / "events.jsonl", missing_ok=True)
    assert {k: event[k] for k in ("kind", "process", "step", "type", "where")} == {
        "kind": "error", "process": 2, "step": 7, "type": "TypeError", "where": "jaxtrain/launch/policy.py:exit_status"}


def test_a_process_sigkill_cannot_end_is_reported_and_the_launcher_goes_on(monkeypatch):
    """A child in uninterruptible sleep (D state) outlives SIGKILL: the launcher must not wait for it forever.
    Played by a child that ignores SIGTERM and a launcher whose SIGKILL does not reach it."""
    import jaxtrain.launch.supervisor as supervisor_module

    real_killpg, spared = os.killpg, []

    def killpg(pgid: int, sig: int) -> None:
        if sig == signal.SIGKILL and pgid in spared:
            return  # the process "does not die"
        real_killpg(pgid, sig)

    monkeypatch.setattr(supervisor_module, "KILL_WAIT_S", 0.5)
    monkeypatch.setattr(supervisor_module.os, "killpg", killpg)
    command = fake("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if PID == 1:
            time.sleep(0.5)
            sys.exit(1)
        time.sleep(60)
    """)
    supervisor = Supervisor(command, 2, max_restarts=0, grace_period_s=0.3, out=io.StringIO(), err=io.StringIO())
    original_start = supervisor._start

    def start(attempt: int, port: int) -> None:
        original_start(attempt, port)
        spared.append(supervisor._procs[0].pid)

    supervisor._start = start
    t = time.monotonic()
    try:
        code = supervisor.run()
    finally:
        for pid in spared:
            real_killpg(pid, signal.SIGKILL)
    err = supervisor.err.getvalue()
    assert code == 1 and time.monotonic() - t < 15, err
    assert "process 0 (pid " in err and "still alive 0.5 s after SIGKILL" in err, err


def test_the_first_process_to_exit_is_blamed_not_the_lowest_numbered(tmp_path):
    # Process 1 crashes; process 0 notices (a broken collective) and fails a moment later, within
    # one poll interval of the launcher (0.1 s): the restart event must name process 1. 50 ms, not
    # 10: on a loaded 2-core machine the waiter threads woke more than 10 ms late (once, #37).
    flag = tmp_path / "crashed"
    code, _, err = supervise(fake(f"""
        if ATTEMPT == 0 and PID == 1:
            open({str(flag)!r}, "w").close()
            os._exit(1)
        if ATTEMPT == 0:
            while not os.path.exists({str(flag)!r}):
                time.sleep(0.001)
            time.sleep(0.05)
            sys.exit(3)
    """), output_dir=tmp_path / "run", max_restarts=1)
    assert code == 0, err
    (event,) = read_jsonl(tmp_path / "run" / "events.jsonl", missing_ok=True)
    assert event["process"] == 1 and event["exit_code"] == 1, event


def shrink_by_one(processes: int, extra: list[str]) -> Shrink:
    """A stand-in plan: one process fewer, overrides that say how many."""
    return Shrink(processes=processes - 1, mesh={"data": processes - 1}, grad_accum=1,
                  overrides=[f"shrunk.to={processes - 1}"])


BAD_SLOT_1 = """
    if SLOT == 1:
        sys.exit(1)      # a bad node: crashes at every start
    if N == 3:
        time.sleep(60)   # its peers wait for it in vain: stopped by the launcher
    print('slot', SLOT, 'process', PID, 'of', N, 'attempt', ATTEMPT, 'args', *sys.argv[1:])
"""


def test_a_slot_that_crashes_at_every_start_is_isolated(tmp_path):
    code, out, err = supervise(fake(BAD_SLOT_1), num_processes=3, output_dir=tmp_path, max_restarts=3,
                               isolate_after=2, plan_isolation=shrink_by_one, host="node-b")
    assert code == 0, err
    kinds = [(e["kind"], e.get("slot"), e.get("attempt"))
             for e in read_jsonl(tmp_path / "events.jsonl", missing_ok=True)]
    assert kinds == [("restart", 1, 1), ("isolate", 1, None), ("restart", 1, 2)]
    isolate = read_jsonl(tmp_path / "events.jsonl", missing_ok=True)[1]
    assert isolate["host"] == "node-b" and isolate["failures"] == 2
    assert isolate["from_processes"] == 3 and isolate["processes"] == 2 and isolate["overrides"] == ["shrunk.to=2"]
    # Slots 0 and 2 go on as processes 0 and 1 of a 2-process job, with the plan's overrides.
    assert sorted(line for line in out.splitlines()) == [
        "[p0] slot 0 process 0 of 2 attempt 2 args shrunk.to=2",
        "[p1] slot 2 process 1 of 2 attempt 2 args shrunk.to=2"]
    assert "isolating it" in err and "slot 1 (host node-b) failed 2 attempts in a row" in err


def test_isolation_refused_gives_up_with_the_original_failure(tmp_path):
    def refuse(processes: int, extra: list[str]) -> Shrink:
        raise ShrinkRefused("data.global_batch_size=8 is not divisible by the 3 processes left")

    code, _, err = supervise(fake(BAD_SLOT_1), num_processes=3, output_dir=tmp_path, max_restarts=3,
                             isolate_after=2, plan_isolation=refuse)
    assert code == 1, err  # slot 1's own exit code
    events = read_jsonl(tmp_path / "events.jsonl", missing_ok=True)
    assert [e["kind"] for e in events] == ["restart", "isolate_refused"]
    assert "not divisible by the 3 processes" in events[1]["reason"] and events[1]["slot"] == 1
    assert "cannot continue without it" in err and err.count("starting 3 processes") == 2


def test_only_the_same_slot_failing_in_a_row_counts(tmp_path):
    # Slot 1 crashes, then asks for a restart (75: preempted/hang, no evidence against the node),
    # then crashes again: never two crashes in a row, so nothing is isolated.
    code, _, err = supervise(fake("""
        if PID == 1 and ATTEMPT in (0, 2):
            sys.exit(1)
        if PID == 1 and ATTEMPT == 1:
            sys.exit(75)
        if ATTEMPT < 3:
            time.sleep(60)
    """), output_dir=tmp_path, max_restarts=3, isolate_after=2, plan_isolation=shrink_by_one)
    assert code == 0, err
    assert [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl", missing_ok=True)] == ["restart"] * 3


def test_a_slot_that_hangs_at_every_attempt_is_isolated_by_the_hang_events(tmp_path):
    """Exit 75 alone is no evidence, but a `hang` event that finds one process furthest behind is:
    slot 1 hangs on every attempt (both processes exit 75, the way the watchdog stops a job), and
    is isolated after two; a 75 whose events blame several processes (or none) blames nobody."""
    events = tmp_path / "events.jsonl"
    code, out, err = supervise(fake(f"""
        import json
        if N == 2:
            if PID == 0:  # the hang event, as the watchdog writes it
                with open({str(events)!r}, "a") as f:
                    f.write(json.dumps({{"kind": "hang", "process": 0, "behind": [1]}}) + "\\n")
            sys.exit(75)
        print('slot', SLOT, 'of', N)
    """), num_processes=2, output_dir=tmp_path, max_restarts=3, isolate_after=2, plan_isolation=shrink_by_one)
    assert code == 0, err
    kinds = [(e["kind"], e.get("slot")) for e in read_jsonl(events, missing_ok=True) if e["kind"] != "hang"]
    assert kinds == [("restart", kinds[0][1]), ("isolate", 1), ("restart", kinds[2][1])], kinds
    assert out.splitlines() == ["[p0] slot 0 of 1"]
    code, _, err = supervise(fake(f"""
        import json
        if ATTEMPT < 3:
            if PID == 0:
                with open({str(tmp_path / "b" / "events.jsonl")!r}, "a") as f:
                    f.write(json.dumps({{"kind": "hang", "process": 0, "behind": [0, 1]}}) + "\\n")
            sys.exit(75)
    """), num_processes=2, output_dir=tmp_path / "b", max_restarts=3, isolate_after=2, plan_isolation=shrink_by_one)
    assert code == 0 and "isolat" not in err, err


def test_isolate_after_needs_enough_restarts():
    with pytest.raises(ConfigError, match="--max-restarts >= 3"):
        Supervisor(["true"], 2, max_restarts=2, isolate_after=3, plan_isolation=shrink_by_one)


LAUNCHER = textwrap.dedent("""
    import sys
    from jaxtrain.launch.supervisor import Supervisor
    sys.exit(Supervisor(sys.argv[1:], 2, grace_period_s=10).run())
""")


def test_sigterm_is_forwarded_and_the_job_is_not_restarted():
    # Children that save and ask to be restarted on SIGTERM (what a preempted trainer does).
    child = fake("""
        def on_term(signum, frame):
            print('saving', flush=True)
            sys.exit(75)
        signal.signal(signal.SIGTERM, on_term)
        print('ready', flush=True)
        time.sleep(60)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *child], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    ready = 0
    while ready < 2:  # both children have installed their handler
        ready += "ready" in launcher.stdout.readline()
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 75, err
    assert out.count("saving") == 2 and "received SIGTERM" in err and "attempt 1" not in err


# ----------------------------------------------------------------------------- planning a smaller job

def tiny(*overrides: str):
    return load_config(TINY, list(overrides))


@pytest.mark.parametrize("overrides, processes, devices, want_overrides, want_mesh", [
    # 2 x 2 devices, data=4, 8 sequences in one microbatch -> 1 x 2 devices, data=2, two microbatches of 4
    (["data.global_batch_size=8"], 2, 2, ["mesh.data=-1", "train.grad_accum=2"],
     {"data": 2, "stage": 1, "fsdp": 1, "tensor": 1}),
    # FSDP inside the replica stays; 8 -> 6 devices, batch ways 8 -> 6: grad_accum 1 -> 2 (12 rows / 6)
    (["data.global_batch_size=24", "mesh.fsdp=2"], 4, 2, ["mesh.data=-1", "train.grad_accum=2"],
     {"data": 3, "stage": 1, "fsdp": 2, "tensor": 1}),
    # a filled axis other than data is pinned, or it would take the change
    (["data.global_batch_size=8", "mesh.data=2", "mesh.fsdp=-1"], 2, 2,
     ["mesh.data=-1", "mesh.fsdp=2", "train.grad_accum=2"], {"data": 1, "stage": 1, "fsdp": 2, "tensor": 1}),
    # a hybrid (DCN) mesh: one DCN slice per process left
    (["data.global_batch_size=24", "mesh.dcn_data=3"], 3, 2, ["mesh.data=-1", "mesh.dcn_data=2", "train.grad_accum=2"],
     {"data": 4, "stage": 1, "fsdp": 1, "tensor": 1}),
    # accumulation already on: 2 -> 4
    (["data.global_batch_size=16", "train.grad_accum=2"], 2, 2, ["mesh.data=-1", "train.grad_accum=4"],
     {"data": 2, "stage": 1, "fsdp": 1, "tensor": 1}),
])
def test_plan_shrink_keeps_the_global_batch_and_the_model_layout(overrides, processes, devices, want_overrides,
                                                                  want_mesh):
    cfg = tiny(*overrides)
    plan = plan_shrink(cfg, processes, devices)
    # axes the case does not name (context, ...) are 1
    mesh = {a: n for a, n in plan.mesh.items() if n != 1 or a in want_mesh}
    assert plan.processes == processes - 1 and plan.overrides == want_overrides and mesh == want_mesh
    # The plan applied is a valid config with the same global batch, and no device gets more rows
    # per microbatch than before (every device splits the batch here: no tensor parallelism).
    shrunk = tiny(*overrides, *plan.overrides)
    assert shrunk.data.global_batch_size == cfg.data.global_batch_size
    before = cfg.data.global_batch_size / cfg.train.grad_accum / (processes * devices)
    after = shrunk.data.global_batch_size / shrunk.train.grad_accum / ((processes - 1) * devices)
    assert after <= before


@pytest.mark.parametrize("overrides, processes, devices, message", [
    (["data.global_batch_size=8"], 1, 2, "no process would be left"),
    (["data.global_batch_size=8"], 4, 2, "not divisible by the 3 processes left"),
    (["data.global_batch_size=8", "mesh.tensor=4"], 2, 2, "do not split into model replicas"),
    (["data.global_batch_size=8", "mesh.fsdp=2", "mesh.dcn_fsdp=2"], 2, 2, "mesh.dcn_fsdp=2 spreads FSDP"),
    (["data.global_batch_size=6"], 3, 2, "no train.grad_accum >= 2 splits data.global_batch_size=6"),
    (["data.global_batch_size=8", "mesh.data=3"], 2, 2, "does not fit 4 devices"),
])
def test_plan_shrink_refuses_what_cannot_train_the_same_run(overrides, processes, devices, message):
    with pytest.raises(ShrinkRefused, match=message):
        plan_shrink(tiny(*overrides), processes, devices)


def test_isolation_needs_the_devices_per_process():
    with pytest.raises(ConfigError, match="--devices-per-process"):
        main(["--num-processes", "2", "--isolate-after", "1", "--", "train", "--config", TINY])


def test_crash_drill_fires_on_every_attempt_in_its_slot_only(monkeypatch):
    """chaos.crash_process: at start-up (crash_at_step=0) or after the first step >= N, on every
    attempt, in the slot named (JAXTRAIN_SLOT, kept across isolations), not in the process with that index."""
    from jaxtrain.fault import chaos

    class Crashed(Exception):
        pass

    def exit_(code):
        raise Crashed(code)

    monkeypatch.setattr(chaos.os, "_exit", exit_)
    events = []
    for attempt in (0, 3):
        with pytest.raises(Crashed, match="1"):
            chaos.Chaos(tiny("chaos.crash_process=1").chaos, 1, lambda *a, **k: events.append((a, k)), attempt=attempt,
                        slot=1).at_start()
        late = chaos.Chaos(tiny("chaos.crash_process=1", "chaos.crash_at_step=3").chaos, 1, lambda *a, **k: None,
                           attempt=attempt, slot=1)
        late.at_start()
        late.after_step(2, None)
        with pytest.raises(Crashed):
            late.after_step(4, None)  # resumed past step 3: the first step it runs crashes
    assert events[0][0] == ("chaos", 0) and events[0][1]["drill"] == "crash" and events[0][1]["slot"] == 1
    # After an isolation slot 2 runs as process 1: no crash. Outside the launcher the slot is the process index.
    chaos.Chaos(tiny("chaos.crash_process=1").chaos, 1, lambda *a, **k: None, slot=2).at_start()
    with pytest.raises(Crashed):
        chaos.Chaos(tiny("chaos.crash_process=1").chaos, 1, lambda *a, **k: None).at_start()
    with pytest.raises(ConfigError, match="chaos.crash_process"):
        tiny("chaos.crash_process=-2")


def test_last_known_step(tmp_path):
    assert last_known_step(tmp_path) == -1 and last_known_step(None) == -1 and last_known_step("gs://b/run") == -1
    # metrics are logged every log_every steps; a checkpoint event may be later
    (tmp_path / "metrics.jsonl").write_text('{"step": 20}\n')
    (tmp_path / "events.jsonl").write_text('{"step": 0, "kind": "start"}\n{"step": 25, "kind": "checkpoint_saved"}\n')
    assert last_known_step(tmp_path) == 25


# ----------------------------------------------------------------------------- the CLI verb

@pytest.mark.parametrize("argv, message", [
    (["--num-processes", "2"], "expected `jaxtrain launch"),
    (["--num-processes", "2", "--", "inspect", "--config", TINY], "expected `jaxtrain launch"),
    (["--num-processes", "2", "--cpu-devices", "2", "--", "train", "--config", TINY, "--cpu-devices", "2"],
     "given both"),
    (["--num-processes", "2", "--", "train", "--config", "missing.yaml"], "does not exist"),
    (["--num-processes", "2", "--", "train", "--config", TINY, "train.stepz=3"], "train.stepz"),
    (["--num-processes", "0", "--", "train", "--config", TINY], "at least 1"),
])
def test_bad_launch_arguments_are_user_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        main(argv)


def test_bad_launch_option_exits_2_via_the_cli():
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "two", "--", "train"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--num-processes" in r.stderr


def test_the_launcher_never_imports_jax():
    code = ("import sys, jaxtrain.commands.cli, jaxtrain.commands.launch, jaxtrain.launch.supervisor; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def child_env(tmp_path_factory) -> dict[str, str]:
    """Environment for launched trainers: CPU, devices from --cpu-devices only, a shared XLA cache.

    conftest.py gives this pytest process 8 simulated devices through XLA_FLAGS; children must not
    inherit that. The persistent compilation cache lets later runs (and restarts) skip compiling.
    """
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env.update({"JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",  # as conftest does in-process
                "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("xla_cache")),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "PYTHONPATH": os.pathsep.join(sys.path)})
    return env


def launch(env: dict[str, str], cwd: Path, *args: str, overrides: list[str]) -> subprocess.CompletedProcess:
    cache = ["checkpoint.compilation_cache_dir=" + env["JAX_COMPILATION_CACHE_DIR"]]
    return subprocess.run([sys.executable, "-m", "jaxtrain", "launch", *args, "--", "train", "--config", TINY,
                           *TINY_OVERRIDES, *cache, *overrides],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# The drills below change only chaos.*, which leaves the numerics alone: each is compared with this
# uninterrupted run. Saves are synchronous so that "step 2 is committed before the failure at step 3"
# is certain.
RESILIENCE = ["train.steps=6", "checkpoint.every_steps=2", "checkpoint.async_save=false"]


def event(events: list[dict], kind: str) -> dict:
    return next(e for e in events if e["kind"] == kind)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, child_env) -> Path:
    """An uninterrupted 2-process x 2-device run of RESILIENCE: the run directory."""
    out = tmp_path_factory.mktemp("reference") / "run"
    r = launch(child_env, out.parent, "--num-processes", "2", "--cpu-devices", "2",
               overrides=[f"run.output_dir={out}", *RESILIENCE])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[p0]" in r.stdout + r.stderr and "[p1]" in r.stdout + r.stderr
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_train_as_one_job(reference):
    events = read_jsonl(reference / "events.jsonl", missing_ok=True)
    start = event(events, "start")
    assert start["devices"] == 4 and start["processes"] == 2 and start["mesh"]["data"] == 4
    assert [m["step"] for m in read_jsonl(reference / "metrics.jsonl", missing_ok=True)] == [1, 2, 3, 4, 5, 6]
    assert events[-1]["kind"] == "done" and not any(e["kind"] == "restart" for e in events)


@pytest.mark.multiprocess
def test_user_error_in_a_process_exits_2_without_restart(tmp_path, child_env):
    out = tmp_path / "run"
    # mesh.data=3 passes phase 1 but cannot fit 4 devices: each process exits 2 after distributed init.
    r = launch(child_env, tmp_path, "--num-processes", "2", "--cpu-devices", "2", "--max-restarts", "3",
               overrides=[f"run.output_dir={out}", "mesh.data=3"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert "mesh" in r.stderr and "(user error)" in r.stderr and r.stderr.count("starting 2 processes") == 1
    assert not (out / "events.jsonl").exists()  # nothing written for a user error


@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_process_restarts_the_job_and_ends_bitwise_equal(tmp_path, child_env, reference):
    """2 processes x 2 devices: save, kill, resume. chaos.kill_at_step SIGKILLs process 1 after step 3;
    the trainer fires it only on the first attempt (JAXTRAIN_RESTART_ATTEMPT=0), so the restarted job
    resumes from the step-2 checkpoint and runs to the end, bitwise equal to the uninterrupted run.
    `jaxtrain goodput` accounts for the restart."""
    out = tmp_path / "run"
    r = launch(child_env, tmp_path, "--num-processes", "2", "--cpu-devices", "2", "--max-restarts", "1",
               "--grace-period-s", "2",
               overrides=[f"run.output_dir={out}", *RESILIENCE, "chaos.kill_at_step=3", "chaos.kill_process=1"])
    events = read_jsonl(out / "events.jsonl", missing_ok=True)
    restarts = [e for e in events if e["kind"] == "restart"]
    assert len(restarts) >= 1, r.stderr[-3000:]
    assert restarts[0]["attempt"] == 1 and restarts[0]["process"] == 1 and restarts[0]["signal"] == "SIGKILL"
    assert restarts[0]["step"] >= 2  # the last step the first attempt recorded
    assert r.returncode == 0, "the restarted job died again; does the trainer skip chaos when " \
                              f"{RESTART_ATTEMPT_ENV} > 0?\n" + r.stderr[-3000:]
    assert event(events, "resume")["restored_step"] == 2
    assert event(events, "start")["devices"] == 4 and event(events, "start")["processes"] == 2
    assert events[-1]["kind"] == "done" and events[-1]["step"] == 6
    metrics = read_jsonl(out / "metrics.jsonl", missing_ok=True)
    assert [m["step"] for m in metrics][-4:] == [3, 4, 5, 6]  # after the restore every step runs again
    want = {m["step"]: m for m in read_jsonl(reference / "metrics.jsonl", missing_ok=True)}
    for m in metrics:
        assert (m["loss"], m["grad_norm"]) == (want[m["step"]]["loss"], want[m["step"]]["grad_norm"]), m["step"]
    assert_trees_equal(final_params(out), final_params(reference), "final parameter ")

    # Goodput of this run: one restart, steps logged before the kill and again after the restore are
    # re-done (step 3, if process 0 logged it before it was stopped), the parts add up to the wall time.
    g = subprocess.run([sys.executable, "-m", "jaxtrain", "goodput", str(out), "--json"], env=child_env,
                       capture_output=True, text=True, timeout=60)
    assert g.returncode == 0, g.stderr
    report = json.loads(g.stdout)
    redone = len(metrics) - 6
    assert report["restarts"] == 1 and report["attempts"] == 2 and report["steps"]["redone"] == redone
    assert abs(sum(report["parts"].values()) - report["wall_s"]) < 1e-6
    parts = report["parts"]
    assert parts["restart_downtime_s"] > 0 and (parts["redone_steps_s"] > 0) == (redone > 0)
    assert parts["productive_s"] > 0
    assert parts["startup_s"] >= report["compile_s"] > 0 and parts["checkpoint_s"] > 0
    assert parts["other_s"] < 0.2 * report["wall_s"], report  # nearly everything is attributed


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_bad_slot_is_isolated_and_the_run_continues_on_fewer_processes(tmp_path, child_env, reference):
    """Slot 1 crashes right after step 3 on every attempt (chaos.crash_process: a bad node). With
    --isolate-after 2 the launcher restarts once (same crash), then continues without slot 1: one
    process of 2 devices, mesh.data 4 -> 2, train.grad_accum 1 -> 2, from the step-2 checkpoint. The
    global batch and the data order are those of the 2-process run, so its losses match the
    reference within float tolerance (only the summation order changed)."""
    out = tmp_path / "run"
    r = launch(child_env, tmp_path, "--num-processes", "2", "--cpu-devices", "2", "--max-restarts", "2",
               "--grace-period-s", "2", "--isolate-after", "2",
               overrides=[f"run.output_dir={out}", *RESILIENCE, "chaos.crash_process=1", "chaos.crash_at_step=3"])
    assert r.returncode == 0, r.stderr[-3000:]
    events = read_jsonl(out / "events.jsonl", missing_ok=True)
    assert [(e["kind"], e.get("slot")) for e in events if e["kind"] in ("restart", "isolate")] == [
        ("restart", 1), ("isolate", 1), ("restart", 1)]
    isolate = event(events, "isolate")
    assert isolate["failures"] == 2 and isolate["processes"] == 1 and isolate["host"]
    assert isolate["overrides"] == ["mesh.data=-1", "train.grad_accum=2"]
    starts = [e for e in events if e["kind"] == "start"]
    assert [(s["processes"], s["devices"], s["mesh"]["data"]) for s in starts] == [(2, 4, 4), (2, 4, 4), (1, 2, 2)]
    assert [e["restored_step"] for e in events if e["kind"] == "resume"] == [2, 2]
    assert events[-1]["kind"] == "done" and events[-1]["step"] == 6
    resolved = load_config(out / "config.yaml")  # what the last attempt ran with
    assert resolved.data.global_batch_size == 8 and resolved.train.grad_accum == 2

    want = {m["step"]: m for m in read_jsonl(reference / "metrics.jsonl", missing_ok=True)}
    # later lines win: the 1-process steps
    got = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl", missing_ok=True)}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (1, 2):  # before the failures: the same 2-process job, bitwise
        assert got[step]["loss"] == want[step]["loss"]
    for step in (3, 4, 5, 6):  # one process, two microbatches: the same batches, summed in another order
        assert got[step]["tokens_per_step"] == want[step]["tokens_per_step"]
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), step
    assert_trees_close(final_params(out), final_params(reference), rel=1e-4, what="final parameter ")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_same_python_error_twice_stops_a_real_job_with_78(tmp_path, child_env):
    """Process 1 raises a RuntimeError right after step 3 on every attempt (chaos.raise_every_attempt: a
    deterministic bug) and no checkpoint is saved before it: each attempt logs an `error` event, the
    second with the first's signature, so `jaxtrain launch` stops with 78 after the second attempt
    instead of spending its other 4 restarts."""
    out = tmp_path / "run"
    r = launch(child_env, tmp_path, "--num-processes", "2", "--cpu-devices", "2", "--max-restarts", "5",
               "--grace-period-s", "2",
               overrides=[f"run.output_dir={out}", "train.steps=6", "checkpoint.every_steps=100",
                          "chaos.raise_at_step=3", "chaos.raise_process=1", "chaos.raise_every_attempt=true"])
    assert r.returncode == 78, r.stderr[-3000:]
    assert r.stderr.count("starting 2 processes") == 2
    said = "the same error twice without progress: RuntimeError at jaxtrain/fault/chaos.py:after_step, step 3"
    assert said in r.stderr, r.stderr[-3000:]
    events = read_jsonl(out / "events.jsonl", missing_ok=True)
    errors = [e for e in events if e["kind"] == "error" and e["process"] == 1]
    assert len(errors) == 2, events
    for e in errors:
        assert (e["type"], e["where"], e["step"]) == ("RuntimeError", "jaxtrain/fault/chaos.py:after_step", 3)
        assert e["message"] == "chaos.raise_at_step: injected error on process 1 at step 3"
    assert [e["attempt"] for e in events if e["kind"] == "restart"] == [1]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hybrid_dcn_mesh_matches_one_process(tmp_path, child_env):
    """mesh.dcn_data=2: data parallelism across the 2 processes through a hybrid (DCN x ICI) mesh,
    computing what one process with the same 4 devices computes."""
    hybrid, single = tmp_path / "hybrid", tmp_path / "single"
    r = launch(child_env, tmp_path, "--num-processes", "2", "--cpu-devices", "2",
               overrides=[f"run.output_dir={hybrid}", "mesh.dcn_data=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    cache = "checkpoint.compilation_cache_dir=" + child_env["JAX_COMPILATION_CACHE_DIR"]
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY, *TINY_OVERRIDES, cache,
                        f"run.output_dir={single}", "--cpu-devices", "4"], cwd=tmp_path, env=child_env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = read_jsonl(hybrid / "metrics.jsonl", missing_ok=True)
    want = read_jsonl(single / "metrics.jsonl", missing_ok=True)
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_to_a_two_process_job_saves_once_and_exits_75(tmp_path, child_env):
    """Preemption of a multi-host job: the processes agree on one step (their stop flags are
    combined on the devices), write one emergency checkpoint together, and exit 75."""
    out = tmp_path / "run"
    cache = "checkpoint.compilation_cache_dir=" + child_env["JAX_COMPILATION_CACHE_DIR"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "2", "--cpu-devices", "2", "--",
         "train", "--config", TINY, *TINY_OVERRIDES, cache, f"run.output_dir={out}", "train.steps=100000"],
        cwd=tmp_path, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while (len(read_jsonl(out / "metrics.jsonl", missing_ok=True)) < 3 and time.time() < deadline
           and launcher.poll() is None):
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 75, err[-3000:]
    events = read_jsonl(out / "events.jsonl", missing_ok=True)
    stopped = next(e for e in events if e["kind"] == "preempted")["step"]
    assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [stopped] and stopped >= 3
    assert not any(e["kind"] == "restart" for e in events)


def _child_with_process_id(launcher_pid: int, process_id: int) -> int:
    """The pid of the launcher's child that runs JAXTRAIN_PROCESS_ID=process_id (from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"JAXTRAIN_PROCESS_ID") == str(process_id).encode():
            return int(entry)
    raise AssertionError(f"no child with JAXTRAIN_PROCESS_ID={process_id}")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_to_one_process_stops_the_job_together_and_it_resumes(tmp_path, child_env):
    """One host preempted: only process 1 gets SIGTERM. Both processes stop after the same step (agreed
    at a sync point), write one emergency checkpoint together, exit 75; the launcher restarts the job,
    which resumes from that checkpoint and finishes without losing or repeating a step."""
    out = tmp_path / "run"
    cache = "checkpoint.compilation_cache_dir=" + child_env["JAX_COMPILATION_CACHE_DIR"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "2", "--cpu-devices", "1",
         "--max-restarts", "1", "--", "train", "--config", TINY, *TINY_OVERRIDES, cache,
         f"run.output_dir={out}", "train.steps=40", "train.host_sync_every=2", "chaos.slow_seconds=0.2",
         "chaos.slow_process=0"],
        cwd=tmp_path, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while (len(read_jsonl(out / "metrics.jsonl", missing_ok=True)) < 4 and time.time() < deadline
           and launcher.poll() is None):
        time.sleep(0.1)
    os.kill(_child_with_process_id(launcher.pid, 1), signal.SIGTERM)
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err[-3000:]
    events = read_jsonl(out / "events.jsonl", missing_ok=True)
    stopped = [e["step"] for e in events if e["kind"] == "preempted"]
    assert len(stopped) == 1 and 4 <= stopped[0] < 40, events
    saved = [e["step"] for e in events if e["kind"] == "checkpoint_saved"]
    assert saved == [stopped[0], 40]  # the emergency checkpoint, then the final one
    assert [e["kind"] for e in events].count("restart") == 1
    assert next(e for e in events if e["kind"] == "resume")["restored_step"] == stopped[0]
    steps = [m["step"] for m in read_jsonl(out / "metrics.jsonl", missing_ok=True)]
    assert sorted(set(steps)) == list(range(1, 41)) and len(steps) == 40  # no step lost, none run twice
