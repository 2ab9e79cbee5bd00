"""Stopping together: preemption signals, and the cross-process decisions taken at sync points.

A signal handler only sets a flag (`StopSignals`): it may interrupt a write to the same stream,
and doing I/O there raises a reentrant-call error that would lose the emergency checkpoint.

Which step every process stops after, and whether a time-based checkpoint is due, must be the
same on every process. `HostSync` decides both every `train.host_sync_every` steps and never in
between, so ordinary steps make no cross-process call: at a sync step each process queues its
flags into one tiny device all-reduce, and reads the agreed result one step later (when it has
long finished: `hostcomm.LateAllGather`), so the host never waits for the device on its account. A
single process decides on its own, at every step.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxtrain.fault.hostcomm import LateAllGather


class StopSignals:
    """SIGTERM/SIGINT -> `requested` (the signal's name). A second signal raises KeyboardInterrupt.

    Only the main thread can install handlers; elsewhere (a notebook's worker thread) signals keep
    their default behaviour.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self.reported = False  # the loop logs the signal once, outside the handler
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt  # asked twice: give up waiting
        self.requested = signal.Signals(signum).name  # nothing else here: no I/O in a signal handler

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every process does after a step."""

    stop: bool = False  # stop after this step (a preemption signal reached some process)
    save: bool = False  # a time-based checkpoint is due


class HostSync:
    """Agreed stop / time-based-save decisions, taken every `every` steps (see the module docstring)."""

    def __init__(self, mesh: Mesh, every: int, process_count: int):
        self.every = every
        self.process_count = process_count
        self.calls: list[int] = []  # steps at which a cross-process gather was queued (tests)
        self._gather = LateAllGather(mesh) if process_count > 1 else None

    def poll(self, step: int, stop_requested: bool, save_due: bool) -> Decision:
        """The decision after `step`, given this process's own flags (same answer on every process)."""
        if self._gather is None:
            return Decision(stop=stop_requested, save=save_due)
        decision = Decision()
        table = self._gather.result(step)
        if table is not None:  # any process's flag counts
            decision = Decision(stop=bool(table[:, 0].max()), save=bool(table[:, 1].max()))
        if step % self.every == 0:
            self._gather.start(step, np.array([stop_requested, save_due], np.float64))
            self.calls.append(step)
        return decision
