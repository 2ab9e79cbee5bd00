"""Automatic rollback past the data that caused loss spikes: the host side of `stability.py`.

`SpikeGuard`, called by the loop with every step's metrics one step late: `spike` and
`nonfinite_skipped` events, and the PaLM recipe: after `stability.max_spikes` spikes within
`stability.window` steps, a `RollbackRequest`. `Rollbacks` turns it into a plan: back to the last
committed checkpoint before the first spike, and on from the data position `stability.skip_batches`
batches past the last spike's batch: every batch from the checkpoint's data position up to there
is skipped, the spiking ones among them however far the checkpoint lies before them (PaLM
restarts ~100 steps before a spike and skips 200-500 batches, covering it). Every process sees the
same replicated flags and draws the same global batch, so every process decides the same rollback
at the same step without talking to the others.

Rollbacks are remembered in `checkpoints/rollbacks.json` (`RollbackLog`): each records its skipped
range of data positions [data_from, data_to), and no batch in a recorded range is ever drawn again
(also after a restart from the rollback's target, or a later rollback to an older checkpoint);
checkpoints that the rollback discarded stay discarded even if the process died mid-rollback, and
`stability.max_rollbacks` counts over the whole run.

`SpikeGuard` also mirrors the step's re-baseline rule (`stability.rebaseline_after` spikes in a
row restart the statistics, `stability.py`) to log a `spike_rebaseline` event; the loop seeds its
count from the state it restores (`resume`), so the two agree across restarts and rollbacks.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Any, Callable

from jaxtrain.storage.paths import to_path
from jaxtrain.storage.small_files import write_atomic
from jaxtrain.config import StabilityConfig


@dataclasses.dataclass(frozen=True)
class RollbackRequest:
    """Roll back: `spike_steps` are the spikes within the window, the last one at `at_step`;
    `spike_batches` the data positions of their batches (None where the loop did not say)."""

    at_step: int
    spike_steps: tuple[int, ...]
    spike_batches: tuple[int | None, ...] = ()


class SpikeGuard:
    """Turns each step's metrics into events and, after enough spikes in a window, a RollbackRequest."""

    def __init__(self, cfg: StabilityConfig, event: Callable[..., None]):
        self.cfg = cfg
        self.event = event
        self._spikes: collections.deque[tuple[int, int | None]] = collections.deque()  # (step, batch)
        self._run = 0  # spikes in a row, as the step counts them (`stability.update_statistics`)
        # on_window(oldest spike still in the window, or None): set by Rollbacks to pin the
        # checkpoint a rollback would need (retention must not delete it while it may be needed).
        self.on_window: Callable[[int | None], None] | None = None
        self._told: int | None = None
        self._request_pin: int | None = None  # a request's first spike, pinned until reset()

    def _tell(self) -> None:
        oldest = self._request_pin if self._request_pin is not None else (self._spikes[0][0] if self._spikes else None)
        if oldest != self._told and self.on_window is not None:
            self.on_window(oldest)
        self._told = oldest

    def reset(self) -> None:
        """Forget the spikes seen (after a rollback: the steps after the target run again)."""
        self._spikes.clear()
        self._request_pin = None
        self._tell()

    def resume(self, spike_run: int) -> None:
        """The restored state's count of spikes in a row (`state["stability"]["spike_run"]`)."""
        self._run = spike_run

    def observe(self, step: int, values: dict[str, Any], batch: int | None = None) -> RollbackRequest | None:
        """One finished step's metrics; `batch`: the data position of the batch it drew."""
        s = self.cfg
        self._request_pin = None  # a request not acted on (rollback_unavailable) pins no longer
        if values["nonfinite"]:
            self.event("nonfinite_skipped", step, loss=values["loss"], grad_norm=values["grad_norm"],
                       loss_scale=values["loss_scale"], next_loss_scale=values["next_loss_scale"])
        if values["spike"]:
            self.event("spike", step, loss=values["loss"], grad_norm=values["grad_norm"], loss_z=values["loss_z"],
                       loss_rise=values["loss_rise"], loss_divergence=values["loss_divergence"],
                       grad_norm_z=values["grad_norm_z"], skipped=values["skipped"], batch=batch)
            self._spikes.append((step, batch))
            self._run += 1
            if self._run >= s.rebaseline_after:  # the step has just restarted its statistics from this value
                self.event("spike_rebaseline", step, spikes_in_a_row=self._run, loss=values["loss"],
                           grad_norm=values["grad_norm"])
                self._run = 0
        elif not values["nonfinite"]:
            self._run = 0
        # Pruned every step (not only at spikes) so the pin is released as soon as the window passes.
        while self._spikes and self._spikes[0][0] <= step - s.window:
            self._spikes.popleft()
        request = None
        if values["spike"] and s.max_spikes > 0 and len(self._spikes) >= s.max_spikes:
            request = RollbackRequest(at_step=step, spike_steps=tuple(st for st, _ in self._spikes),
                                      spike_batches=tuple(b for _, b in self._spikes))
            self._request_pin = self._spikes[0][0]  # the rollback is planned next: keep its target
            self._spikes.clear()
        self._tell()
        return request


class RollbackLog:
    """`checkpoints/rollbacks.json`: every rollback of the run, written atomically by process 0."""

    NAME = "rollbacks.json"

    def __init__(self, checkpoint_dir: str, primary: bool,
                 agree: Callable[[str, Callable[[], str]], str] | None = None):
        """`agree(what, decide)`: process 0 decides, every process gets its answer
        (`Checkpointer.agree`). The records decide how many collective calls follow (one discard
        per record), so every process must see process 0's file, not its own view of the disk."""
        self.path = to_path(checkpoint_dir) / self.NAME
        self.primary = primary

        def read() -> str:
            return self.path.read_text() if self.path.exists() else '{"rollbacks": []}'

        self.records: list[dict] = json.loads(agree("rollbacks", read) if agree else read())["rollbacks"]

    def __len__(self) -> int:
        return len(self.records)

    def next_position(self, position: int) -> int:
        """Where to draw the next batch instead of `position`: past every recorded skipped range
        [data_from, data_to) that holds it (ranges may follow on from one another)."""
        moved = True
        while moved:
            moved = False
            for r in self.records:  # (a record written before ranges were recorded has none: ignored)
                if "data_to" in r and r["data_from"] <= position < r["data_to"]:
                    position, moved = r["data_to"], True
        return position

    def add(self, from_step: int, to_step: int, data_from: int, data_to: int, spike_steps: tuple[int, ...],
            spike_batches: tuple[int | None, ...]) -> dict:
        """Record a rollback (before its checkpoints are discarded: see the module docstring)."""
        record = {"time": time.time(), "from_step": from_step, "to_step": to_step, "data_from": data_from,
                  "data_to": data_to, "skip_batches": data_to - data_from, "spike_steps": list(spike_steps),
                  "spike_batches": list(spike_batches)}
        self.records.append(record)
        if self.primary:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"rollbacks": self.records}, indent=1))
        return record


@dataclasses.dataclass(frozen=True)
class RollbackPlan:
    """What a rollback will do: go from `at_step` back to the committed checkpoint `to_step`."""

    at_step: int
    to_step: int
    spike_steps: tuple[int, ...]
    spike_batches: tuple[int | None, ...] = ()

    def resume_position(self, data_from: int, skip_batches: int) -> int:
        """The data position to go on from, given the target checkpoint's (`data_from`): one past the
        last spike's batch, plus `skip_batches`; never before data_from (+ skip_batches)."""
        known = [b for b in self.spike_batches if b is not None]
        return max([data_from, *(b + 1 for b in known)]) + skip_batches


class RollbackLimit(Exception):
    """`stability.max_rollbacks` is spent: the run must stop (exit 78, a human is needed) with this message."""


class Rollbacks:
    """The rollback side of the loop: decides where to go, records it, discards what it supersedes,
    and says where the data goes on after it. The loop only restores the state it is told to.

    Without a checkpointer (write_files=False: notebooks, tests) nothing can be restored; a request
    is logged as `rollback_unavailable` and training goes on.
    """

    def __init__(self, cfg: StabilityConfig, checkpointer: Any, record: RollbackLog | None, event: Callable[..., None],
                 guard: SpikeGuard | None = None):
        """`guard`: the loop's SpikeGuard. While it holds spikes, the newest checkpoint older than
        the oldest of them is pinned against retention (`Checkpointer.pin_before`): with
        keep_last=2 and every_steps=10, spikes at 15, 35, 38 need the step-10 checkpoint at 38,
        which plain retention deleted at step 30."""
        self.cfg, self.checkpointer, self.record, self.event = cfg, checkpointer, record, event
        if guard is not None and checkpointer is not None and hasattr(checkpointer, "pin_before"):
            guard.on_window = checkpointer.pin_before

    def __len__(self) -> int:
        return len(self.record) if self.record is not None else 0

    def finish_interrupted(self) -> None:
        """At start-up: a rollback that died before discarding what it superseded is finished
        (idempotent; one collective discard per recorded rollback, on every process alike)."""
        for r in self.record.records if self.record is not None else []:
            self.checkpointer.discard_after(r["to_step"], committed_before=r["time"])

    def batches_to_skip(self, position: int) -> int:
        """Before drawing the batch at data position `position`: how many batches to skip so that
        no batch a rollback left behind is drawn (also after a restart). 0 almost always."""
        return 0 if self.record is None else self.record.next_position(position) - position

    def plan(self, request: RollbackRequest) -> RollbackPlan | None:
        """Where to go for `request`; None when no rollback is possible (logged). Raises
        RollbackLimit when stability.max_rollbacks is spent."""
        s, at = self.cfg, request.at_step
        if self.checkpointer is None:
            self.event("rollback_unavailable", at, reason="no checkpoint directory (write_files=False)")
            return None
        if len(self) >= s.max_rollbacks:
            raise RollbackLimit(
                f"{s.max_spikes} loss spikes within {s.window} steps again, after {len(self)} rollback(s) "
                f"(stability.max_rollbacks={s.max_rollbacks}): stopping; look at the data and the learning rate "
                "before restarting")
        self.checkpointer.wait()
        target = self.checkpointer.latest_step(before=request.spike_steps[0])
        if target is None:
            self.event("rollback_unavailable", at, spike_steps=list(request.spike_steps),
                       reason="no committed checkpoint before the first spike")
            return None
        return RollbackPlan(at_step=at, to_step=target, spike_steps=request.spike_steps,
                            spike_batches=request.spike_batches)

    def commit(self, plan: RollbackPlan, data_from: int) -> tuple[dict, list[int]]:
        """Record the rollback, then discard the checkpoints after its target (in this order: see the
        module docstring). `data_from`: the data position of the restored target checkpoint.
        Returns (the record, the steps discarded); the loop then skips to the record's `data_to`."""
        record = self.record.add(from_step=plan.at_step, to_step=plan.to_step, data_from=data_from,
                                 data_to=plan.resume_position(data_from, self.cfg.skip_batches),
                                 spike_steps=plan.spike_steps, spike_batches=plan.spike_batches)
        return record, self.checkpointer.discard_after(plan.to_step)
