"""Automatic rollback past the data that caused loss spikes: the host side of `stability.py`.

`SpikeGuard`, called by the loop with every step's metrics one step late: `spike` and
`nonfinite_skipped` events, and the PaLM recipe: after `stability.max_spikes` spikes within
`stability.window` steps, a `RollbackRequest`. `Rollbacks` turns it into a plan: back to the last
committed checkpoint before the first spike, then skip the next `stability.skip_batches` batches.
Every process sees the same replicated flags, so every process decides the same rollback at the
same step without talking to the others.

Rollbacks are remembered in `checkpoints/rollbacks.json` (`RollbackLog`): the data skip is applied
whenever training passes the rollback's target step (also after a restart), checkpoints that the
rollback discarded stay discarded even if the process died mid-rollback, and
`stability.max_rollbacks` counts over the whole run.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Any, Callable

from jaxtrain.checkpoint.layout import to_path, write_atomic
from jaxtrain.config import Config


@dataclasses.dataclass(frozen=True)
class RollbackRequest:
    """Roll back: `spike_steps` are the spikes within the window, the last one at `at_step`."""

    at_step: int
    spike_steps: tuple[int, ...]


class SpikeGuard:
    """Turns each step's metrics into events and, after enough spikes in a window, a RollbackRequest."""

    def __init__(self, cfg: Config, event: Callable[..., None]):
        self.cfg = cfg.stability
        self.event = event
        self._spikes: collections.deque[int] = collections.deque()
        # on_window(oldest spike still in the window, or None): set by Rollbacks to pin the
        # checkpoint a rollback would need (retention must not delete it while it may be needed).
        self.on_window: Callable[[int | None], None] | None = None
        self._told: int | None = None
        self._request_pin: int | None = None  # a request's first spike, pinned until reset()

    def _tell(self) -> None:
        oldest = self._request_pin if self._request_pin is not None else (self._spikes[0] if self._spikes else None)
        if oldest != self._told and self.on_window is not None:
            self.on_window(oldest)
        self._told = oldest

    def reset(self) -> None:
        """Forget the spikes seen (after a rollback: the steps after the target run again)."""
        self._spikes.clear()
        self._request_pin = None
        self._tell()

    def observe(self, step: int, values: dict[str, Any]) -> RollbackRequest | None:
        s = self.cfg
        self._request_pin = None  # a request not acted on (rollback_unavailable) pins no longer
        if values["nonfinite"]:
            self.event("nonfinite_skipped", step, loss=values["loss"], grad_norm=values["grad_norm"],
                       loss_scale=values["loss_scale"], next_loss_scale=values["next_loss_scale"])
        if values["spike"]:
            self.event("spike", step, loss=values["loss"], grad_norm=values["grad_norm"], loss_z=values["loss_z"],
                       grad_norm_z=values["grad_norm_z"], skipped=values["skipped"])
            self._spikes.append(step)
        # Pruned every step (not only at spikes) so the pin is released as soon as the window passes.
        while self._spikes and self._spikes[0] <= step - s.window:
            self._spikes.popleft()
        request = None
        if values["spike"] and s.max_spikes > 0 and len(self._spikes) >= s.max_spikes:
            request = RollbackRequest(at_step=step, spike_steps=tuple(self._spikes))
            self._request_pin = self._spikes[0]  # the rollback is planned next: keep its target
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

    def skip_at(self, step: int) -> int:
        """Batches to skip when the state is at `step` and the next batch is about to be drawn."""
        return sum(r["skip_batches"] for r in self.records if r["to_step"] == step)

    def add(self, from_step: int, to_step: int, skip_batches: int, spike_steps: tuple[int, ...]) -> dict:
        """Record a rollback (before its checkpoints are discarded: see the module docstring)."""
        record = {"time": time.time(), "from_step": from_step, "to_step": to_step, "skip_batches": skip_batches,
                  "spike_steps": list(spike_steps)}
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


class RollbackLimit(Exception):
    """`stability.max_rollbacks` is spent: the run must stop (exit 75) with this message."""


class Rollbacks:
    """The rollback side of the loop: decides where to go, records it, discards what it supersedes,
    and says when to skip the batches it left behind. The loop only restores the state it is told to.

    Without a checkpointer (write_files=False: notebooks, tests) nothing can be restored; a request
    is logged as `rollback_unavailable` and training goes on.
    """

    def __init__(self, cfg: Config, checkpointer: Any, record: RollbackLog | None, event: Callable[..., None],
                 guard: SpikeGuard | None = None):
        """`guard`: the loop's SpikeGuard. While it holds spikes, the newest checkpoint older than
        the oldest of them is pinned against retention (`Checkpointer.pin_before`): with
        keep_last=2 and every_steps=10, spikes at 15, 35, 38 need the step-10 checkpoint at 38,
        which plain retention deleted at step 30."""
        self.cfg, self.checkpointer, self.record, self.event = cfg.stability, checkpointer, record, event
        self._skipped_at: int | None = None  # the step at which rolled-back batches were last skipped
        if guard is not None and checkpointer is not None and hasattr(checkpointer, "pin_before"):
            guard.on_window = checkpointer.pin_before

    def __len__(self) -> int:
        return len(self.record) if self.record is not None else 0

    def finish_interrupted(self) -> None:
        """At start-up: a rollback that died before discarding what it superseded is finished
        (idempotent; one collective discard per recorded rollback, on every process alike)."""
        for r in self.record.records if self.record is not None else []:
            self.checkpointer.discard_after(r["to_step"], committed_before=r["time"])

    def batches_to_skip(self, step: int) -> int:
        """Before drawing the batch after `step`: how many batches a rollback to `step` left behind
        (also after a restart). Counted once per visit of `step`."""
        if self.record is None or self._skipped_at == step:
            return 0
        self._skipped_at = step
        return self.record.skip_at(step)

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
        return RollbackPlan(at_step=at, to_step=target, spike_steps=request.spike_steps)

    def commit(self, plan: RollbackPlan) -> list[int]:
        """Record the rollback, then discard the checkpoints after its target (in this order: see the
        module docstring). Returns the steps discarded. The loop restores `plan.to_step` next."""
        self.record.add(from_step=plan.at_step, to_step=plan.to_step, skip_batches=self.cfg.skip_batches,
                        spike_steps=plan.spike_steps)
        self._skipped_at = None  # this rollback's skip (and earlier ones to the same step) applies next
        return self.checkpointer.discard_after(plan.to_step)
