"""Reading a run directory's files for the launchers: the last step recorded, the events logged.

The launchers (`jaxtrain launch`, `jaxtrain recovery` for train.sbatch) read the trainer's own
`metrics.jsonl` and `events.jsonl` to say at which step a failure happened and which process an
attempt's events blame (the blame itself is `policy.blamed_process`). The events are read through
`jaxtrain.observe.runlog.read_log`, locally and in a bucket (gs://, s3://: the log's segments);
the last step only locally (a tail of the file; remote: "unknown", -1). A process killed
mid-write may leave a torn last line: it is skipped, never an error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from jaxtrain.storage.paths import is_remote
from jaxtrain.observe.runlog import read_log

_log = logging.getLogger(__name__)


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


def count_events(output_dir: str | Path | None) -> int:
    """How many events the run has logged now: the events of an attempt started now come after them.

    When a bucket cannot be read now, a count no event reaches (this attempt's events are then
    unknown: nobody is blamed on them, rather than on an earlier attempt's)."""
    events = _read(output_dir)
    return sys.maxsize if events is None else len(events)


def read_events(output_dir: str | Path | None, since_line: int = 0) -> list[dict]:
    """The run's events from event number `since_line` on, oldest first.

    Args:
      output_dir: the run directory, local or in a bucket (None: no events).
      since_line: events to skip (`count_events` when the attempt started).
    Returns:
      The events as dicts; torn lines (a writer killed mid-line) and non-object lines are skipped
      (and not counted, here as in `count_events`). [] when a bucket cannot be read now.
    """
    return (_read(output_dir) or [])[since_line:]


def _read(output_dir: str | Path | None) -> list[dict] | None:
    """The events of the run (None: a bucket that cannot be read now; said in one line on stderr)."""
    if output_dir is None:
        return []
    if not is_remote(output_dir):
        return read_log(output_dir, "events.jsonl")
    try:
        return read_log(output_dir, "events.jsonl")
    except Exception as e:  # the launcher must go on: no events is "nobody blamed"
        # The error's type only: a client's message may spell the endpoint with its user info.
        _log.warning(f"could not read the events of the run directory ({type(e).__name__}); "
                     "blaming nobody for this attempt")
        return None
