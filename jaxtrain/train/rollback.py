"""Loss-spike detection inside the step, and automatic rollback past the data that caused it.

In the jitted step (`spike_check`, `update_statistics`): robust running statistics of the loss and
the gradient norm (an exponential moving mean and variance over about `stability.window` steps)
live in the train state (`state["stability"]`). A step whose loss or gradient norm lies more than
`stability.spike_threshold` standard deviations above the mean is a spike; with
`stability.skip_spikes` its update is not applied. Skipped and non-finite steps never enter the
statistics, and each value that does enters clipped to mean +- threshold x std, so one NaN or one
huge outlier cannot shift the mean or inflate the variance into hiding (or faking) the next spike.
No spike is flagged before `stability.min_history` clean steps have been seen.

On the host (`SpikeGuard`, called by the loop with every step's metrics one step late): `spike` and
`nonfinite_skipped` events, and the PaLM recipe: after `stability.max_spikes` spikes within
`stability.window` steps, roll back to the last committed checkpoint before the first of them and
skip the next `stability.skip_batches` batches. Every process sees the same replicated flags, so
every process decides the same rollback at the same step without talking to the others.

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

import jax
import jax.numpy as jnp

from jaxtrain.config import Config

Statistics = dict[str, jax.Array]

_EPS = 1e-12


# ----------------------------------------------------------------------------- in the step


def init_statistics() -> Statistics:
    """Empty statistics (`count` 0: nothing seen yet)."""
    zero = jnp.float32(0.0)
    return {"loss_mean": zero, "loss_var": zero, "grad_norm_mean": zero, "grad_norm_var": zero,
            "count": jnp.int32(0), "skipped_steps": jnp.int32(0)}


def _z(stats: Statistics, name: str, x: jax.Array) -> jax.Array:
    return (x - stats[f"{name}_mean"]) / jnp.sqrt(stats[f"{name}_var"] + _EPS)


def spike_check(cfg: Config, stats: Statistics, loss: jax.Array, grad_norm: jax.Array) -> dict[str, jax.Array]:
    """{"spike", "loss_z", "grad_norm_z"}: how far above their running means this step's values are."""
    s = cfg.stability
    loss_z, grad_norm_z = _z(stats, "loss", loss), _z(stats, "grad_norm", grad_norm)
    ready = stats["count"] >= s.min_history
    spike = ready & ((loss_z > s.spike_threshold) | (grad_norm_z > s.spike_threshold))
    return {"spike": spike, "loss_z": jnp.where(ready, loss_z, 0.0), "grad_norm_z": jnp.where(ready, grad_norm_z, 0.0)}


def update_statistics(cfg: Config, stats: Statistics, loss: jax.Array, grad_norm: jax.Array,
                      accepted: jax.Array) -> Statistics:
    """The statistics after a step; unchanged (bitwise) unless `accepted` (applied and finite)."""
    s = cfg.stability
    count = stats["count"]
    # A plain running mean while the history is short, then an EMA over ~window steps.
    alpha = jnp.maximum(2.0 / (s.window + 1), 1.0 / (count + 1).astype(jnp.float32))
    ready = count >= s.min_history
    new = dict(stats)
    for name, x in (("loss", loss), ("grad_norm", grad_norm)):
        mean, var = stats[f"{name}_mean"], stats[f"{name}_var"]
        band = s.spike_threshold * jnp.sqrt(var + _EPS)
        x = jnp.where(ready, jnp.clip(x, mean - band, mean + band), x)  # an outlier moves them a bounded step
        delta = x - mean
        new[f"{name}_mean"] = jnp.where(accepted, mean + alpha * delta, mean)
        new[f"{name}_var"] = jnp.where(accepted, (1.0 - alpha) * (var + alpha * delta * delta), var)
    new["count"] = jnp.where(accepted, count + 1, count)
    new["skipped_steps"] = jnp.where(accepted, stats["skipped_steps"], stats["skipped_steps"] + 1)
    return new


# ----------------------------------------------------------------------------- on the host


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

    def reset(self) -> None:
        """Forget the spikes seen (after a rollback: the steps after the target run again)."""
        self._spikes.clear()

    def observe(self, step: int, values: dict[str, Any]) -> RollbackRequest | None:
        s = self.cfg
        if values["nonfinite"]:
            self.event("nonfinite_skipped", step, loss=values["loss"], grad_norm=values["grad_norm"],
                       loss_scale=values["loss_scale"], next_loss_scale=values["next_loss_scale"])
        if not values["spike"]:
            return None
        self.event("spike", step, loss=values["loss"], grad_norm=values["grad_norm"], loss_z=values["loss_z"],
                   grad_norm_z=values["grad_norm_z"], skipped=values["skipped"])
        self._spikes.append(step)
        while self._spikes and self._spikes[0] <= step - s.window:
            self._spikes.popleft()
        if s.max_spikes > 0 and len(self._spikes) >= s.max_spikes:
            request = RollbackRequest(at_step=step, spike_steps=tuple(self._spikes))
            self._spikes.clear()
            return request
        return None


class RollbackLog:
    """`checkpoints/rollbacks.json`: every rollback of the run, written atomically by process 0."""

    NAME = "rollbacks.json"

    def __init__(self, checkpoint_dir: str, primary: bool,
                 agree: Callable[[str, Callable[[], str]], str] | None = None):
        """`agree(what, decide)`: process 0 decides, every process gets its answer
        (`Checkpointer.agree`). The records decide how many collective calls follow (one discard
        per record), so every process must see process 0's file, not its own view of the disk."""
        from jaxtrain.checkpoint.layout import to_path
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
        from jaxtrain.checkpoint.layout import write_atomic
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

    def __init__(self, cfg: Config, checkpointer: Any, record: RollbackLog | None, event: Callable[..., None]):
        self.cfg, self.checkpointer, self.record, self.event = cfg.stability, checkpointer, record, event
        self._skipped_at: int | None = None  # the step at which rolled-back batches were last skipped

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
