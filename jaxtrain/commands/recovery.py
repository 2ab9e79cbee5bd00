"""`jaxtrain recovery`: the recovery policy as small verbs for scheduler scripts (train.sbatch).

The verbs' parsers, their `main` and their printing; the state folder's files are
`launch/recovery_state.py`, the decisions `launch/policy.py`.

A scheduler script collects the facts of an attempt (exit codes, node names, time left) and
applies what these verbs decide; it re-implements none of the policy (`policy.py`):

    jaxtrain recovery decide --state DIR --attempt N --attempt-started T --exit-code RC --exits FILE
        --nodes N --tasks N [--devices-per-process N] [--isolate-after K]
        [--step-restarts-done n --step-restarts M] [--time-left-s S --min-time-left-s S]
        [--requeues-done n --max-requeues M] -- train --config PATH [key=value ...]
      prints one line, the decision: `done`, `stop` (user error: exit 2), `stop 78` (a human is needed),
      `restart [free]` (the step, inside the allocation), `requeue [free]`, `isolate NODE OVERRIDE...`
      (leave NODE out, append the overrides) or `give-up`; `stop 78` also when the same Python error
      ended two attempts in a row that made no progress (a deterministic failure, `policy.decide`);
      `free`: the attempt made progress (it saved
      a checkpoint past the one it resumed from, `policy.made_progress`), so the restart or requeue
      is not counted against --step-restarts / --max-requeues (the script does not count it). Says
      why on stderr (`jaxtrain: ...` lines); keeps the failure history in DIR/failed_nodes (one line
      per failed attempt: the node it counted against, `-` for nobody), the latest failed attempt's
      error signature in DIR/last_error (JSON `[type, where, step]`, or `-`), and each attempt's
      `<attempt> <restored step> <saved step>` in DIR/progress.
      FILE has one `<time> <task> <node> <exit code>` line per task (train.sbatch's task wrapper).
    jaxtrain recovery shrink --num-processes P [--devices-per-process N] -- train ...
      prints the overrides that continue the run on one process fewer (exit 1 and the reason when
      no smaller job trains the same run; `elastic.plan_shrink`).
    jaxtrain recovery blame [--since T] -- train ...
      prints the process that the run's events since UNIX time T blame for an exit 75 (exit 1 when
      they blame no single process; `policy.blamed_process`).

Errors a user can cause (bad options, a missing file, a bad config) print one line on stderr and
exit 2. No JAX: the config is only parsed.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

from jaxtrain.commands.arguments import Parser, parse
from jaxtrain.commands.train_command import TrainCommand, child_command, split_train_argv
from jaxtrain.config import ConfigError
from jaxtrain.runtime.exit_codes import EXIT_HUMAN, EXIT_OK, EXIT_USAGE
from jaxtrain.launch.elastic import Shrink, ShrinkRefused, shrink_planner
from jaxtrain.launch.policy import (Attempt, Done, Failure, GiveUp, Isolate, Limits, Restart, Stop, blamed_process,
                                    decide, made_progress, slurm_restart)
from jaxtrain.launch.recovery_state import attempt_progress, read_exits, read_history, record_failure
from jaxtrain.launch.runfiles import read_events

EXIT_NO = 1  # shrink/blame: a valid question whose answer is "none"


# ----------------------------------------------------------------------------- shrink and blame


def print_shrink(planner: Callable[[int, list[str]], Shrink] | None, num_processes: int, prog: str) -> int:
    """Print the overrides of the job one process smaller. Returns 0, or 1 (reason on stderr) when none."""
    if planner is None:
        raise ConfigError("the devices of each process are needed to shrink the mesh: give --devices-per-process N "
                          "or --cpu-devices N to `train`")
    try:
        print(" ".join(planner(num_processes, []).overrides))
    except ShrinkRefused as e:
        print(f"{prog}: no smaller job: {e}", file=sys.stderr)
        return EXIT_NO
    return EXIT_OK


def print_blame(output_dir: str | None, since: float, prog: str) -> int:
    """Print the process the run's events since UNIX time `since` blame. Returns 0, or 1 when nobody."""
    blamed = blamed_process(read_events(output_dir), since)
    if blamed is None:
        print(f"{prog}: the run's events blame no single process", file=sys.stderr)
        return EXIT_NO
    print(blamed)
    return EXIT_OK


# ----------------------------------------------------------------------------- the verbs


def _train(train_argv: list[str], verb: str) -> TrainCommand:
    if not train_argv:
        raise ConfigError(f"expected `jaxtrain recovery {verb} [options] -- train --config PATH [key=value ...]`")
    return child_command(train_argv, None, usage=f"jaxtrain recovery {verb} [options]")


def _at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value < minimum:
            parser.error(f"--{name} must be at least {minimum}, got {value}")


def _decide_parser() -> Parser:
    p = Parser(prog="jaxtrain recovery decide",
               description="After an attempt of a SLURM job ended: print what to do (done, stop, restart, requeue, "
                           "isolate NODE OVERRIDES..., give-up); say why on stderr.")
    p.add_argument("--state", required=True, metavar="DIR", help="the job's state folder (failure history)")
    p.add_argument("--attempt", type=int, required=True, metavar="N", help="the attempt that ended (for the log)")
    p.add_argument("--attempt-started", type=float, required=True, metavar="T",
                   help="UNIX time the attempt started: older events blame nobody")
    p.add_argument("--exit-code", type=int, required=True, metavar="RC", help="the step's exit code (srun's)")
    p.add_argument("--exits", required=True, metavar="FILE",
                   help="the attempt's `<time> <task> <node> <exit code>` lines, one per task")
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes of the step that ended")
    p.add_argument("--tasks", type=int, required=True, metavar="N", help="tasks (processes) of the step that ended")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="N",
                   help="devices of each task, for planning an isolation (default: --cpu-devices of `train`)")
    p.add_argument("--isolate-after", type=int, default=0, metavar="K",
                   help="leave out a node that K failed attempts in a row counted against (default 0: never)")
    p.add_argument("--step-restarts-done", type=int, default=0, metavar="N", help="step restarts so far")
    p.add_argument("--step-restarts", type=int, default=0, metavar="M", help="step restarts allowed")
    p.add_argument("--time-left-s", type=float, default=math.inf, metavar="S", help="time left in the allocation")
    p.add_argument("--min-time-left-s", type=float, default=0.0, metavar="S",
                   help="below this much time left, requeue instead of restarting the step")
    p.add_argument("--requeues-done", type=int, default=0, metavar="N", help="requeues so far (SLURM_RESTART_COUNT)")
    p.add_argument("--max-requeues", type=int, default=0, metavar="M", help="requeues allowed")
    return p


def _say(message: str) -> None:
    print(f"jaxtrain: {message}", file=sys.stderr, flush=True)


def _first_failure_line(attempt_no: int, rc: int, failure: Failure, streak: int) -> str:
    blamed = failure.blamed is not None
    task = failure.blamed if blamed else failure.process
    node = failure.suspect if blamed else failure.slot
    why = ", blamed by the run's events" if blamed else ""
    return (f"attempt {attempt_no} ended with exit {rc}; first failure: task {'?' if task is None else task} on node "
            f"{node or '?'} (exit {'?' if failure.code is None else failure.code}{why}; {streak} attempt(s) in a row)")


def _decide(argv: list[str]) -> int:
    own, train_argv = split_train_argv(argv)
    parser = _decide_parser()
    args = parse(parser, own)
    _at_least(parser, args, 1, "nodes", "tasks", "devices-per-process")
    _at_least(parser, args, 0, "attempt", "isolate-after", "step-restarts-done", "step-restarts", "requeues-done",
              "max-requeues")
    train = _train(train_argv, "decide")
    state, exits_file = Path(args.state), Path(args.exits)
    if not state.is_dir():
        raise ConfigError(f"--state {state}: no such folder")
    if not exits_file.is_file():
        raise ConfigError(f"--exits {exits_file}: no such file")
    exits, nodes = read_exits(exits_file, args.tasks)
    events = read_events(train.cfg.run.output_dir)
    own_events = [e for e in events if e.get("time", 0.0) >= args.attempt_started]
    restored, saved = attempt_progress(state, args.attempt, own_events)
    progress = made_progress(restored, saved)
    attempt = Attempt(exits=exits, slots=nodes, events=tuple(events),
                      started=args.attempt_started, code=args.exit_code, progress=progress)
    how = slurm_restart(args.step_restarts_done, args.step_restarts, args.time_left_s, args.min_time_left_s,
                        args.requeues_done, args.max_requeues, progress=progress)
    limits = Limits(restarts_left=1 if how else 0, isolate_after=args.isolate_after, isolation_is_restart=False)
    decision = decide(attempt, read_history(state), limits)

    if isinstance(decision, Done):
        _say("done")
        print("done")
        return EXIT_OK
    if isinstance(decision, Stop):
        what = "a human is needed" if decision.code == EXIT_HUMAN else "user error"
        _say(f"{what} (exit {decision.code}), not restarted")
        print("stop" if decision.code == EXIT_USAGE else f"stop {decision.code}")
        return EXIT_OK
    record_failure(state, decision.failure.suspect, decision.history.signature)
    _say(_first_failure_line(args.attempt, args.exit_code, decision.failure, decision.history.streak))
    if isinstance(decision, GiveUp) and decision.code == EXIT_HUMAN:  # the same deterministic failure twice
        _say(f"{decision.reason}: a human is needed (exit {EXIT_HUMAN}), not restarted")
        print(f"stop {EXIT_HUMAN}")
        return EXIT_OK
    if isinstance(decision, Isolate):
        node, streak = decision.slot, decision.history.streak
        per_node = args.tasks // args.nodes
        devices = args.devices_per_process if args.devices_per_process is not None else train.cpu_devices
        if args.nodes < 2 or per_node != 1:
            _say(f"node {node} failed {streak} attempts in a row, but it cannot be left out here "
                 f"({args.nodes} node(s), {per_node} task(s) per node)")
        else:
            try:
                if devices is None:
                    raise ShrinkRefused("the devices of each task are unknown: give --devices-per-process N "
                                        "or --cpu-devices N to `train`")
                plan = shrink_planner(train.config, train.overrides, devices)(args.tasks, [])
            except ShrinkRefused as e:
                _say(f"node {node} failed {streak} attempts in a row, but the run cannot continue without it ({e})")
            else:
                overrides = " ".join(plan.overrides)
                _say(f"isolating node {node}: continuing on {args.nodes - 1} node(s) with {overrides}")
                print(f"isolate {node} {overrides}")
                return EXIT_OK
        decision = decision.fallback
    start = f"the step {restored} it resumed from" if restored >= 0 else "its fresh start"
    free = f"not counted: the attempt saved step {saved}, past {start}" if progress else ""
    if isinstance(decision, Restart) and how == "restart":
        if progress:
            _say(f"restarting the step inside the allocation ({free}; {args.step_restarts_done} of "
                 f"{args.step_restarts} step restarts counted)")
            print("restart free")
        else:
            _say(f"restarting the step inside the allocation (step restart {args.step_restarts_done + 1} of "
                 f"{args.step_restarts})")
            print("restart")
    elif isinstance(decision, Restart):
        if progress:
            _say(f"requeueing ({free}; {args.requeues_done} of {args.max_requeues} requeues counted)")
            print("requeue free")
        else:
            _say(f"requeueing (requeue {args.requeues_done + 1} of {args.max_requeues})")
            print("requeue")
    else:
        assert isinstance(decision, GiveUp)
        _say(f"exit {args.exit_code} and no restarts or requeues left")
        print("give-up")
    return EXIT_OK


def _shrink(argv: list[str]) -> int:
    own, train_argv = split_train_argv(argv)
    p = Parser(prog="jaxtrain recovery shrink",
               description="Print the overrides that continue the run on one process fewer (same global batch).")
    p.add_argument("--num-processes", type=int, required=True, metavar="P", help="processes in the job now")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="N",
                   help="devices each process drives (default: --cpu-devices of `train`)")
    args = parse(p, own)
    _at_least(p, args, 1, "num-processes", "devices-per-process")
    train = _train(train_argv, "shrink")
    devices = args.devices_per_process if args.devices_per_process is not None else train.cpu_devices
    planner = shrink_planner(train.config, train.overrides, devices) if devices is not None else None
    return print_shrink(planner, args.num_processes, "jaxtrain recovery")


def _blame(argv: list[str]) -> int:
    own, train_argv = split_train_argv(argv)
    p = Parser(prog="jaxtrain recovery blame",
               description="Print the process that the run's events blame for an exit 75 (the one a hang event's "
                           "verdict blames: stale heartbeat, or furthest behind through the step; a failed "
                           "preflight's slow one).")
    p.add_argument("--since", type=float, default=0.0, metavar="T",
                   help="only events logged at UNIX time T or later (default: all)")
    args = parse(p, own)
    train = _train(train_argv, "blame")
    return print_blame(train.cfg.run.output_dir, args.since, "jaxtrain recovery")


VERBS = {"decide": _decide, "shrink": _shrink, "blame": _blame}
USAGE = """usage: jaxtrain recovery VERB [options] -- train --config PATH [key=value ...]  (VERB --help for its options)
verbs:
  decide   after a SLURM step ended: print done, stop, restart, requeue, isolate NODE OVERRIDES... or give-up
  shrink   print the overrides that continue the run on one process fewer (exit 1: none)
  blame    print the process the run's events blame for an exit 75 (exit 1: nobody)"""


def main(argv: list[str]) -> int:
    """`jaxtrain recovery decide|shrink|blame [options] -- train --config PATH [key=value ...]`.

    Returns:
      0 (a decision, the overrides or the process printed); shrink and blame: 1 when there is none.
    Raises:
      ConfigError: bad options, files or config (the CLI prints it and exits 2).
    """
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return EXIT_OK
    if not argv:
        raise ConfigError(f"expected `jaxtrain recovery {'|'.join(VERBS)} [options] -- train ...` "
                          "(jaxtrain recovery --help)")
    verb = VERBS.get(argv[0])
    if verb is None:
        raise ConfigError(f"unknown `jaxtrain recovery` verb '{argv[0]}'; verbs: {', '.join(VERBS)}")
    try:
        return verb(argv[1:])
    except SystemExit as e:  # --help
        return int(e.code or 0)
