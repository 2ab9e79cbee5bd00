"""The recovery policy (`jaxtrain/launch/policy.py`) as tables: exits and events in, decision out.

The policy tables start no process and read no file: every case that the subprocess tests of
`tests/launch/test_launch.py` (the Supervisor with stand-in children) and `tests/launch/test_slurm.py`
(train.sbatch with a stand-in srun) cover is a row here, plus edges they do not reach. Then
`jaxtrain recovery` (the verbs train.sbatch calls), in-process through `jaxtrain.commands.cli.main` with
real files in tmp_path, and one subprocess that checks that none of this imports JAX.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import TINY

from jaxtrain.commands import cli
from jaxtrain.launch.policy import (SAME_ERROR_TWICE, Attempt, Done, Exit, Failure, GiveUp, History, Isolate, Limits,
                                    Restart, Stop, attempt_steps, blame, blamed_process, decide, error_signature,
                                    exit_after_signal, exit_status, first_failure, made_progress, slurm_restart)



def hang(*behind: int, time: float | None = None) -> dict:
    """A `hang` event as the watchdog writes it (`behind`: the processes furthest behind)."""
    return {"kind": "hang", "process": 0, "behind": list(behind), **({} if time is None else {"time": time})}


def preflight(*named: int, time: float | None = None) -> dict:
    """A `preflight_failed` event naming the slow processes."""
    return {"kind": "preflight_failed", "named": list(named), **({} if time is None else {"time": time})}


def error(process: int = 1, type: str = "RuntimeError", where: str = "jaxtrain/fault/chaos.py:after_step",
          step: int = 3, time: float | None = None) -> dict:
    """An `error` event as `jaxtrain train` writes it when it fails with a Python exception."""
    return {"kind": "error", "process": process, "type": type, "where": where, "step": step,
            "message": f"{type} on process {process}", **({} if time is None else {"time": time})}


def attempt(*exits: tuple[int, int], slots=(0, 1, 2), events=(), started=0.0, code=None, progress=False) -> Attempt:
    """An attempt: (process, exit code) pairs in the order the processes exited."""
    return Attempt(exits=tuple(Exit(p, c) for p, c in exits), slots=tuple(slots), events=tuple(events),
                   started=started, code=code, progress=progress)


def kind(decision) -> str:
    """A decision in one word, with its slot for Isolate: 'done', 'stop', 'restart', 'isolate 1', 'give-up'."""
    if isinstance(decision, Isolate):
        return f"isolate {decision.slot}"
    return {Done: "done", Stop: "stop", Restart: "restart", GiveUp: "give-up"}[type(decision)]


# ----------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("suspects, streak", [
    ((), 0),
    ((1,), 1),
    ((1, 1), 2),
    ((2, 1, 1), 2),
    ((1, None), 0),           # the latest attempt blamed nobody: the streak is broken
    ((1, None, 1), 1),        # ... and starts again
    ((1, 2), 1),              # another slot failed first: a new streak
    (("node-b", "node-b", "node-b"), 3),
])
def test_streak(suspects, streak):
    assert History(suspects).streak == streak
    assert History(suspects[:-1]).after(suspects[-1] if suspects else None).suspects == (suspects or (None,))


@pytest.mark.parametrize("exits, first", [
    ([], None),
    ([(0, 0), (1, 0)], None),
    ([(1, 1), (0, 3)], 1),     # the first to exit is the cause, not the lowest numbered
    ([(0, 0), (2, -9)], 2),    # a signal is a failure; a clean exit before it is not
])
def test_first_failure(exits, first):
    got = first_failure([Exit(p, c) for p, c in exits])
    assert (got.process if got else None) == first


@pytest.mark.parametrize("events, since, blamed", [
    ([], 0.0, None),                                    # a plain exit 75: nobody
    ([hang(1)], 0.0, 1),                                # a hang naming exactly one process
    ([hang(0, 1)], 0.0, None),                          # several behind: nobody
    ([preflight(2)], 0.0, 2),                           # a failed preflight's slow process
    ([{"kind": "checkpoint_saved"}, hang(1)], 0.0, 1),  # other events are no evidence
    ([hang(0, 1), hang(1)], 0.0, None),                 # the first blaming event decides
    ([hang(1, time=100.0)], 200.0, None),               # older than the attempt: ignored
    ([hang(1, time=100.0), hang(0, time=300.0)], 200.0, 0),
    ([hang(1)], 200.0, None),                           # no time: as if logged at 0, i.e. older
])
def test_blamed_process(events, since, blamed):
    assert blamed_process(events, since) == blamed


@pytest.mark.parametrize("ended, want", [
    (attempt((0, 1)), Failure(process=0, code=1, slot=0, blamed=None, suspect=0)),
    (attempt((1, -9), (0, 1)), Failure(process=1, code=-9, slot=1, blamed=None, suspect=1)),
    # exit 75 is a decision, not a crash: only the attempt's events can blame a slot
    (attempt((0, 75), (1, 75)), Failure(process=0, code=75, slot=0, blamed=None, suspect=None)),
    (attempt((0, 75), (1, 75), events=[hang(1)]), Failure(process=0, code=75, slot=0, blamed=1, suspect=1)),
    (attempt((0, 75), events=[preflight(1)], slots=(0, 2)),  # after an isolation process 1 runs in slot 2
     Failure(process=0, code=75, slot=0, blamed=1, suspect=2)),
    (attempt((0, 75), events=[hang(5)], slots=(0, 1)), Failure(process=0, code=75, slot=0, blamed=5, suspect=None)),
    # a crash is blamed on its slot whatever the events say
    (attempt((0, 1), events=[hang(1)]), Failure(process=0, code=1, slot=0, blamed=None, suspect=0)),
    (attempt(code=1), Failure(process=None, code=None, slot=None, blamed=None, suspect=None)),  # no exit recorded
])
def test_blame(ended, want):
    assert blame(ended) == want


@pytest.mark.parametrize("codes, signum, want", [
    ([0, 0], 15, 0),
    ([75, -15], 15, 75),    # preempted after an emergency save: the scheduler should requeue
    ([-15, -15], 15, 143),
    ([1, 0], 2, 130),
    ([], 15, 143),
])
def test_exit_after_signal(codes, signum, want):
    assert exit_after_signal(codes, signum) == want


@pytest.mark.parametrize("done, allowed, left, minimum, requeues, max_requeues, want", [
    (0, 2, 10_000, 600, 0, 3, "restart"),
    (1, 2, 10_000, 600, 0, 3, "restart"),
    (2, 2, 10_000, 600, 0, 3, "requeue"),   # step restarts spent
    (0, 2, 300, 600, 0, 3, "requeue"),      # too little time left in the allocation (the time-limit SIGTERM)
    (0, 0, 10_000, 600, 2, 3, "requeue"),
    (0, 0, 10_000, 600, 3, 3, None),        # nothing left
    (2, 2, 300, 600, 1, 1, None),
])
def test_slurm_restart(done, allowed, left, minimum, requeues, max_requeues, want):
    assert slurm_restart(done, allowed, left, minimum, requeues, max_requeues) == want


@pytest.mark.parametrize("restored_before, saved_after, want", [
    (-1, -1, False),   # started fresh, saved nothing: a crash before the first checkpoint
    (-1, 0, True),     # started fresh, saved step 0 (or later)
    (20, -1, False),   # resumed from 20, saved nothing (a crash loop a few steps after the checkpoint)
    (20, 20, False),   # resumed from 20 and "saved" 20 again: nowhere
    (20, 21, True),    # an emergency checkpoint at the time limit / preemption
    (20, 30, True),
])
def test_made_progress(restored_before, saved_after, want):
    assert made_progress(restored_before, saved_after) is want


@pytest.mark.parametrize("done, allowed, left, minimum, requeues, max_requeues, want", [
    (2, 2, 10_000, 600, 3, 3, "restart"),   # budgets spent, but the attempt made progress: not counted
    (2, 2, 300, 600, 3, 3, "requeue"),      # the time-limit SIGTERM after an emergency save: a free requeue
    (0, 0, 300, 600, 0, 1, "requeue"),      # MAX_REQUEUES=1, 0 counted
    (0, 2, 10_000, 600, 0, 0, "restart"),
    (0, 0, 10_000, 600, 0, 1, "requeue"),   # a budget of 0 (STEP_RESTARTS=0) still turns step restarts off
    (0, 0, 300, 600, 0, 0, None),           # ... and MAX_REQUEUES=0 requeues

])
def test_slurm_restart_after_progress_spends_no_budget(done, allowed, left, minimum, requeues, max_requeues, want):
    assert slurm_restart(done, allowed, left, minimum, requeues, max_requeues, progress=True) == want


# ----------------------------------------------------------------------------- one decision

LAUNCH = Limits(restarts_left=3)  # `jaxtrain launch --max-restarts 3`, no isolation
ISOLATE_2 = Limits(restarts_left=3, isolate_after=2)


@pytest.mark.parametrize("ended, history, limits, want, code, streak", [
    # all zero -> done
    (attempt((0, 0), (1, 0), (2, 0)), History(), LAUNCH, "done", None, None),
    # a 2 -> stop, never restart: even with restarts left, and even when it was not the first to fail
    (attempt((1, 2)), History(), LAUNCH, "stop", 2, None),
    (attempt((0, 1), (1, 2)), History((0,)), ISOLATE_2, "stop", 2, None),
    # a 78 ("a human is needed": the rollback budget is spent) -> stop with 78, like a 2; a 2 wins
    (attempt((1, 78)), History(), LAUNCH, "stop", 78, None),
    (attempt((0, 1), (1, 78)), History((0,)), ISOLATE_2, "stop", 78, None),
    (attempt((0, 78), (1, 2)), History(), LAUNCH, "stop", 2, None),
    (attempt((0, 78), (1, 137), code=137, slots=("a", "b")), History(), LAUNCH, "stop", 78, None),  # srun: 137
    (attempt(code=78, slots=()), History(), LAUNCH, "stop", 78, None),
    # 75, a crash, a signal -> restart while restarts are left
    (attempt((0, 75)), History(), LAUNCH, "restart", None, 0),
    (attempt((1, 1), (0, 3)), History(), LAUNCH, "restart", None, 1),
    (attempt((1, -9)), History(), LAUNCH, "restart", None, 1),
    # restarts exhausted -> give up with the failure's code (a signal as 128 + n)
    (attempt((0, 75)), History(), Limits(restarts_left=0), "give-up", 75, 0),
    (attempt((1, -9)), History(), Limits(restarts_left=0), "give-up", 137, 1),
    (attempt((1, 1)), History(), Limits(restarts_left=0), "give-up", 1, 1),
    # the same slot first to fail K attempts in a row -> isolate it
    (attempt((1, 1)), History((1,)), ISOLATE_2, "isolate 1", None, 2),
    (attempt((1, 1)), History((1, 1)), Limits(restarts_left=3, isolate_after=3), "isolate 1", None, 3),
    (attempt((1, 1)), History((1,)), LAUNCH, "restart", None, 2),                 # isolation off (K = 0)
    # ... but not when the streak is broken: another slot, or an attempt that blamed nobody
    (attempt((2, 1)), History((1,)), ISOLATE_2, "restart", None, 1),
    (attempt((1, 1)), History((1, None)), ISOLATE_2, "restart", None, 1),
    (attempt((1, 75)), History((1,)), ISOLATE_2, "restart", None, 0),            # a plain 75: nobody
    # a hang event of this attempt naming exactly one process counts against its slot
    (attempt((0, 75), (1, 75), events=[hang(1)]), History((1,)), ISOLATE_2, "isolate 1", None, 2),
    (attempt((0, 75), (1, 75), events=[hang(0, 1)]), History((1,)), ISOLATE_2, "restart", None, 0),
    # an event older than the attempt blames nobody
    (attempt((0, 75), events=[hang(1, time=1.0)], started=2.0), History((1,)), ISOLATE_2, "restart", None, 0),
    # jaxtrain launch: isolation is one of the restarts: none left -> give up, not isolate
    (attempt((1, 1)), History((1,)), Limits(restarts_left=0, isolate_after=2), "give-up", 1, 2),
])
def test_decide(ended, history, limits, want, code, streak):
    decision = decide(ended, history, limits)
    assert kind(decision) == want
    if code is not None:
        assert decision.code == code
    if streak is not None:
        assert decision.history.streak == streak
        assert decision.history.suspects[:-1] == history.suspects  # one entry per failed attempt


def test_isolate_falls_back_as_its_limits_say():
    crash = attempt((1, 1))
    # jaxtrain launch: no smaller job -> give up with the original failure
    launch = decide(crash, History((1,)), ISOLATE_2)
    assert isinstance(launch.fallback, GiveUp) and launch.fallback.code == 1
    assert launch.fallback.reason == "no smaller job"
    # train.sbatch: leaving a node out is free, even with no restart left; when it cannot be done,
    # the failure is handled as any other
    for left, fallback in ((1, Restart), (0, GiveUp)):
        sbatch = decide(crash, History((1,)), Limits(restarts_left=left, isolate_after=2, isolation_is_restart=False))
        assert isinstance(sbatch, Isolate) and isinstance(sbatch.fallback, fallback)
        assert sbatch.fallback.history == sbatch.history


@pytest.mark.parametrize("ended, history, want, code", [
    # the scheduler's exit code says done / user error, whatever the records say (or without any)
    (attempt(code=0, slots=()), History(), "done", None),
    (attempt((0, 2), code=2, slots=("node-a",)), History(), "stop", 2),
    (attempt(code=2, slots=()), History(), "stop", 2),
    # srun's 137 after node-b's task crashed first: counts against node-b
    (attempt((1, 1), (0, 137), code=137, slots=("node-a", "node-b")), History(("node-b",)), "isolate node-b", None),
    # a 2 that is not srun's code is a failure like any other (as train.sbatch always did)
    (attempt((1, 2), (0, 143), code=143, slots=("node-a", "node-b")), History(), "restart", None),
    # no records at all (srun failed to start the tasks): nobody to blame
    (attempt(code=1, slots=()), History(("node-b",)), "restart", None),
    # a hang naming task 1 blames its node; the hang must be of this attempt
    (attempt((0, 75), (1, 75), code=75, slots=("node-a", "node-b"), events=[hang(1, time=10.0)], started=5.0),
     History(("node-b",)), "isolate node-b", None),
    (attempt((0, 75), (1, 75), code=75, slots=("node-a", "node-b"), events=[hang(1, time=1.0)], started=5.0),
     History(("node-b",)), "restart", None),
])
def test_decide_with_the_schedulers_exit_code(ended, history, want, code):
    decision = decide(ended, history, Limits(restarts_left=1, isolate_after=2, isolation_is_restart=False))
    assert kind(decision) == want
    if code is not None:
        assert decision.code == code


def test_give_up_ends_with_the_schedulers_code():
    decision = decide(attempt((1, 1), code=137, slots=("a", "b")), History(), Limits(restarts_left=0,
                                                                                      isolation_is_restart=False))
    assert isinstance(decision, GiveUp) and decision.code == 137 and exit_status(-9) == 137


# ----------------------------------------------------------------------------- the same error twice

SIG = ("RuntimeError", "jaxtrain/fault/chaos.py:after_step", 3)


@pytest.mark.parametrize("ended, signature", [
    (attempt((1, 1), (0, 1), events=[error(0), error(1)]), SIG),           # the first failing process's error
    (attempt((0, 1), (1, 1), events=[error(1)]), None),                    # the first to fail logged none
    (attempt((1, 75), events=[error(1)]), None),                           # exit 75: a decision, not an error
    (attempt((1, -9), events=[error(1)]), None),                           # a signal
    (attempt((1, 1), events=[error(1, time=1.0)], started=2.0), None),     # an older attempt's
    (attempt((1, 1), events=[error(1, time=3.0)], started=2.0), SIG),
    (attempt((0, 0), events=[error(1)]), None),                            # nobody failed
])
def test_error_signature(ended, signature):
    assert error_signature(ended) == signature


@pytest.mark.parametrize("ended, history, limits, want, code", [
    # the same error twice, no progress in either attempt -> a deterministic failure: give up with 78
    (attempt((1, 1), (0, 1), events=[error()]), History((1,), SIG), LAUNCH, "give-up", 78),
    (attempt((1, 1), events=[error()], code=137, slots=("a", "b")), History(("b",), SIG),
     Limits(restarts_left=1, isolation_is_restart=False), "give-up", 78),
    # ... even with no restarts left, and before an isolation would
    (attempt((1, 1), events=[error()]), History((1,), SIG), Limits(restarts_left=0), "give-up", 78),
    (attempt((1, 1), events=[error()]), History((1,), SIG), ISOLATE_2, "give-up", 78),
    # a different error (type, place or step) -> restart
    (attempt((1, 1), events=[error(type="ValueError")]), History((1,), SIG), LAUNCH, "restart", None),
    (attempt((1, 1), events=[error(where="jaxtrain/trainer.py:_dispatch")]), History((1,), SIG), LAUNCH, "restart",
     None),
    (attempt((1, 1), events=[error(step=4)]), History((1,), SIG), LAUNCH, "restart", None),
    # the same error from another process first: its signature is the same, the slot does not matter
    (attempt((0, 1), events=[error(0)]), History((1,), SIG), LAUNCH, "give-up", 78),
    # progress: this attempt saved past its start, or the previous one did (History.signature None)
    (attempt((1, 1), events=[error()], progress=True), History((1,), SIG), LAUNCH, "restart", None),
    (attempt((1, 1), events=[error()]), History((1,), None), LAUNCH, "restart", None),
    # an exit 75 or a signal carries no signature, whatever the events say
    (attempt((1, 75), events=[error()]), History((1,), SIG), LAUNCH, "restart", None),
    (attempt((1, -9), events=[error()]), History((1,), SIG), LAUNCH, "restart", None),
    # a crash without a Python error (chaos.crash_process: os._exit(1)): no signature
    (attempt((1, 1)), History((1,), SIG), LAUNCH, "restart", None),
])
def test_decide_the_same_error_twice(ended, history, limits, want, code):
    decision = decide(ended, history, limits)
    assert kind(decision) == want
    if code is not None:
        assert decision.code == code
        assert decision.reason == f"{SAME_ERROR_TWICE}: RuntimeError at jaxtrain/fault/chaos.py:after_step, step 3"
    if want == "restart":
        assert decision.history.signature == (None if ended.progress else error_signature(ended))


def test_replayed_errors_give_up_on_the_second_in_a_row():
    e, other = attempt((1, 1), slots=(0, 1), events=[error()]), attempt((1, 1), slots=(0, 1), events=[error(step=5)])
    history, kinds = History(), []
    for n, ended in enumerate([e, other, e, attempt((1, 1), slots=(0, 1), events=[error()], progress=True), e, e]):
        decision = decide(ended, history, Limits(restarts_left=9 - n))
        kinds.append(kind(decision))
        if isinstance(decision, GiveUp):
            break
        history = decision.history
    assert kinds == ["restart", "restart", "restart", "restart", "restart", "give-up"]
    assert decision.code == 78


@pytest.mark.parametrize("events, previous, want", [
    ([], -1, (-1, -1)),
    ([], 40, (40, -1)),                                                      # no resume event: the previous stands
    ([{"kind": "resume", "restored_step": 20}, {"kind": "checkpoint_saved", "step": 30}], 40, (20, 30)),
    ([{"kind": "checkpoint_saved", "step": 2}, {"kind": "checkpoint_saved", "step": 4}], -1, (-1, 4)),
])
def test_attempt_steps(events, previous, want):
    assert attempt_steps(events, previous) == want


# ----------------------------------------------------------------------------- attempt after attempt

def replay(attempts: list[Attempt], max_restarts: int, isolate_after: int) -> list[str]:
    """Run the Supervisor's loop on paper: decide after each attempt, isolate when told (always possible)."""
    history, slots, kinds = History(), [0, 1, 2][:len(attempts[0].slots)], []
    for n, ended in enumerate(attempts):
        ended = Attempt(ended.exits, tuple(slots), ended.events, ended.started, ended.code)
        decision = decide(ended, history, Limits(restarts_left=max_restarts - n, isolate_after=isolate_after))
        kinds.append(kind(decision))
        if isinstance(decision, (Done, Stop, GiveUp)):
            break
        history = decision.history
        if isinstance(decision, Isolate):
            slots.remove(decision.slot)
    return kinds


@pytest.mark.parametrize("attempts, max_restarts, isolate_after, want", [
    # test_launch: a crash, then a clean run
    ([attempt((1, -9), slots=(0, 1)), attempt((0, 0), (1, 0), slots=(0, 1))], 1, 0, ["restart", "done"]),
    # test_launch: restarts are bounded: 75 three times with --max-restarts 2
    ([attempt((0, 75), slots=(0, 1))] * 3, 2, 0, ["restart", "restart", "give-up"]),
    # test_launch: a slot that crashes at every start is isolated after 2, the job then finishes
    ([attempt((1, 1)), attempt((1, 1)), attempt((0, 0), (1, 0))], 3, 2, ["restart", "isolate 1", "done"]),
    # test_launch: crash, 75 (no evidence), crash: never two in a row, nothing isolated
    ([attempt((1, 1), slots=(0, 1)), attempt((1, 75), slots=(0, 1)), attempt((1, 1), slots=(0, 1)),
      attempt((0, 0), (1, 0), slots=(0, 1))], 3, 2, ["restart", "restart", "restart", "done"]),
    # test_launch: slot 1 hangs at every attempt, named by the hang events: isolated after 2
    ([attempt((0, 75), (1, 75), slots=(0, 1), events=[hang(1)])] * 2 + [attempt((0, 0), slots=(0, 1))], 3, 2,
     ["restart", "isolate 1", "done"]),
    # ... but hang events that blame several processes blame nobody
    ([attempt((0, 75), (1, 75), slots=(0, 1), events=[hang(0, 1)])] * 3 + [attempt((0, 0), (1, 0), slots=(0, 1))],
     3, 2, ["restart", "restart", "restart", "done"]),
    # a user error in a later attempt still stops at once
    ([attempt((1, 1)), attempt((0, 2))], 3, 2, ["restart", "stop"]),
    # after an isolation, slot 2 runs as process 1: its failures count against slot 2, not slot 1
    ([attempt((1, 1)), attempt((1, 1)), attempt((1, 1)), attempt((1, 1))], 4, 2,
     ["restart", "isolate 1", "restart", "isolate 2"]),
])
def test_replayed_attempts(attempts, max_restarts, isolate_after, want):
    assert replay(attempts, max_restarts, isolate_after) == want


# ----------------------------------------------------------------------------- `jaxtrain recovery`

TRAIN = ["--", "train", "--config", TINY, "data.global_batch_size=8", "--cpu-devices", "2"]


def recovery(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["recovery", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def job(tmp_path):
    """A SLURM job's state folder and run directory; `ended(rc, *lines)` writes an attempt's exits file
    and returns the `decide` options for it."""
    state, run = tmp_path / "state", tmp_path / "run"
    state.mkdir()
    run.mkdir()
    attempts = []

    def ended(rc: int, *lines: str, started: float = 0.0, nodes: int = 2, tasks: int = 2, **limits: int) -> list[str]:
        n = len(attempts)
        attempts.append(n)
        exits = state / f"exits.{n}"
        exits.write_text("".join(f"{line}\n" for line in lines))
        options = {"isolate-after": 2, "step-restarts": 2, "max-requeues": 1, **limits}
        return ["decide", "--state", str(state), "--attempt", str(n), "--attempt-started", str(started),
                "--exit-code", str(rc), "--exits", str(exits), "--nodes", str(nodes), "--tasks", str(tasks),
                *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()],
                *TRAIN, f"run.output_dir={run}"]

    ended.state, ended.run = state, run
    return ended


def test_decide_isolates_a_node_that_crashed_first_twice(capsys, job):
    code, out, err = recovery(capsys, *job(137, "2.0 0 node-a 137", "1.0 1 node-b 1"))
    assert (code, out) == (0, "restart\n")
    assert err == ("jaxtrain: attempt 0 ended with exit 137; first failure: task 1 on node node-b (exit 1; "
                   "1 attempt(s) in a row)\n"
                   "jaxtrain: restarting the step inside the allocation (step restart 1 of 2)\n")
    code, out, err = recovery(capsys, *job(137, "1.0 1 node-b 1", "2.0 0 node-a 137", step_restarts_done=1))
    assert (code, out) == (0, "isolate node-b mesh.data=-1 train.grad_accum=2\n")
    assert "(exit 1; 2 attempt(s) in a row)" in err
    assert "isolating node node-b: continuing on 1 node(s) with mesh.data=-1 train.grad_accum=2" in err
    assert (job.state / "failed_nodes").read_text() == "node-b\nnode-b\n"


@pytest.mark.parametrize("hang_time, want, line", [
    (None, "requeue", "task 0 on node node-a (exit 75; 0 attempt(s) in a row)"),           # a plain 75
    (50.0, "requeue", "task 0 on node node-a (exit 75; 0 attempt(s) in a row)"),           # an older hang
    (150.0, "requeue", "task 1 on node node-b (exit 75, blamed by the run's events; 1 attempt(s) in a row)"),
])
def test_decide_blames_an_exit_75_only_on_this_attempts_events(capsys, job, hang_time, want, line):
    if hang_time is not None:
        (job.run / "events.jsonl").write_text(json.dumps(hang(1, time=hang_time)) + "\n")
    code, out, err = recovery(capsys, *job(75, "101.0 0 node-a 75", "102.0 1 node-b 75", started=100.0,
                                           step_restarts_done=2))
    assert (code, out) == (0, f"{want}\n") and line in err
    assert "requeueing (requeue 1 of 1)" in err
    assert (job.state / "failed_nodes").read_text() == ("node-b\n" if hang_time == 150.0 else "-\n")


@pytest.mark.parametrize("rc, lines, limits, want, said", [
    (0, ["1.0 0 node-a 0", "1.0 1 node-b 0"], {}, "done", "jaxtrain: done\n"),
    (2, ["1.0 0 node-a 2"], {}, "stop", "jaxtrain: user error (exit 2), not restarted\n"),
    (1, [], {"step_restarts_done": 2, "requeues_done": 1}, "give-up", "exit 1 and no restarts or requeues left"),
    (1, ["1.0 1 node-b 1"], {"time_left_s": 60, "min_time_left_s": 600}, "requeue", "requeueing (requeue 1 of 1)"),
])
def test_decide_done_stop_requeue_give_up(capsys, job, rc, lines, limits, want, said):
    code, out, err = recovery(capsys, *job(rc, *lines, **limits))
    assert (code, out) == (0, f"{want}\n") and said in err
    assert (job.state / "failed_nodes").exists() == (want not in ("done", "stop"))


def test_decide_stops_with_78_when_a_human_is_needed(capsys, job):
    # A task's 78 (the rollback budget is spent) with its peer SIGKILLed by the wrapper: srun says 137.
    code, out, err = recovery(capsys, *job(137, "1.0 0 node-a 78", "2.0 1 node-b 137"))
    assert (code, out) == (0, "stop 78\n") and "a human is needed (exit 78), not restarted" in err
    assert not (job.state / "failed_nodes").exists()


def events_line(kind: str, step: int, time: float, **details) -> str:
    return json.dumps({"time": time, "step": step, "kind": kind, **details}) + "\n"


@pytest.mark.parametrize("events, limits, want, said", [
    # the time limit's SIGTERM: resumed from 20, saved an emergency checkpoint at 37, exit 75; MAX_REQUEUES=0
    ([("resume", 20, {"restored_step": 20}), ("checkpoint_saved", 37, {}), ("preempted", 37, {})],
     {"time_left_s": 60, "min_time_left_s": 600, "requeues_done": 1}, "requeue free",
     "requeueing (not counted: the attempt saved step 37, past the step 20 it resumed from; 1 of 1 requeues "
     "counted)"),
    # step restarts spent, but the attempt saved past its start: one more, not counted
    ([("resume", 20, {"restored_step": 20}), ("checkpoint_saved", 30, {})], {"step_restarts_done": 2},
     "restart free", "(not counted: the attempt saved step 30, past the step 20 it resumed from; 2 of 2 step"),
    # a crash loop a few steps after the same checkpoint: logs new steps, saves nothing -> counted
    ([("resume", 20, {"restored_step": 20}), ("checkpoint_skipped", 25, {})], {"time_left_s": 60,
     "min_time_left_s": 600}, "requeue", "requeueing (requeue 1 of 1)"),
    ([("resume", 20, {"restored_step": 20}), ("checkpoint_saved", 20, {})], {"step_restarts_done": 2,
     "max_requeues": 0}, "give-up", "no restarts or requeues left"),
])
def test_decide_counts_only_attempts_that_made_no_progress(capsys, job, events, limits, want, said):
    (job.run / "events.jsonl").write_text(
        events_line("checkpoint_saved", 50, 10.0)  # older than the attempt: not its progress
        + "".join(events_line(kind, step, 101.0 + i, **details) for i, (kind, step, details) in enumerate(events)))
    code, out, err = recovery(capsys, *job(75, "110.0 0 node-a 75", "110.0 1 node-b 75", started=100.0, **limits))
    assert (code, out) == (0, f"{want}\n") and said in err, err
    restored, saved = events[0][1], max([s for k, s, _ in events if k == "checkpoint_saved"], default=-1)
    assert (job.state / "progress").read_text() == f"0 {restored} {saved}\n"


def test_decide_without_a_resume_event_compares_with_the_previous_attempt(capsys, job):
    (job.state / "progress").write_text("0 -1 40\n")  # attempt 0 saved step 40
    (job.run / "events.jsonl").write_text(events_line("checkpoint_saved", 40, 150.0))  # attempt 1: 40 again
    code, out, err = recovery(capsys, *job(1, "160.0 1 node-b 1", started=100.0, step_restarts_done=2))
    assert (code, out) == (0, "requeue\n") and "requeueing (requeue 1 of 1)" in err
    assert (job.state / "progress").read_text().splitlines()[-1] == "0 40 40"


def test_decide_stops_with_78_on_the_same_error_twice_without_progress(capsys, job):
    """Two calls, as train.sbatch makes them after two attempts: the state folder keeps the first
    attempt's error signature, the second attempt's same error is a deterministic failure."""
    def attempt_with_error(n: int, **details) -> list[str]:
        with open(job.run / "events.jsonl", "a") as f:
            f.write(events_line("error", 3, 100.0 * n + 50, **{"process": 1, "type": "RuntimeError",
                                                                  "where": "jaxtrain/fault/chaos.py:after_step",
                                                                  "message": "boom", **details}))
        return job(137, f"{100.0 * n + 51} 1 node-b 1", f"{100.0 * n + 52} 0 node-a 137", started=100.0 * n,
                   isolate_after=0)

    code, out, err = recovery(capsys, *attempt_with_error(1))
    assert (code, out) == (0, "restart\n"), err
    assert json.loads((job.state / "last_error").read_text()) == ["RuntimeError", "jaxtrain/fault/chaos.py:after_step",
                                                                   3]
    code, out, err = recovery(capsys, *attempt_with_error(2))
    assert (code, out) == (0, "stop 78\n"), err
    assert ("the same error twice without progress: RuntimeError at jaxtrain/fault/chaos.py:after_step, step 3: "
            "a human is needed (exit 78), not restarted") in err
    # a different error next (another place): a restart; the latest signature is kept
    code, out, err = recovery(capsys, *attempt_with_error(3, where="jaxtrain/trainer.py:_dispatch"))
    assert (code, out) == (0, "restart\n"), err
    assert json.loads((job.state / "last_error").read_text())[1] == "jaxtrain/trainer.py:_dispatch"
    # an exit 75 in between resets it
    code, out, err = recovery(capsys, *job(75, "401.0 0 node-a 75", started=400.0, isolate_after=0))
    assert (code, out) == (0, "restart\n"), err
    assert (job.state / "last_error").read_text() == "-"
    code, out, err = recovery(capsys, *attempt_with_error(5, where="jaxtrain/trainer.py:_dispatch"))
    assert (code, out) == (0, "restart\n"), err


def test_decide_does_not_stop_when_the_attempt_made_progress(capsys, job):
    (job.state / "last_error").write_text(json.dumps(["RuntimeError", "jaxtrain/fault/chaos.py:after_step", 3]))
    (job.run / "events.jsonl").write_text(
        events_line("checkpoint_saved", 2, 101.0)
        + events_line("error", 3, 102.0, process=1, type="RuntimeError", where="jaxtrain/fault/chaos.py:after_step"))
    code, out, err = recovery(capsys, *job(1, "103.0 1 node-b 1", started=100.0, isolate_after=0))
    assert (code, out) == (0, "restart free\n"), err
    assert (job.state / "last_error").read_text() == "-"


def test_decide_cannot_leave_a_node_out_of_one_node_or_without_a_smaller_job(capsys, job):
    (job.state / "failed_nodes").write_text("node-a\n")
    code, out, err = recovery(capsys, *job(1, "1.0 1 node-a 1", nodes=1))
    assert (code, out) == (0, "restart\n")
    assert "node node-a failed 2 attempts in a row, but it cannot be left out here (1 node(s), 2 task(s) per node)" in err
    (job.state / "failed_nodes").write_text("node-b\n")
    code, out, err = recovery(capsys, *job(1, "1.0 1 node-b 1"), "data.global_batch_size=7")
    assert (code, out) == (0, "restart\n")
    assert "node node-b failed 2 attempts in a row, but the run cannot continue without it (no train.grad_accum" in err


def test_shrink_and_blame(capsys, tmp_path):
    assert recovery(capsys, "shrink", "--num-processes", "2", *TRAIN) == (0, "mesh.data=-1 train.grad_accum=2\n", "")
    # 3 nodes x 8 devices, FSDP inside a node -> 2 nodes: data 3 -> 2, FSDP kept, more accumulation
    assert recovery(capsys, "shrink", "--num-processes", "3", "--devices-per-process", "8", *TRAIN[:-2],
                    "mesh.data=3", "mesh.fsdp=8", "data.global_batch_size=48") == (0, "mesh.data=-1 train.grad_accum=3\n", "")
    code, out, err = recovery(capsys, "shrink", "--num-processes", "2", *TRAIN, "mesh.tensor=4")
    assert (code, out) == (1, "") and err.startswith("jaxtrain recovery: no smaller job: ")
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps(hang(1, time=10.0)) + "\n")
    assert recovery(capsys, "blame", "--since", "5", *TRAIN, f"run.output_dir={run}") == (0, "1\n", "")
    code, out, err = recovery(capsys, "blame", "--since", "20", *TRAIN, f"run.output_dir={run}")
    assert (code, out) == (1, "") and "blame no single process" in err


@pytest.mark.parametrize("argv, message", [
    ([], "expected `jaxtrain recovery decide|shrink|blame"),
    (["resize"], "unknown `jaxtrain recovery` verb 'resize'"),
    (["shrink", "--num-processes", "2"], "expected `jaxtrain recovery shrink [options] -- train"),
    (["shrink", "--num-processes", "2", "--", "train", "--config", TINY], "devices of each process"),
    (["shrink", "--num-processes", "0", *TRAIN], "--num-processes must be at least 1"),
    (["shrink", "--num-processes", "two", *TRAIN], "--num-processes"),
    (["blame", *TRAIN, "train.stepz=3"], "train.stepz"),
    (["decide", "--state", "missing-state", "--attempt", "0", "--attempt-started", "0", "--exit-code", "1",
      "--exits", "missing", "--nodes", "2", "--tasks", "2", *TRAIN], "--state missing-state: no such folder"),
    (["decide", "--attempt", "0", *TRAIN], "the following arguments are required: --state"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = recovery(capsys, *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1, err


def test_decide_names_a_missing_exits_file(capsys, job):
    argv = job(1)
    argv[argv.index("--exits") + 1] = str(job.state / "exits.missing")
    code, _, err = recovery(capsys, *argv)
    assert code == 2 and "exits.missing: no such file" in err


def test_the_policy_and_the_recovery_verbs_never_import_jax(tmp_path):
    code = ("import sys, jaxtrain.commands.cli, jaxtrain.commands.recovery, jaxtrain.commands.train_command, "
            "jaxtrain.launch.policy, jaxtrain.launch.recovery_state, jaxtrain.launch.elastic, "
            "jaxtrain.launch.runfiles, jaxtrain.launch.supervisor, jaxtrain.parallel.mesh_shape\n"
            f"assert jaxtrain.commands.cli.main(['recovery', 'shrink', '--num-processes', '2', *{TRAIN!r}]) == 0\n"
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=tmp_path)


def test_the_mesh_arithmetic_is_one_implementation():
    from jaxtrain.launch import elastic
    from jaxtrain.parallel import mesh, mesh_shape
    assert mesh.resolve_mesh_shape is mesh_shape.resolve_mesh_shape is elastic.resolve_mesh_shape
    assert mesh.AXES is mesh_shape.AXES


def test_runfiles_skip_torn_lines(tmp_path):
    from jaxtrain.launch.runfiles import count_events, read_events
    (tmp_path / "events.jsonl").write_text('{"kind": "start"}\n[1]\n{"kind": "hang", "behind": [1]}\n{"kind": "ha')
    # Counted in events (runlog.read_log), the torn and non-object lines not; a bucket's run
    # directory is read too (tests/observe/test_remote_logs.py).
    assert count_events(tmp_path) == 2 and count_events(None) == 0
    assert [e["kind"] for e in read_events(tmp_path)] == ["start", "hang"]
    assert read_events(tmp_path, since_line=1) == [{"kind": "hang", "behind": [1]}]
