"""The state folder of `jaxtrain recovery decide` (train.sbatch's `--state DIR`): the facts of an
attempt and the history the recovery policy (`policy.py`) reads across attempts.

    DIR/failed_nodes   one line per failed attempt: the node it counted against, `-` for nobody
    DIR/last_error     the latest failed attempt's error signature (JSON `[type, where, step]`), or `-`
    DIR/progress       `<attempt> <restored step> <saved step>` per attempt

plus the exits file a scheduler script writes for each attempt (`<time> <task> <node> <exit code>`
lines, train.sbatch's task wrapper). The verb itself (parsing, deciding, printing) is
`jaxtrain/commands/recovery.py`. No JAX.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxtrain.launch.policy import Exit, History, Signature, attempt_steps

HISTORY_FILE = "failed_nodes"  # in the --state folder: one line per failed attempt, "-" for nobody
PROGRESS_FILE = "progress"  # in the --state folder: "<attempt> <restored step> <saved step>" per attempt
ERROR_FILE = "last_error"  # in the --state folder: the latest failed attempt's error signature (JSON), or "-"
NOBODY = "-"


def read_exits(path: Path, tasks: int) -> tuple[tuple[Exit, ...], tuple[str | None, ...]]:
    """The exits of one attempt from `<time> <task> <node> <exit code>` lines.

    Args:
      path: the file.
      tasks: the tasks of the step (task ids 0 .. tasks-1).
    Returns:
      (the exits in time order, the node of task i at index i: None when it left no line). Lines
      that are not four such fields (a task killed mid-write) or name no task of the step are skipped.
    """
    records = []
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) != 4:
            continue
        try:
            record = (float(fields[0]), int(fields[1]), fields[2], int(fields[3]))
        except ValueError:
            continue
        if 0 <= record[1] < tasks:
            records.append(record)
    records.sort(key=lambda r: r[0])
    nodes: dict[int, str] = {}
    for _, task, node, _ in records:
        nodes.setdefault(task, node)
    return tuple(Exit(task, code) for _, task, _, code in records), tuple(nodes.get(i) for i in range(tasks))


def _read_signature(path: Path) -> Signature | None:
    try:
        kind, where, step = json.loads(path.read_text())
    except (OSError, ValueError, TypeError):  # none yet, "-", or a torn write: no signature
        return None
    return (str(kind), str(where), step) if isinstance(step, int) else None


def read_history(state: Path) -> History:
    """The failure history kept in `state` (empty before the first failure)."""
    path = state / HISTORY_FILE
    lines = path.read_text().split() if path.exists() else []
    return History(tuple(None if node == NOBODY else node for node in lines), _read_signature(state / ERROR_FILE))


def record_failure(state: Path, suspect: str | None, signature: Signature | None = None) -> None:
    """Append one failed attempt's suspect (None: nobody) to the history in `state`, and keep its
    error signature (None: none) as the latest."""
    with open(state / HISTORY_FILE, "a") as f:
        f.write(f"{NOBODY if suspect is None else suspect}\n")
    tmp = state / f".{ERROR_FILE}.tmp"
    tmp.write_text(NOBODY if signature is None else json.dumps(list(signature)))
    os.replace(tmp, state / ERROR_FILE)


def attempt_progress(state: Path, attempt_no: int, events: list[dict]) -> tuple[int, int]:
    """(the step this attempt resumed from, the latest step it saved a checkpoint at), and record them.

    The resumed-from step is the attempt's own `resume` event; without one (it started fresh, or
    died before restoring) the previous attempt's saved step stands in (-1 before any). The saved
    step is the attempt's latest `checkpoint_saved` event (-1: none). `events` are the attempt's
    own (logged since it started): a remote run directory gives none, so no attempt there ever
    counts as progress, which keeps the budgets as strict as they were.
    """
    path = state / PROGRESS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    previous = -1
    for line in reversed(lines):
        fields = line.split()
        if len(fields) == 3 and fields[2].lstrip("-").isdigit():
            previous = max(int(fields[1]) if fields[1].lstrip("-").isdigit() else -1, int(fields[2]))
            break
    restored, saved = attempt_steps(events, previous)
    with open(path, "a") as f:
        f.write(f"{attempt_no} {restored} {saved}\n")
    return restored, saved
