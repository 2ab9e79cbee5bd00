"""Reading a run directory's files for the launchers: the last step recorded, the events logged.

The launchers (`jaxtrain launch`, `jaxtrain recovery` for train.sbatch) read the trainer's own
`metrics.jsonl` and `events.jsonl` to say at which step a failure happened and which process an
attempt's events blame (the blame itself is `policy.blamed_process`). They read local files only:
for a remote run directory (gs://, s3://, see `jaxtrain.checkpoint.paths`) there is nothing to
read, and the answers are "unknown" (-1, no events). A process killed mid-write may leave a torn
last line: it is skipped, never an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxtrain.checkpoint.paths import is_remote


def _local(output_dir: str | Path | None) -> Path | None:
    """The run directory as a local path, or None when unknown or remote."""
    if output_dir is None or is_remote(output_dir):
        return None
    return Path(output_dir)


def _last_step_in(path: Path) -> int:
    # Only the file's tail: run files of long runs are large.
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # torn or foreign line: look further back
    return -1


def last_known_step(output_dir: str | Path | None) -> int:
    """The last step the run recorded: the later of metrics.jsonl's and events.jsonl's last lines.

    Args:
      output_dir: the run directory (None: unknown).
    Returns:
      That step, or -1 when nothing was recorded (or the directory is remote). Metrics are logged
      every train.log_every steps, events such as checkpoint_saved in between: either may be later.
    """
    run = _local(output_dir)
    if run is None:
        return -1
    return max(_last_step_in(run / "metrics.jsonl"), _last_step_in(run / "events.jsonl"))


def _event_lines(output_dir: str | Path | None) -> list[str]:
    run = _local(output_dir)
    if run is None or not (run / "events.jsonl").exists():
        return []
    return (run / "events.jsonl").read_text().splitlines()


def count_events(output_dir: str | Path | None) -> int:
    """How many lines events.jsonl has now: the events of an attempt started now come after them."""
    return len(_event_lines(output_dir))


def read_events(output_dir: str | Path | None, since_line: int = 0) -> list[dict]:
    """The run's events from line `since_line` of events.jsonl on, oldest first.

    Args:
      output_dir: the run directory (None or remote: no events).
      since_line: lines to skip (`count_events` when the attempt started).
    Returns:
      The events as dicts; torn lines (a writer killed mid-line) and non-object lines are skipped.
    """
    events = []
    for line in _event_lines(output_dir)[since_line:]:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if isinstance(event, dict):
            events.append(event)
    return events
