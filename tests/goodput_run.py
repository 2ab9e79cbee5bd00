"""A synthetic run directory with known goodput (tests/observe/test_goodput.py explains every number):
two attempts, a hang, a restart, a skipped step, checkpoints and an evaluation. Shared by the goodput,
watchdog and remote-log tests, which read the same run through other code paths."""

from __future__ import annotations

import json
from pathlib import Path


def write_run(run: Path, events: list[dict], metrics: list[dict]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


def line(step: int, *, skipped_steps: int = 0, skipped: bool = False, **extra) -> dict:
    return {"step": step, "loss": 1.0, "step_time_s": 1.0, "data_wait_s": 0.1, "skipped": skipped,
            "skipped_steps": skipped_steps, **extra}


EVENTS = [
    # attempt 0: process start unknown -> the first event (100); start-up 100 -> 110
    {"time": 100.0, "step": 0, "kind": "preflight", "processes": 2},
    {"time": 110.0, "step": 0, "kind": "start", "compile_s": 8.0, "processes": 2},
    {"time": 112.5, "step": 2, "kind": "checkpoint_saved", "blocked_s": 0.5},
    {"time": 112.6, "step": 2, "kind": "straggler", "process": 1, "host": "b", "step_time_s": 2.0,
     "median_step_time_s": 1.0},
    {"time": 113.6, "step": 3, "kind": "straggler", "process": 1, "host": "b", "step_time_s": 3.0,
     "median_step_time_s": 1.0},
    {"time": 113.7, "step": 3, "kind": "straggler", "process": 0, "host": "a", "busy_s": 1.6, "median_busy_s": 1.0,
     "data_wait_s": 0.0, "steps": 1, "factor": 1.6, "reports": 1},  # the shape jaxtrain/fault/stragglers.py writes
    # steps end at 114; stood still 10 s; the watchdog's hang event at 124, the restart at 126
    {"time": 124.0, "step": 4, "kind": "hang", "process": 1, "host": "b", "phase": "step", "stalled_s": 10.0},
    {"time": 124.1, "step": 4, "kind": "hang", "process": 0, "host": "a", "phase": "step", "stalled_s": 9.5},
    {"time": 126.0, "step": 4, "kind": "restart", "attempt": 1, "process": 1, "exit_code": 75},
    # attempt 1: begins at the restart event (126); start-up 126 -> 130
    {"time": 128.0, "step": 0, "kind": "preflight", "processes": 2},
    {"time": 130.0, "step": 2, "kind": "start", "compile_s": 1.0, "processes": 2},
    {"time": 131.0, "step": 2, "kind": "resume", "restored_step": 2, "restart_to_first_step_s": 5.0},
    {"time": 134.2, "step": 6, "kind": "checkpoint_saved", "blocked_s": 0.2},
    {"time": 134.5, "step": 6, "kind": "done", "skipped_steps": 1},
]
METRICS = [line(1), line(2, skipped=True, skipped_steps=1), line(3, skipped_steps=1), line(4, skipped_steps=1),
           line(3, skipped_steps=1), line(4, skipped_steps=1), line(5, skipped_steps=1),
           line(6, skipped_steps=1, eval_loss=1.2, eval_s=0.3)]
