"""Stopping together: preemption signals, and the cross-process decisions taken at sync points.

A signal handler only sets a flag (`StopSignals`): it may interrupt a write to the same stream,
and doing I/O there raises a reentrant-call error that would lose the emergency checkpoint.

Which step every process stops after, and whether a time-based checkpoint is due, must be the
same on every process. `HostSync` decides both every `train.host_sync_every` steps and never in
between, so ordinary steps make no cross-process call: at a sync step each process queues its
flags into one tiny device all-reduce, and reads the agreed result one step later (when it has
long finished: `hostcomm.LateAllGather`), so the host never waits for the device on its account. A
single process decides on its own, at every step.

Start-up is covered too: the Trainer installs the handler first thing in its construction, and
before the first step (`agree_on_startup_stop`, a key-value exchange, no device collective) the
processes agree whether any of them was asked to stop during restore, preflight or the first
compile, so such a job exits 75 without running on until SIGKILL. A SIGTERM that came even earlier,
between `jax.distributed.initialize` and the Trainer, went to JAX's own preemption handler, which
publishes a notice in the coordination service (`JAX_PREEMPTION_NOTICE_KEY`): that counts as well.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxtrain.runtime.hostcomm import LateAllGather

# The key JAX's preemption notifier (TSL's PreemptionSyncManager) sets in the coordination service
# when its SIGTERM handler fires: the handler JAX installs in jax.distributed.initialize(), which
# ours replaces once the Trainer is being built.
JAX_PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


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

    def install(self) -> "StopSignals":
        """Take SIGTERM/SIGINT (idempotent: a second call keeps the first one's previous handlers)."""
        if not self._previous and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back to the handlers that had them before `install()` (idempotent)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def agree_on_startup_stop(requested: str | None, process_index: int, process_count: int, *, name: str,
                          timeout_s: float) -> dict[int, str]:
    """Which processes were asked to stop before the first step: {process: signal name}, the same
    answer on every process (empty: go on).

    Each process publishes its own flag (its StopSignals' `requested`, or JAX's preemption notice,
    seen by whoever reads it first), then a host barrier, then every process reads all flags: all of
    them were written before the barrier, so every process reads the same set. A key-value exchange
    at start-up only (never in the loop), bounded by `timeout_s`; `name` is unique per call.
    Raises:
      BarrierTimeoutError: a process did not arrive within `timeout_s` (the message names it).
    """
    if process_count == 1:
        return {0: requested} if requested else {}
    from jaxtrain.runtime.multihost import barrier, client
    kv = client()
    mine = requested or ("JAX preemption notice" if _jax_preemption_notice(kv) else "-")
    prefix = f"jaxtrain/startup_stop/{name}/"
    kv.key_value_set(f"{prefix}{process_index}", mine, allow_overwrite=True)
    barrier(f"startup_stop/{name}", timeout_s)
    flags = {int(k.rsplit("/", 1)[1]): v for k, v in kv.key_value_dir_get(prefix)}
    return {p: v for p, v in sorted(flags.items()) if v != "-"}


def _jax_preemption_notice(kv: Any) -> bool:
    """Whether JAX's own SIGTERM handler has published a preemption notice for this job."""
    try:
        kv.key_value_try_get(JAX_PREEMPTION_NOTICE_KEY)
        return True
    except Exception:  # NOT_FOUND: no notice
        return False


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
