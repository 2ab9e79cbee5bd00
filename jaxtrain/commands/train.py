"""`jaxtrain train --config PATH [key=value ...] [--cpu-devices N]`: one process of a training job.

A failing process records an `error` event (what the launchers compare between attempts) before it
goes; in a multi-process job it then exits at once (`_exit_now`), without waiting for its peers.
"""

from __future__ import annotations

import os
import sys

from jaxtrain.commands import startup
from jaxtrain.commands.arguments import parse, train_parser
from jaxtrain.config import ConfigError
from jaxtrain.runtime.exit_codes import EXIT_RESTART, EXIT_USAGE
from jaxtrain.storage.object_store import TransientStorageError  # (no JAX import)


def main(argv: list[str]) -> int:
    """`jaxtrain train ...` (argv without the verb). Returns the run's exit code (0, 75, 78 ...)."""
    from jaxtrain.config import load_config
    args = parse(train_parser(), argv)
    cfg = load_config(args.config, args.overrides)  # phase 1, before JAX starts
    startup.start_jax(args.cpu_devices, cfg)
    from jaxtrain.trainer import Trainer
    # Progress goes to stdout whatever it is: a terminal gets one line rewritten in place,
    # anything else (SLURM output files, Kubernetes logs, CI, `| tee`) one plain line per log step.
    trainer = Trainer(cfg, console=sys.stdout, started_at=startup.STARTED_AT)
    try:
        summary = trainer.fit()
    except BaseException as e:
        # Recorded first, while nothing else can fail: the launchers compare it with the next attempt's.
        _record_error(cfg.run.output_dir, trainer.process_index, getattr(trainer, "_host_step", -1), e)
        # No barrier after an error: the other processes may be stuck in a collective waiting for
        # this one, and close() would wait out checkpoint.barrier_timeout_s, then hide the cause.
        trainer.abort()
        if trainer.process_count > 1:
            _exit_now(_report_failure(e))
        raise  # one process: main() maps it (2, 75, 130) or Python prints it and exits 1
    trainer.close()
    return summary["exit_code"]


ERROR_EVENT_TIMEOUT_S = 0.5  # the `error` event may delay a failing process's exit by this much at most
ERROR_MESSAGE_CHARS = 200


def error_details(e: BaseException) -> dict:
    """The `error` event's fields for exception `e`: `type` (its class name), `message` (its first line,
    at most ERROR_MESSAGE_CHARS characters) and `where` (the innermost traceback frame in the jaxtrain
    package, as 'jaxtrain/path/file.py:function'; '?' when none is)."""
    import traceback
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jaxtrain/
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith(package + os.sep):
            rel = os.path.relpath(path, os.path.dirname(package)).replace(os.sep, "/")
            where = f"{rel}:{frame.name}"
    lines = str(e).strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > ERROR_MESSAGE_CHARS:
        message = message[:ERROR_MESSAGE_CHARS - 3] + "..."
    return {"type": type(e).__name__, "message": message, "where": where}


def _record_error(output_dir: str | None, process: int, step: int, e: BaseException) -> None:
    """Append an `error` event (process, type, message, where, step) to the run's events.jsonl, so
    that the launchers can tell the same deterministic failure coming back (`policy.error_signature`).

    Best effort: never raises, and waits at most ERROR_EVENT_TIMEOUT_S (a hung filesystem must not
    keep a failing process alive). Interrupts and exits are no errors, and a user error (exit 2, never
    restarted) writes nothing, as ever; a remote run directory gets nothing (`append_event` skips it:
    the launchers read local files only)."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, ConfigError)) or output_dir is None:
        return
    import threading

    from jaxtrain.observe.runlog import append_event  # imported already by the Trainer

    def write() -> None:
        try:
            append_event(output_dir, "error", step, process=process, **error_details(e))
        except BaseException as failed:  # noqa: BLE001 -- the error being handled is the one to report
            print(f"jaxtrain: could not record the error event: {type(failed).__name__}: {failed}", file=sys.stderr)

    t = threading.Thread(target=write, name="jaxtrain-error-event", daemon=True)
    t.start()
    t.join(ERROR_EVENT_TIMEOUT_S)


def _report_failure(e: BaseException) -> int:
    """Print why the run failed (the traceback, or one line for a user error) and return the exit code:
    2 for a user error, 75 for a known transient error, 130 for an interrupt, else 1."""
    if isinstance(e, ConfigError):
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, KeyboardInterrupt):
        print("jaxtrain: interrupted", file=sys.stderr)
        return 130
    import traceback
    traceback.print_exception(e, file=sys.stderr)
    if isinstance(e, TransientStorageError):
        print(f"jaxtrain: storage unavailable (transient), restart me: {e}", file=sys.stderr)
        return EXIT_RESTART
    print(f"jaxtrain: process failed: {type(e).__name__}: {e}; exiting 1 at once", file=sys.stderr)
    return 1


def _exit_now(code: int) -> None:
    """End a failing process of a multi-process job now: no atexit handlers (jax.distributed's
    shutdown waits for every process), no joins of non-daemon threads."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
