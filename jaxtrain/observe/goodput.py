"""`jaxtrain goodput RUN_DIR [--json]`: where a run's wall time went.

Goodput is the share of wall time spent on training steps that count. The rest is broken down
into parts that add up to the wall time exactly (docs/goodput.md):

    productive_s         steps whose update was applied and kept, less their data wait
    startup_s            process start to the first step of each attempt: init, preflight, restore, compile
    checkpoint_s         training blocked by checkpoint saves (`checkpoint_saved.blocked_s`, and the
                         local tier's `local_checkpoint_saved.blocked_s`)
    restart_downtime_s   from a failed attempt's last measured step to the next attempt's process start
                         (detection, stopping the others, relaunch; lost unlogged steps; failed start-ups)
    hang_s               an attempt (the last one too) standing still until the watchdog fired (`hang.stalled_s`)
    redone_steps_s       steps computed again after a restore (the first, discarded computation)
    data_wait_s          steps waiting for their batch (`data_wait_s` of metrics lines)
    eval_s               evaluation (`eval_s` of metrics lines; its `eval_dispatch_s` part is taken out of step time)
    skipped_steps_s      steps whose update was not applied (non-finite or spike)
    other_s              what the files do not attribute: the last attempt's tail (final commit wait,
                         shutdown), evaluation without `eval_s`, estimation slack

Read from the run directory alone: `events.jsonl` (attempt boundaries, start-up, checkpoint
blocking, hangs, stragglers, restarts, isolations) and `metrics.jsonl` (per-step time, data wait,
skips); in a bucket, their segments (`jaxtrain.observe.runlog.read_log` reads every layout). No JAX
is imported.

How attempts are found: a launcher `restart` event begins one (its time is the relaunch), and
so does a `preflight`/`start` event after an attempt that already started (SLURM requeue, a rerun
by hand). An attempt's process start is the `restart` event, else `start.started_at`, else the
`resume` event's time less `restart_to_first_step_s`, else (estimated) its first event. Each
metrics line covers the steps since the line before it (or since the restore); for every step the
last computation in the file is the kept one, earlier ones were re-done.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from jaxtrain.storage import object_store
from jaxtrain.storage.paths import is_remote
from jaxtrain.config import ConfigError
from jaxtrain.observe.runlog import read_log

PARTS = ("productive_s", "startup_s", "checkpoint_s", "restart_downtime_s", "hang_s", "redone_steps_s",
         "data_wait_s", "eval_s", "skipped_steps_s", "other_s")
LABELS = {"productive_s": "productive training", "startup_s": "start-up and compile",
          "checkpoint_s": "checkpoint blocking", "restart_downtime_s": "restart downtime", "hang_s": "hangs",
          "redone_steps_s": "re-done steps", "data_wait_s": "data wait", "eval_s": "evaluation",
          "skipped_steps_s": "skipped steps", "other_s": "other (not attributed)"}


@dataclasses.dataclass
class Attempt:
    """One start of the job's processes, from its process start to the next one's (or the end)."""

    begin: float | None = None  # process start; None until resolved
    begin_source: str = ""
    end: float = 0.0
    events: list[dict] = dataclasses.field(default_factory=list)
    start: dict | None = None  # the `start` event (the loop begins right after it)
    resume: dict | None = None
    preflight: dict | None = None

    def resolve_begin(self) -> None:
        """The process start from what the attempt's own events say, if no `restart` event gave it."""
        if self.begin is not None:
            return
        if self.start is not None and isinstance(self.start.get("started_at"), (int, float)):
            self.begin, self.begin_source = float(self.start["started_at"]), "start.started_at"
        elif self.resume is not None and isinstance(self.resume.get("restart_to_first_step_s"), (int, float)):
            self.begin = float(self.resume["time"]) - float(self.resume["restart_to_first_step_s"])
            self.begin_source = "resume.restart_to_first_step_s"
        else:
            # Estimated: the first thing this attempt wrote (or the start event less the compile
            # time). Process start-up before that (JAX and distributed init, data, restore) is missed.
            first = min(float(e["time"]) for e in self.events)
            if self.start is not None:
                first = min(first, float(self.start["time"]) - float(self.start.get("compile_s") or 0.0))
            self.begin, self.begin_source = first, "estimated from the first event"


def split_attempts(events: list[dict]) -> list[Attempt]:
    """The run's attempts, in order (see the module docstring for the rules)."""
    attempts: list[Attempt] = []
    current: Attempt | None = None
    for e in events:
        kind = e.get("kind")
        if kind == "restart":
            current = Attempt(begin=float(e["time"]), begin_source="restart event")
            attempts.append(current)
            continue
        relaunched = current is not None and (
            (kind == "preflight" and (current.preflight is not None or current.start is not None))
            or (kind == "start" and current.start is not None))
        if current is None or relaunched:
            current = Attempt()
            attempts.append(current)
        current.events.append(e)
        if kind == "start":
            current.start = e
        elif kind == "resume" and current.resume is None:
            current.resume = e
        elif kind == "preflight" and current.preflight is None:
            current.preflight = e
    for a in attempts:
        a.resolve_begin()  # (an attempt without a `restart` event has at least one event)
    # Ends: each attempt lasts until the next one begins; estimates never run backwards.
    end = max(float(e["time"]) for e in events)
    for i, a in enumerate(attempts):
        if i and a.begin < attempts[i - 1].begin:
            a.begin = attempts[i - 1].begin
    for i, a in enumerate(attempts):
        a.end = attempts[i + 1].begin if i + 1 < len(attempts) else end
    return attempts


@dataclasses.dataclass
class StepEntry:
    """One computation of one step, as the metrics line covering it describes it."""

    step: int
    attempt: int
    time_s: float  # the line's mean step time
    data_wait_s: float
    skipped: float  # fraction of the line's steps whose update was not applied
    kept: bool = True  # False: the step was computed again later (after a restore)


def step_entries(metrics: list[dict], attempts: list[Attempt]) -> tuple[list[StepEntry], dict[int, float]]:
    """Expand metrics lines into one entry per computed step, each attributed to an attempt.

    A line covers the steps since the line before it in the same attempt, or since the attempt's
    restore point (its `start` step, or a rollback's target). Lines with a `time` field are placed in
    the attempt running at that time. Lines without one are placed by step order: a line whose step
    is not above the previous line's begins the next restore point in event order (exact when every
    attempt logs a step it re-does, as with train.log_every=1; otherwise an estimate).

    Returns:
      (entries in file order, evaluation seconds per attempt, the part of those spent queueing
      the evaluation (`eval_dispatch_s`: inside the step time of the line whose interval it fell in)).
    """
    # Restore points in event order: each attempt that ran steps starts from its `start` step, and
    # a rollback from its target step.
    points: list[tuple[int, int]] = []
    for i, a in enumerate(attempts):
        for e in a.events:
            if e is a.start and (a.resume is not None or int(e.get("step", 0)) == 0):
                points.append((int(e["step"]), i))
            elif e.get("kind") == "rollback":
                points.append((int(e.get("to_step", 0)), i))
    if not points:
        points = [(0, 0)]
    begins = [a.begin for a in attempts]
    entries: list[StepEntry] = []
    eval_s: dict[int, float] = defaultdict(float)
    eval_dispatch: dict[int, float] = defaultdict(float)
    pointer, (previous, attempt) = 0, points[0]
    last_skipped: float | None = None
    for line in metrics:
        try:
            step, step_time = int(line["step"]), float(line["step_time_s"])
        except (KeyError, TypeError, ValueError):
            continue
        timed = isinstance(line.get("time"), (int, float))
        placed = max(0, bisect.bisect_right(begins, float(line["time"])) - 1) if timed else attempt
        if placed != attempt or step <= previous:
            # A restore: the next restore point below this step (of the attempt the time names).
            pointer += 1
            while pointer < len(points) and (points[pointer][0] >= step or (timed and points[pointer][1] < placed)):
                pointer += 1  # an attempt that logged nothing, or a restore point past this line
            if pointer < len(points) and (not timed or points[pointer][1] == placed):
                previous, attempt = points[pointer]
            else:
                previous, attempt, pointer = step - 1, placed, pointer - 1  # unexplained: the line's own step only
            last_skipped = None
        n = step - previous
        total = line.get("skipped_steps")
        if isinstance(total, (int, float)) and last_skipped is not None:
            skipped = max(0.0, min(1.0, (float(total) - last_skipped) / n))
        else:
            skipped = 1.0 / n if line.get("skipped") else 0.0
        last_skipped = float(total) if isinstance(total, (int, float)) else None
        # data_wait_s is the logged step's own wait: each step of the interval is taken to wait as
        # long, unless the line carries the interval's sum.
        if isinstance(line.get("data_wait_interval_s"), (int, float)):
            wait = float(line["data_wait_interval_s"]) / n
        else:
            wait = float(line.get("data_wait_s") or 0.0)
        entries += [StepEntry(s, attempt, step_time, min(wait, step_time), skipped) for s in range(previous + 1, step + 1)]
        if isinstance(line.get("eval_s"), (int, float)):
            eval_s[attempt] += float(line["eval_s"])
            if isinstance(line.get("eval_dispatch_s"), (int, float)):
                eval_dispatch[attempt] += min(float(line["eval_dispatch_s"]), float(line["eval_s"]))
        previous = step
    latest: dict[int, StepEntry] = {}
    for entry in entries:
        if entry.step in latest:
            latest[entry.step].kept = False
        latest[entry.step] = entry
    return entries, eval_s, eval_dispatch


def _straggler_ratio(event: dict) -> float:
    """How many times slower than the median a `straggler` event says the process was (0: unknown).

    The detector writes `factor` (its busy time over the median's); step times or busy times are
    divided when only they are given.
    """
    if isinstance(event.get("factor"), (int, float)):
        return float(event["factor"])
    for mine, median in (("step_time_s", "median_step_time_s"), ("busy_s", "median_busy_s")):
        if isinstance(event.get(mine), (int, float)) and event.get(median):
            return float(event[mine]) / float(event[median])
    return 0.0


def goodput(run_dir: str | Path) -> dict[str, Any]:
    """The goodput report of a run directory (the JSON that `jaxtrain goodput --json` prints).

    Raises:
      ConfigError: no events.jsonl with timed events in `run_dir`.
    """
    run_dir = os.fspath(run_dir)
    if is_remote(run_dir):
        object_store.check_access(run_dir, key="RUN_DIR")  # a wrong bucket or no credentials: one line, exit 2
    events = [e for e in read_log(run_dir, "events.jsonl") if isinstance(e.get("time"), (int, float))]
    if not events:
        raise ConfigError(f"{run_dir}: no events.jsonl with events (is it a jaxtrain run directory?)")
    metrics = read_log(run_dir, "metrics.jsonl")
    attempts = split_attempts(events)
    entries, eval_by_attempt, dispatch_by_attempt = step_entries(metrics, attempts)
    parts = dict.fromkeys(PARTS, 0.0)
    notes: list[str] = []
    for i, a in enumerate(attempts):
        last = i == len(attempts) - 1
        window = max(0.0, a.end - a.begin)
        startup = min(window, max(0.0, float(a.start["time"]) - a.begin)) if a.start is not None else 0.0
        mine = [e for e in entries if e.attempt == i]
        measured = sum(e.time_s for e in mine)
        loop = min(measured, window - startup)
        blocked = sum(float(e.get("blocked_s") or 0.0) for e in a.events  # both tiers (local: checkpoint.local_every_steps)
                      if e.get("kind") in ("checkpoint_saved", "local_checkpoint_saved"))
        checkpoint = min(blocked, loop)
        # Queueing an evaluation (its first compile included) happens inside a step interval, so
        # it is in `step_time_s` too: taken out of the steps like checkpoint blocking, never booked
        # twice. The rest of eval_s (waiting for the result) is outside step time (Throughput.exclude).
        dispatched = min(dispatch_by_attempt.get(i, 0.0), loop - checkpoint)
        waited = max(0.0, eval_by_attempt.get(i, 0.0) - dispatch_by_attempt.get(i, 0.0))
        evaluation = dispatched + min(waited, window - startup - loop)
        rest = window - startup - loop - (evaluation - dispatched)
        parts["startup_s"] += startup
        parts["checkpoint_s"] += checkpoint
        parts["eval_s"] += evaluation
        # The steps' own time less the checkpoint blocking and evaluation inside it, shared out by
        # what each step was.
        factor = (loop - checkpoint - dispatched) / measured if measured > 0 else 0.0
        for e in mine:
            t = e.time_s * factor
            if not e.kept:
                parts["redone_steps_s"] += t
            else:
                parts["skipped_steps_s"] += t * e.skipped
                wait = e.data_wait_s * factor * (1.0 - e.skipped)
                parts["data_wait_s"] += wait
                parts["productive_s"] += t * (1.0 - e.skipped) - wait
        # A hang is a hang in any attempt, the last one included (a hung job that was never
        # restarted, or whose restart wrote nothing yet): the watchdog's stalled_s, before the rest.
        stalled = max((float(e.get("stalled_s") or 0.0) for e in a.events if e.get("kind") == "hang"), default=0.0)
        hang = min(stalled, rest)
        parts["hang_s"] += hang
        if last or any(e.get("kind") == "done" for e in a.events):
            # The tail after the last step (final commit wait, shutdown), or idle time before a rerun
            # of a finished run. An attempt that stopped for a restart (crash, preempted, hang) is downtime.
            parts["other_s"] += rest - hang
        else:
            parts["restart_downtime_s"] += rest - hang
        if a.begin_source.startswith("estimated"):
            notes.append(f"attempt {i}: process start {a.begin_source} (the `start` event has no `started_at`); "
                         "time before it is not in the wall time")
        if measured > window - startup + 1e-6:
            notes.append(f"attempt {i}: its metrics lines hold {measured:.2f} s of steps but the attempt lasted "
                         f"{window - startup:.2f} s after start-up; steps were scaled down (lines placed in the wrong "
                         "attempt: metrics lines without `time`)")
    evaluated = [m for m in metrics if "eval_loss" in m]
    if evaluated and not any("eval_s" in m for m in evaluated):
        notes.append("evaluation time is not in metrics.jsonl (`eval_s`): it is counted in other_s or restart_downtime_s")
    elif any("eval_s" in m and "eval_dispatch_s" not in m for m in evaluated):
        notes.append("metrics lines with `eval_s` but no `eval_dispatch_s`: the time spent queueing evaluations "
                     "(the first one's compile included) counts as step time and is cut from eval_s")

    wall = attempts[-1].end - attempts[0].begin
    kept = [e for e in entries if e.kept]
    stragglers: dict[str, dict] = {}
    for e in events:
        if e.get("kind") != "straggler":
            continue
        s = stragglers.setdefault(str(e.get("process")), {"host": e.get("host"), "reports": 0, "max_ratio": 0.0,
                                                         "first_step": e.get("step"), "last_step": e.get("step")})
        s["reports"] += 1
        s["last_step"] = e.get("step")
        s["max_ratio"] = max(s["max_ratio"], _straggler_ratio(e))
    hangs = [{k: e.get(k) for k in ("time", "step", "process", "host", "phase", "stalled_s")}
             for e in events if e.get("kind") == "hang"]
    isolations = [{k: e.get(k) for k in ("time", "step", "slot", "host", "processes", "overrides")}
                  for e in events if e.get("kind") == "isolate"]
    return {
        "run_dir": str(run_dir),
        "wall_s": wall,
        "goodput": parts["productive_s"] / wall if wall > 0 else 0.0,
        "parts": parts,
        "compile_s": sum(float(a.start.get("compile_s") or 0.0) for a in attempts if a.start is not None),
        "attempts": len(attempts),
        "restarts": len(attempts) - 1,
        "isolations": isolations,
        "steps": {"final": max((e.step for e in kept), default=0), "computed": len(entries),
                  "redone": len(entries) - len(kept), "skipped": round(sum(e.skipped for e in kept), 3)},
        "stragglers": stragglers,
        "hangs": hangs,
        "notes": notes,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as text: one line per part, then restarts, stragglers, hangs and notes."""
    wall, parts, steps = report["wall_s"], report["parts"], report["steps"]
    lines = [f"run {report['run_dir']}: {report['attempts']} attempt(s), {report['restarts']} restart(s), "
             f"{steps['final']} steps ({steps['computed']} computed)",
             f"{'wall time':<26}{wall:>11.1f} s  100.0%"]
    details = {"startup_s": f"compile {report['compile_s']:.1f} s", "redone_steps_s": f"{steps['redone']} step(s)",
               "skipped_steps_s": f"{steps['skipped']:g} step(s)",
               "restart_downtime_s": f"{report['restarts']} restart(s)", "hang_s": f"{len(report['hangs'])} hang report(s)"}
    for key in PARTS:
        share = 100.0 * parts[key] / wall if wall > 0 else 0.0
        extra = f"   ({details[key]})" if key in details and parts[key] > 0 else ""
        lines.append(f"  {LABELS[key]:<24}{parts[key]:>11.1f} s {share:>6.1f}%{extra}")
    lines.append(f"goodput {100.0 * report['goodput']:.1f}%")
    for iso in report["isolations"]:
        lines.append(f"isolated: slot {iso['slot']} on {iso['host']} at step {iso['step']}; continued on "
                     f"{iso['processes']} process(es) with {' '.join(iso['overrides'] or [])}")
    for process, s in sorted(report["stragglers"].items(), key=lambda kv: -kv[1]["reports"]):
        ratio = f", up to {s['max_ratio']:.2f}x the median" if s["max_ratio"] else ""
        lines.append(f"straggler: process {process} ({s['host']}): {s['reports']} report(s), steps "
                     f"{s['first_step']}-{s['last_step']}{ratio}")
    for h in report["hangs"]:
        lines.append(f"hang: process {h['process']} ({h['host']}) stood still {h['stalled_s']} s in phase "
                     f"{h['phase']} after step {h['step']}")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)
