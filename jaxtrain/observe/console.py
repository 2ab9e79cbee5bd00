"""What a person reads on the terminal: one short line per event and a progress line per logged step.

The run's logs (`runlog.RunLog`) hand every event and metrics record here and print what comes
back; events.jsonl and metrics.jsonl keep every detail, so the console may leave details out. A
formatter per event kind says what matters for that kind (`start`: size, devices, compile time,
the steps to run; `checkpoint_saved`: the step; `preempted`: what was saved and how to resume);
every other kind gets the generic `[kind] step N key=value ...` with long values cut short.

`Console` is stateful only in what the lines need across events: the steps to run and when the
run started (for `step N/TOTAL` and the ETA), and the last checkpoint saved (for the preemption
line). `write_line` puts a line on the console stream (rewritten in place on a terminal).

The library never prints: its warnings and drill notices go through `logging` (loggers under
`jaxtrain`), and `install_stderr_logging` (called by the `jaxtrain` command and the Trainer) is the
one place that shows them, as `jaxtrain: warning: ...` (warnings) and `jaxtrain: ...` lines on stderr.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable

from jaxtrain.runtime.exit_codes import EXIT_HUMAN, EXIT_OK, EXIT_RESTART, EXIT_USAGE

# What an exit code asks of whoever started the run (runtime/exit_codes.py defines them).
EXIT_MEANING = {
    EXIT_OK: "done",
    EXIT_USAGE: "fix the config or input",
    EXIT_RESTART: "restart me",
    EXIT_HUMAN: "stop, a human is needed",
}

MAX_VALUE_CHARS = 60  # a generic event's value longer than this is cut (events.jsonl has it whole)


class Console:
    """Turns events and metrics records into the lines printed on the console (None: print nothing)."""

    def __init__(self, total_steps: int | None = None, clock: Callable[[], float] | None = None):
        """`total_steps`: train.steps when known before the `start` event says it; `clock`: seconds
        (default time.monotonic)."""
        self.total_steps = total_steps  # train.steps, from the `start` event
        self._clock = clock
        self._start: tuple[int, float] | None = None  # (step, clock) at the `start` event: for the ETA
        self._last_saved: int | None = None  # the last checkpoint committed (for the preemption line)
        self._formatters: dict[str, Callable[[int, dict[str, Any]], str | None]] = {
            "start": self._format_start,
            "resume": self._format_resume,
            "checkpoint_saved": self._format_saved,
            "local_checkpoint_saved": self._format_local_saved,
            "signal": self._format_signal,
            "preempted": self._format_preempted,
            "done": self._format_done,
            "rollback_limit": self._format_rollback_limit,
        }

    def _now(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()

    # ------------------------------------------------------------------ events

    def event(self, kind: str, step: int, details: dict[str, Any]) -> str | None:
        """The console line of one event (None: the event prints nothing)."""
        formatter = self._formatters.get(kind)
        if formatter is not None:
            try:
                return formatter(step, details)
            except (KeyError, TypeError, ValueError):  # an event of another shape: never stop a run over a line
                pass
        return generic_line(kind, step, details)

    def _format_start(self, step: int, d: dict[str, Any]) -> str:
        if d.get("train_steps") is not None:
            self.total_steps = int(d["train_steps"])
        self._start = (step, self._now())
        devices = int(d.get("devices", 1))
        mesh = d.get("mesh") or {}
        # Only the axes that split something: "data=2 fsdp=4", not six axes of size 1.
        axes = " ".join(f"{a}={n}" for a, n in mesh.items() if n != 1) or ("data=1" if mesh else "")
        parts = [f"{_count(d['params'])} params" if "params" in d else None,
                 f"{devices} device{'s' if devices != 1 else ''}" + (f" (mesh {axes})" if axes else "")
                 + (f" on {d['processes']} processes" if d.get("processes", 1) > 1 else ""),
                 f"attention {d['attention']}" if d.get("attention") else None,
                 f"compiled in {d['compile_s']:.1f} s" if d.get("compile_s") is not None else None,
                 f"steps {step} -> {self.total_steps}" if self.total_steps is not None else f"from step {step}",
                 f"resumed from step {step}" if step > 0 else None,
                 # the synthetic chain's known floor: where a healthy run's loss ends (configs/tiny.yaml)
                 f"loss floor {d['entropy_floor']:.3f} (the Markov chain's entropy)" if d.get("entropy_floor") else None]
        return "[start] " + ", ".join(p for p in parts if p)

    def _format_resume(self, step: int, d: dict[str, Any]) -> str:
        source = f" ({d['source']} checkpoint)" if d.get("source") else ""
        took = d.get("restart_to_first_step_s")
        return f"[resume] from step {d.get('restored_step', step)}{source}" + (
            f", first step {took:.1f} s after the process started" if took is not None else "")

    def _format_saved(self, step: int, d: dict[str, Any]) -> str:
        self._last_saved = step
        return f"[checkpoint] saved step {step}"

    def _format_local_saved(self, step: int, d: dict[str, Any]) -> str:
        return f"[checkpoint] saved step {step} to the local tier"

    def _format_signal(self, step: int, d: dict[str, Any]) -> str:
        name = d.get("signal", "a stop request")
        if d.get("before_first_step"):
            return f"[signal] {name} during start-up: stopping before the first step"
        again = "Ctrl-C again" if name == "SIGINT" else "a second signal"
        return f"[signal] {name} at step {step}: saving a checkpoint and stopping ({again} quits at once, unsaved)"

    def _format_preempted(self, step: int, d: dict[str, Any]) -> str:
        code = d.get("exit_code", EXIT_RESTART)
        meaning = EXIT_MEANING.get(code, "")
        tail = f" (exit {code}{' = ' + meaning if meaning else ''})"
        if d.get("before_first_step"):
            return (f"[preempted] stopped before the first step, at step {step} (nothing new to save); "
                    f"run the same command to resume{tail}")
        if self._last_saved == step:
            return f"[preempted] saved step {step}; run the same command to resume{tail}"
        last = f"the last checkpoint is step {self._last_saved}" if self._last_saved is not None else \
            "no checkpoint was saved by this run"
        return f"[preempted] at step {step}, {last}; run the same command to resume{tail}"

    def _format_rollback_limit(self, step: int, d: dict[str, Any]) -> str:
        code = d.get("exit_code", EXIT_HUMAN)
        message = f": {d['message']}" if d.get("message") else ""
        return f"[rollback_limit] at step {step}{message} (exit {code} = {EXIT_MEANING.get(code, 'see exit_codes.py')})"

    def _format_done(self, step: int, d: dict[str, Any]) -> str:
        took = f" in {format_duration(self._now() - self._start[1])}" if self._start is not None else ""
        parts = [f"[done] step {step}{took}"]
        if d.get("skipped_steps"):
            parts.append(f"skipped steps {d['skipped_steps']}")
        if d.get("rollbacks"):
            parts.append(f"rollbacks {d['rollbacks']}")
        return ", ".join(parts)

    # ------------------------------------------------------------------ progress

    def progress(self, record: dict[str, Any]) -> str:
        """The progress line of a metrics record: step/total, loss, lr, grad norm, tok/s, MFU, ETA."""
        step = int(record["step"])
        if self.total_steps is not None:
            line = f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"
        else:
            line = f"step {step:>6}"
        line += f"  loss {record['loss']:.4f}"
        if "learning_rate" in record:
            line += f"  lr {record['learning_rate']:.1e}"
        if "grad_norm" in record:
            line += f"  grad {record['grad_norm']:.3g}"
        line += f"  tok/s {record['tokens_per_sec']:,.0f}  MFU {100 * record['mfu']:.1f}%"
        eta = self._eta(step, record.get("step_time_s"))
        if eta is not None:
            line += f"  eta {format_duration(eta)}"
        if "eval_loss" in record:
            line += f"  eval {record['eval_loss']:.4f}"
        if record.get("skipped_steps"):
            line += f"  skipped {record['skipped_steps']}"  # last: tests read it at the end of the line
        return line

    def _eta(self, step: int, step_time_s: float | None) -> float | None:
        """Seconds left: the steps to go times the mean wall time per step since the start (which
        counts evaluations and checkpoints too); the last step time before the start is known."""
        if self.total_steps is None:
            return None
        left = max(self.total_steps - step, 0)
        if self._start is not None and step > self._start[0]:
            per_step = (self._now() - self._start[1]) / (step - self._start[0])
        elif step_time_s is not None and math.isfinite(step_time_s):
            per_step = step_time_s
        else:
            return None
        return left * per_step


def generic_line(kind: str, step: int, details: dict[str, Any]) -> str:
    """`[kind] step N key=value ...`, None values left out and long values cut short."""
    fields = " ".join(f"{k}={_short(v)}" for k, v in details.items() if v is not None)
    return f"[{kind}] step {step}" + (f" {fields}" if fields else "")


def format_duration(seconds: float) -> str:
    """45s, 1m12s, 2h03m, 3d04h: two units at most, enough for an ETA."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _count(n: int) -> str:
    return f"{int(n):,}"


def _short(v: Any) -> str:
    text = f"{v:.4g}" if isinstance(v, float) else str(v)
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 1] + "..."


# ---------------------------------------------------------------------- where the lines go


def write_line(stream: Any, line: str, *, tty: bool, keep: bool) -> None:
    """Put `line` on the console `stream`: on a terminal (`tty`) it overwrites the line in place and
    ends it only when `keep`; anywhere else it is one plain line."""
    if tty:
        stream.write("\r\033[K" + line + ("\n" if keep else ""))
    else:
        stream.write(line + "\n")
    stream.flush()


class _StderrLines(logging.Handler):
    """The library's log records as `jaxtrain: warning: MESSAGE` (warnings) or `jaxtrain: MESSAGE`
    (notices, errors) lines on sys.stderr as it is when the line is written (a test's capture, a
    notebook's cell), flushed at once (a drill may end the process right after its notice)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = "jaxtrain: warning: " if record.levelno == logging.WARNING else "jaxtrain: "
            sys.stderr.write(f"{prefix}{record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 -- logging's own rule: a broken stream never raises into the caller
            self.handleError(record)


def install_stderr_logging() -> None:
    """Show the library's warnings and notices (the `jaxtrain` loggers, INFO and up) on stderr, each
    as one `jaxtrain: ...` line. Idempotent; they no longer reach the root logger's handlers (no line
    twice where the application configured logging too)."""
    logger = logging.getLogger("jaxtrain")
    if any(getattr(h, "jaxtrain_stderr", False) for h in logger.handlers):
        return
    handler = _StderrLines()
    handler.jaxtrain_stderr = True  # type: ignore[attr-defined]  -- found again after a reload of this module
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
