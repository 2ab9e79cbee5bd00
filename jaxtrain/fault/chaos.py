"""Fault drills (`chaos.*`): failures injected on purpose, for tests and for rehearsing on a cluster.

All are off by default and fire on the first attempt of a job only (`jaxtrain launch` and the
cluster recipes count attempts in JAXTRAIN_RESTART_ATTEMPT), so a restarted job runs clean. The
exceptions: the numerics drills (they are data), `chaos.crash_process`, a bad node that crashes
on every attempt until `jaxtrain launch --isolate-after` takes its slot out of the job, and
`chaos.raise_at_step` with `chaos.raise_every_attempt`, a deterministic bug.
Each drill that fires writes a `chaos` event first, so a run directory says what was injected.

Three hangs, for the three ways a process can stop (docs/fault.md, "Who is blamed for a hang"):
`chaos.hang_at_step` alone, a host that stops between steps (alive, silent, its devices idle);
with `chaos.hang_in_step`, a process that blocks INSIDE the compiled step of `hang_at_step` (in
the step's start mark, a host callback: `step_marks.py`), so its peers wait in the step's
collectives as they would for a hung device; with `chaos.hang_freeze`, a process that stops
itself with SIGSTOP after that step (every thread, the watchdog's heartbeat too).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxtrain.config import ChaosConfig

_log = logging.getLogger(__name__)  # the drills' notices: `jaxtrain: chaos....` lines (observe/console.py)

CRASH_EXIT_CODE = 1  # what chaos.crash_process exits with: an ordinary crash, not "restart me"


class Chaos:
    """The drills of one process; the loop calls `at_start()` once and `after_step()` every step."""

    def __init__(self, cfg: ChaosConfig, process_index: int, event: Callable[..., None], *, attempt: int = 0,
                 slot: int | None = None):
        """`attempt`: 0 on a job's first attempt, n on its n-th restart. `slot`: the `jaxtrain launch`
        slot this process runs in (None: the process index). Slots name places (nodes), processes
        name positions in the job: after an isolation the processes are renumbered, the slots are
        not, so a bad slot's drill stops with the slot."""
        self.cfg = cfg  # the chaos section: all a drill reads
        self.process_index = process_index
        self.event = event
        self.attempt = attempt
        self.armed = attempt == 0
        self.slot = process_index if slot is None else slot
        self.crashes = self.cfg.crash_process >= 0 and self.slot == self.cfg.crash_process
        self._in_step_fired = threading.Lock()  # the start mark runs once per local device: one event

    def at_start(self) -> None:
        """A slow start-up on `chaos.slow_process` (`chaos.start_delay_s`): processes reach the first
        collectives at different times. A bad node (`chaos.crash_process`, `crash_at_step=0`) crashes here."""
        c = self.cfg
        if c.start_delay_s > 0 and self.process_index == c.slow_process:
            # The notice is also what tests wait for to signal a process in start-up.
            _log.info(f"chaos.start_delay_s: process {self.process_index} starts {c.start_delay_s:g} s late")
            time.sleep(c.start_delay_s)
        if self.crashes and c.crash_at_step == 0:
            self._crash(0)

    def _crash(self, step: int) -> None:
        """Exit at once with an ordinary crash code, on every attempt (`chaos.crash_process`)."""
        self.event("chaos", step, drill="crash", slot=self.slot, process=self.process_index, attempt=self.attempt)
        _log.info(f"chaos.crash_process: slot {self.slot} (process {self.process_index}) crashes at step {step} "
                  f"(attempt {self.attempt})")
        os._exit(CRASH_EXIT_CODE)  # no cleanup, as a failing node gives none

    def batch_factor(self, batch_index: int, step: int) -> float:
        """The loss multiplier for the batch with this index in the data order (0-based): NaN for
        `chaos.nan_at_steps`, `chaos.spike_factor` for `chaos.spike_at_steps`, else 1.

        Keyed by the batch, not the step: step N of an uninterrupted run draws batch N-1, and a
        rollback that skips bad batches leaves these behind, as it would real bad data. Numerics
        drills fire on every attempt (they are data, not faults of a process).
        """
        c = self.cfg
        if batch_index + 1 in c.nan_at_steps:
            self.event("chaos", step, drill="nan", batch=batch_index)
            return float("nan")
        if batch_index + 1 in c.spike_at_steps:
            self.event("chaos", step, drill="spike", batch=batch_index, factor=c.spike_factor)
            return float(c.spike_factor)
        return 1.0

    def corrupt(self, batch_index: int, step: int, local: dict[str, Any], vocab_size: int) -> dict[str, Any]:
        """`chaos.corrupt_at_steps`: this process's rows of that batch with every token and target
        replaced by uniform random ids (a corrupted shard: real bad data on the data path, unlike
        spike_factor, which scales the loss). Keyed by the batch, like the other numerics drills;
        seeded by batch and process, so every attempt corrupts the same rows the same way."""
        if batch_index + 1 not in self.cfg.corrupt_at_steps:
            return local
        if self.process_index == 0:
            self.event("chaos", step, drill="corrupt", batch=batch_index)
        rng = np.random.default_rng([batch_index, self.process_index])
        noise = lambda a: rng.integers(0, vocab_size, size=np.shape(a)).astype(np.asarray(a).dtype)
        return {**local, "tokens": noise(local["tokens"]), "targets": noise(local["targets"])}

    def after_step(self, step: int, state: Any) -> None:
        """Drills that act between steps: kill a process, crash a bad slot, slow one down."""
        c = self.cfg
        if self.crashes and c.crash_at_step > 0 and step >= c.crash_at_step:
            jax.block_until_ready(state)  # the step completed, as "right after step N" promises
            self._crash(step)
        if self.armed and step == c.kill_at_step and self.process_index == c.kill_process:
            jax.block_until_ready(state)  # the step completed, as "right after step N" promises
            self.event("chaos", step, drill="kill", process=self.process_index)
            os.kill(os.getpid(), signal.SIGKILL)  # die without any cleanup
        if c.slow_seconds > 0 and self.process_index == c.slow_process:
            time.sleep(c.slow_seconds)  # a straggler: same numerics, later
        # chaos.raise_every_attempt: a deterministic bug, raised on every attempt (the launchers then stop with 78).
        if (self.armed or c.raise_every_attempt) and step == c.raise_at_step and self.process_index == c.raise_process:
            # A bug or a failed call in the loop, while the other processes go on into the next
            # step's collectives: the error must reach the log and the process must end at once.
            self.event("chaos", step, drill="raise", process=self.process_index)
            _log.info(f"chaos.raise_at_step: process {self.process_index} raises at step {step}")
            raise RuntimeError(f"chaos.raise_at_step: injected error on process {self.process_index} at step {step}")
        if self.armed and step == c.hang_at_step and self.process_index == c.hang_process and not c.hang_in_step:
            jax.block_until_ready(state)
            if c.hang_freeze:
                self.event("chaos", step, drill="freeze", process=self.process_index)
                _log.info(f"chaos.hang_freeze: process {self.process_index} stops itself (SIGSTOP) after "
                          f"step {step}")
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops: no heartbeat, no watchdog
                return
            self.event("chaos", step, drill="hang", process=self.process_index)
            while True:  # a hung host: alive, silent, holding its devices
                time.sleep(3600)

    def in_step(self, step: int) -> None:
        """Called in the compiled step's start mark of `step` (a host callback, once per local device):
        `chaos.hang_in_step` blocks here forever in step `chaos.hang_at_step` of `chaos.hang_process`,
        so that process never enters the step's collectives and its peers wait in them."""
        c = self.cfg
        if not (c.hang_in_step and self.armed and step == c.hang_at_step and self.process_index == c.hang_process):
            return
        if self._in_step_fired.acquire(blocking=False):
            self.event("chaos", step, drill="hang_in_step", process=self.process_index)
            _log.info(f"chaos.hang_in_step: process {self.process_index} blocks inside step {step}")
        while True:  # a hung device, as its peers see it: inside the step, never reaching its collectives
            time.sleep(3600)
