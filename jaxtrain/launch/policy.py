"""The recovery policy: what to do once an attempt of a job has ended. Pure functions, no I/O.

One attempt in (how each process exited and in which order, the events the run logged meanwhile),
plus the failure history and the limits; one decision out:

    decide(attempt, history, limits) -> Done | Stop | Restart | Isolate | GiveUp

The rules (exit codes as in DESIGN §4):
- every process exited 0 -> Done;
- a user error (exit 2) -> Stop: it would fail the same way again, so it is never restarted;
- "stop, a human is needed" (exit 78: the rollback budget is spent) -> Stop with 78, for the same
  reason: a restart would hit the same wall;
- the same deterministic failure twice -> GiveUp with 78: two attempts in a row that made no
  progress (`Attempt.progress`) and whose first failing process ended with the same Python error
  (`error_signature`: its `error` event's exception type, innermost jaxtrain frame and step) would
  only fail a third time. A different error, an attempt without one (exit 75, a signal, a crash
  without a Python exception) or an attempt that made progress resets it;
- anything else (75 "restart me", another code, a signal) -> Restart while restarts are left, else
  GiveUp with the failure's exit code;
- blame (`blame`): the first process to exit non-zero is the failure. A crash counts against the
  slot it ran in. Exit 75 is a decision the process took (preempted, rollback budget spent, a hang),
  not evidence against its node, so it blames nobody, unless the attempt's own events blame exactly
  one process (`blamed_process`: a `hang` event's `behind`, a `preflight_failed` event's `named`;
  events older than the attempt are ignored), whose slot it then counts against;
- the streak (`History.streak`): how many failed attempts in a row blamed the same slot. An attempt
  that blames nobody, or another slot, breaks it. When it reaches `Limits.isolate_after` the
  decision is Isolate that slot: continue without it (the caller plans the smaller job, see
  `elastic.plan_shrink`, and applies `Isolate.fallback` when there is none).

Budgets under SLURM (`slurm_restart`) count only attempts that made no progress (`made_progress`:
no checkpoint saved past the one the attempt resumed from), so routine interruptions (time limits,
preemptions, which save an emergency checkpoint) never spend them.

A slot is where a process runs: a `jaxtrain launch` slot number (kept when another slot is
isolated), or a node name under SLURM. Used by the Supervisor (`supervisor.py`) and by
`jaxtrain recovery decide` (`commands/recovery.py`), which train.sbatch calls, so no shell script
re-implements any of this.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Mapping, Sequence, Union

from jaxtrain.runtime.exit_codes import EXIT_HUMAN, EXIT_OK, EXIT_RESTART, EXIT_USAGE

Slot = Union[int, str]  # a `jaxtrain launch` slot number, or a node name (SLURM)
Signature = tuple[str, str, int]  # a Python error: (exception type, innermost jaxtrain frame "file:function", step)


# ----------------------------------------------------------------------------- what happened


@dataclasses.dataclass(frozen=True)
class Exit:
    """How one process of an attempt ended.

    Attributes:
      process: its index in the attempt (JAXTRAIN_PROCESS_ID, SLURM_PROCID).
      code: its exit code; negative: killed by that signal (subprocess.Popen's convention).
    """

    process: int
    code: int


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of the job, as the launcher saw it end.

    Attributes:
      exits: the processes that had exited when the job was stopped, in the order they exited
        (the first is the cause: a crash makes its peers fail too, in a broken collective).
      slots: the slot of process i at index i; None (or past the end): not known.
      events: the run's events logged during this attempt, oldest first (events.jsonl lines).
      started: UNIX time the attempt started; events logged before it blame nobody (0: no filter).
      code: the job's exit code when a scheduler reports one for the whole job (srun's): it alone
        says done (0) or user error (2). None: judged from `exits`.
      progress: it moved the run forward (`made_progress`); then its error, if any, never counts
        as a repeat of the previous attempt's, nor the next attempt's as a repeat of its own.
    """

    exits: tuple[Exit, ...]
    slots: tuple[Slot | None, ...] = ()
    events: tuple[Mapping, ...] = ()
    started: float = 0.0
    code: int | None = None
    progress: bool = False

    def slot_of(self, process: int | None) -> Slot | None:
        """The slot process `process` ran in (None: unknown)."""
        if not isinstance(process, int) or not 0 <= process < len(self.slots):
            return None
        return self.slots[process]


@dataclasses.dataclass(frozen=True)
class Failure:
    """Who failed first in an attempt, and whom that counts against.

    Attributes:
      process: the first process to exit non-zero (None: none is known, e.g. no exit was recorded).
      code: its exit code (negative: a signal; None: unknown).
      slot: the slot it ran in (None: unknown).
      blamed: after an exit 75, the process the attempt's events blame (None: none, or not a 75).
      suspect: the slot the failure counts against: the first failure's own for a crash, the blamed
        process's for an exit 75; None: nobody is to blame (the streak breaks).
    """

    process: int | None
    code: int | None
    slot: Slot | None
    blamed: int | None
    suspect: Slot | None


@dataclasses.dataclass(frozen=True)
class History:
    """The slots that failed attempts counted against, oldest first (None: that attempt blamed nobody),
    and the latest failed attempt's error signature.

    Under `jaxtrain launch` it lives in the Supervisor; under SLURM in the job's state folder
    (`failed_nodes`, one line per failed attempt, `-` for nobody; `last_error`), so it survives a requeue.

    Attributes:
      suspects: as above.
      signature: the latest failed attempt's `error_signature` when it made no progress (None: it
        ended without a Python error of its first failing process, or it made progress).
    """

    suspects: tuple[Slot | None, ...] = ()
    signature: Signature | None = None

    def after(self, suspect: Slot | None, signature: Signature | None = None) -> History:
        """The history once one more failed attempt counted against `suspect`, ending with `signature`
        (its error signature when it made no progress, else None)."""
        return History((*self.suspects, suspect), signature)

    @property
    def streak(self) -> int:
        """How many of the latest failed attempts in a row counted against the same slot (0: the
        latest blamed nobody)."""
        if not self.suspects or self.suspects[-1] is None:
            return 0
        last, count = self.suspects[-1], 0
        for suspect in reversed(self.suspects):
            if suspect != last:
                break
            count += 1
        return count


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the launcher may still do.

    Attributes:
      restarts_left: restarts that may follow this attempt (0: this failure is the last).
      isolate_after: K > 0: a slot that K failed attempts in a row counted against is isolated (0: never).
      isolation_is_restart: True (`jaxtrain launch`): continuing without a slot is one of the
        restarts (it needs one left), and when no smaller job exists the launcher gives up with the
        failure. False (train.sbatch): leaving a node out costs no step restart or requeue, and when
        it cannot be done the failure is handled as any other (restart while restarts are left).
    """

    restarts_left: int
    isolate_after: int = 0
    isolation_is_restart: bool = True


# ----------------------------------------------------------------------------- decisions


@dataclasses.dataclass(frozen=True)
class Done:
    """Every process exited 0: the job is over."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """A user error (exit 2) or "a human is needed" (exit 78): stop, never restart.

    Attributes:
      process: the first process that exited with `code` (None: only the scheduler's code said so).
      code: the exit code to end with (2 or 78).
    """

    process: int | None
    code: int = EXIT_USAGE


@dataclasses.dataclass(frozen=True)
class Restart:
    """Restart the whole job with the same processes.

    Attributes:
      failure: the failure being recovered from.
      history: the failure history including this attempt.
    """

    failure: Failure
    history: History


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """End the job with the failure's exit code.

    Attributes:
      failure: the failure that ends it.
      history: the failure history including this attempt.
      code: the exit code to end with (a signal as 128 + its number; 78 for the same failure twice).
      reason: "no restarts left", "no smaller job" (an isolation that could not be done), or for the
        same deterministic failure twice `SAME_ERROR_TWICE` followed by ": " and the error
        (`describe_signature`).
    """

    failure: Failure
    history: History
    code: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Isolate:
    """Continue without `slot`: the job restarts on the other slots, one process fewer.

    Attributes:
      slot: the slot to leave out (it was the suspect of `history.streak` attempts in a row).
      failure: the failure of this attempt.
      history: the failure history including this attempt (the isolated slot runs no process any
        more, so it can never be blamed again: its streak ends by itself).
      fallback: what to do instead when the slot cannot be left out (no smaller job trains the same
        run, or the scheduler cannot exclude it).
    """

    slot: Slot
    failure: Failure
    history: History
    fallback: Restart | GiveUp


Decision = Union[Done, Stop, Restart, Isolate, GiveUp]


# ----------------------------------------------------------------------------- the rules


def exit_status(code: int) -> int:
    """A Popen return code as a process exit status: a signal becomes 128 + its number."""
    return code if code >= 0 else 128 - code


def first_failure(exits: Sequence[Exit]) -> Exit | None:
    """The first process to exit non-zero (exits in the order they happened), or None."""
    return next((e for e in exits if e.code != EXIT_OK), None)


def blamed_process(events: Sequence[Mapping], since: float = 0.0) -> int | None:
    """The one process that the events blame for an exit 75, looking only at events logged at UNIX
    time `since` or later (an event without a time counts as logged at 0).

    The first event that blames anyone decides: a `hang` event names the processes furthest behind
    (`behind`), a failed preflight the slow ones (`named`); exactly one is evidence against its
    node. None when no event blames, or the deciding one blames several.
    """
    for event in events:
        if event.get("time", 0.0) < since:
            continue
        kind = event.get("kind")
        blamed = event.get("behind") if kind == "hang" else event.get("named") if kind == "preflight_failed" else None
        if blamed is not None:
            return blamed[0] if len(blamed) == 1 else None
    return None


def error_signature(attempt: Attempt) -> Signature | None:
    """The Python error the attempt's first failing process ended with: (type, where, step) of its
    `error` event (the one `jaxtrain train` writes when it fails with an exception), or None.

    None when no process failed, the first failure is an exit 75 (a decision, not an error) or a
    signal, or that process logged no `error` event during the attempt (events logged before
    `Attempt.started` are ignored, as for blame).
    """
    first = first_failure(attempt.exits)
    if first is None or first.code < 0 or first.code == EXIT_RESTART:
        return None
    for event in attempt.events:
        if event.get("kind") != "error" or event.get("process") != first.process:
            continue
        if event.get("time", 0.0) < attempt.started:
            continue
        step = event.get("step")
        return (str(event.get("type")), str(event.get("where")), step if isinstance(step, int) else -1)
    return None


SAME_ERROR_TWICE = "the same error twice without progress"


def describe_signature(signature: Signature) -> str:
    """'RuntimeError at jaxtrain/fault/chaos.py:after_step, step 3'."""
    kind, where, step = signature
    return f"{kind} at {where}, step {step}"


def blame(attempt: Attempt) -> Failure:
    """Who failed first in `attempt`, and which slot (if any) the failure counts against."""
    first = first_failure(attempt.exits)
    if first is None:
        return Failure(process=None, code=None, slot=None, blamed=None, suspect=None)
    slot = attempt.slot_of(first.process)
    if first.code != EXIT_RESTART:
        return Failure(process=first.process, code=first.code, slot=slot, blamed=None, suspect=slot)
    # A decision, not a crash: blame only whom the attempt's own events name.
    blamed = blamed_process(attempt.events, attempt.started)
    return Failure(process=first.process, code=first.code, slot=slot, blamed=blamed, suspect=attempt.slot_of(blamed))


def decide(attempt: Attempt, history: History, limits: Limits) -> Decision:
    """What to do after `attempt` ended (see the module docstring for the rules).

    Args:
      attempt: how it ended.
      history: the failure history before it.
      limits: restarts left and the isolation setting.
    Returns:
      Done, Stop, Restart, Isolate (with its fallback) or GiveUp; the last three carry the new history.
    """
    for stop_code in (EXIT_USAGE, EXIT_HUMAN):  # a user error anywhere wins over "a human is needed"
        # Either would only fail the same way again: never restarted, whatever the others did. A
        # scheduler's code for the whole job (srun's) decides for 2; a task's 78 counts even when srun
        # reports another code (the peers it left behind were killed, srun may report their 137).
        first = next((e for e in attempt.exits if e.code == stop_code), None)
        if attempt.code == stop_code or (first is not None and (attempt.code is None or stop_code == EXIT_HUMAN)):
            return Stop(process=first.process if first else None, code=stop_code)
    if attempt.code == EXIT_OK or (attempt.code is None and first_failure(attempt.exits) is None):
        return Done()
    failure = blame(attempt)
    signature = None if attempt.progress else error_signature(attempt)
    repeated = signature is not None and signature == history.signature
    history = history.after(failure.suspect, signature)
    if repeated:  # a deterministic failure: a restart (or an isolation) would only hit it again
        return GiveUp(failure, history, EXIT_HUMAN, f"{SAME_ERROR_TWICE}: {describe_signature(signature)}")
    code = exit_status(attempt.code if attempt.code is not None else failure.code)
    give_up = GiveUp(failure, history, code, "no restarts left")
    carry_on: Restart | GiveUp = Restart(failure, history) if limits.restarts_left > 0 else give_up
    if limits.isolation_is_restart and limits.restarts_left <= 0:
        return give_up
    if limits.isolate_after and failure.suspect is not None and history.streak >= limits.isolate_after:
        fallback = GiveUp(failure, history, code, "no smaller job") if limits.isolation_is_restart else carry_on
        return Isolate(failure.suspect, failure, history, fallback)
    return carry_on


def exit_after_signal(codes: Sequence[int | None], signum: int) -> int:
    """The launcher's exit code once it was told to stop (SIGTERM/SIGINT, forwarded to the processes).

    Args:
      codes: the processes' exit codes (Popen's: negative for a signal).
      signum: the signal the launcher got.
    Returns:
      0 when every process exited 0; 75 when one asked to be restarted (e.g. preempted after an
      emergency save: the scheduler should requeue); else 128 + signum.
    """
    if codes and all(c == EXIT_OK for c in codes):
        return EXIT_OK
    if EXIT_RESTART in codes:
        return EXIT_RESTART
    return 128 + signum


def attempt_steps(events: Sequence[Mapping], previous: int = -1) -> tuple[int, int]:
    """(the step an attempt resumed from, the latest step it saved a checkpoint at), from its own events.

    The resumed-from step is the attempt's `resume` event's `restored_step`; without one (it started
    fresh, or died before its first step) `previous` stands in: the latest step the attempts before
    it saved or resumed from (-1: none). The saved step is the latest `checkpoint_saved` (-1: none).
    """
    restored = next((int(e["restored_step"]) for e in events
                     if e.get("kind") == "resume" and isinstance(e.get("restored_step"), int)), previous)
    saved = max((int(e["step"]) for e in events
                 if e.get("kind") == "checkpoint_saved" and isinstance(e.get("step"), int)), default=-1)
    return restored, saved


def made_progress(restored_before: int, saved_after: int) -> bool:
    """Whether an attempt moved the run forward: it committed a checkpoint past the one it started from.

    Why checkpoints and not the last step logged: the next attempt resumes from the latest checkpoint,
    so a crash loop that always dies a few steps after the same checkpoint logs new steps every time
    and yet gets nowhere; an attempt that saved (an emergency checkpoint at the time limit, a
    preemption) did get somewhere, and costs no budget.

    Args:
      restored_before: the step the attempt resumed from (-1: it started fresh or it is unknown).
      saved_after: the latest step it saved a checkpoint at (-1, or <= restored_before: none).
    Returns:
      True when saved_after > restored_before.
    """
    return saved_after > restored_before


def slurm_restart(step_restarts_done: int, step_restarts: int, time_left_s: float, min_time_left_s: float,
                  requeues_done: int, max_requeues: int,
                  progress: bool = False) -> Literal["restart", "requeue"] | None:
    """How train.sbatch restarts a failed step: inside the allocation, by a requeue, or not at all.

    A step restart (same nodes, seconds) while `step_restarts` are not spent and at least
    `min_time_left_s` is left in the allocation (not after the time-limit SIGTERM, for one); then a
    requeue (a new allocation, through the queue) while `max_requeues` are not spent. The budgets
    count only attempts that made no progress (`made_progress`): with `progress`, a restart or a
    requeue is possible whatever was spent (the caller then does not count it), so routine
    interruptions (time limits, preemptions) never use up the budget that is meant for a job that
    keeps hitting the same wall. A budget of 0 still turns that kind of restart off.

    Returns:
      "restart", "requeue", or None (nothing left).
    """
    if step_restarts > 0 and (progress or step_restarts_done < step_restarts) and time_left_s >= min_time_left_s:
        return "restart"
    if max_requeues > 0 and (progress or requeues_done < max_requeues):
        return "requeue"
    return None
