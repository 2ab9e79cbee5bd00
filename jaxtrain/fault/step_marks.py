"""How far each process's devices got through the compiled step: the evidence for device-side hangs.

A hung device, NIC or collective stops every host of the job at the same place (reading step N's
metrics), so the host's beats alone cannot say whose device stopped. Two host callbacks inside the
compiled step time-stamp it instead, once per local device (in a `shard_map` over the whole mesh):

- the start mark of step N runs when that device has step N's inputs, i.e. once step N-1 finished
  there (it reads the state's step counter, which becomes ready only when the step that produced
  it completed); the step's data waits for it (its zero result is added to the batch's tokens), so
  a process that blocks in it holds its peers in the step's collectives;
- the end mark of step N runs once step N's loss is known on that device (it reads the loss, which
  needs the step's collectives of the forward and backward pass).

`StepMarks` keeps the latest of each per device; its `snapshot()` (the lowest over the process's
devices: the process is as far as its slowest device) travels with the watchdog's heartbeat, so
the process whose devices did not start, or did not finish, the step the others are in is the one
named (`watchdog.hang_verdict`). The drill `chaos.hang_in_step` blocks inside the start mark.

Cost: two host callbacks per local device per step (a device-to-host copy of a scalar and a short
Python call each). Compiled in for multi-process jobs on accelerators (`wanted`: blame needs peers;
`fault.step_markers: always|never` overrides); without them blame rests on the host beats and the
heartbeats alone.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain.config import Config


def wanted(cfg: Config, process_count: int, platform: str) -> bool:
    """Whether the step carries the marks (`fault.step_markers`): `auto`, multi-process jobs on an
    accelerator; `always`, every multi-process job; and any job running the in-step hang drill
    (which blocks inside the start mark). Not `auto` on the CPU: there an executable with host
    callbacks makes its dispatch wait for the step, so the host no longer queues step N+1 while
    step N runs (measured: 16 -> 42 ms a step on a tiny 2-process CPU job)."""
    mode = cfg.fault.step_markers
    multi = process_count > 1 and (mode == "always" or (mode == "auto" and platform != "cpu"))
    return multi or cfg.chaos.hang_in_step


class StepMarks:
    """The latest start and end marks of this process's devices, written by the step's host callbacks."""

    def __init__(self, local_devices: int, before_start: Optional[Callable[[int], None]] = None):
        """`local_devices`: how many devices of the mesh this process drives (each calls each mark).
        `before_start(step)`: called in the start mark of `step` before it is recorded (a drill)."""
        self.local_devices = local_devices
        self.before_start = before_start
        self._lock = threading.Lock()
        self._started: dict[int, tuple[int, float]] = {}  # device -> (step, wall time)
        self._ended: dict[int, tuple[int, float]] = {}

    def start(self, step: Any, device: Any) -> np.ndarray:
        """The start mark (a host callback): `step` is the state's counter, so step+1 is starting."""
        number = int(step) + 1
        if self.before_start is not None:
            self.before_start(number)
        with self._lock:
            self._started[int(device)] = (number, time.time())
        return np.zeros((), np.int32)

    def end(self, step: Any, loss: Any, device: Any) -> np.ndarray:
        """The end mark (a host callback): `step` is the new counter, `loss` only orders it after the loss."""
        del loss
        with self._lock:
            self._ended[int(device)] = (int(step), time.time())
        return np.zeros((), np.int32)

    def snapshot(self) -> dict[str, list]:
        """{"started": [step, wall time], "ended": [step, wall time]}: the lowest over this process's
        devices, step 0 (time None) while some device has no mark yet in this process's life."""
        with self._lock:
            return {"started": self._lowest(self._started), "ended": self._lowest(self._ended)}

    def _lowest(self, marks: dict[int, tuple[int, float]]) -> list:
        if len(marks) < self.local_devices:
            return [0, None]
        step, at = min(marks.values())
        return [step, round(at, 3)]


def with_step_marks(step_fn: Callable, mesh: Mesh, marks: StepMarks) -> Callable:
    """`step_fn(state, batch, *inputs) -> (state, metrics, ...)` (the train step's input: its chaos
    factor) with the start and end marks around it."""
    axes = tuple(mesh.axis_names)

    def on_every_device(callback: Callable, *args: jax.Array) -> jax.Array:
        def per_device(*a: jax.Array) -> jax.Array:
            return io_callback(callback, jax.ShapeDtypeStruct((), jnp.int32), *a, jax.lax.axis_index(axes))

        return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(P() for _ in args), out_specs=P(),
                             check_vma=False)(*args)

    def marked(state: dict, batch: dict, *inputs: jax.Array) -> tuple:
        token = on_every_device(marks.start, state["step"])
        # The step's data depends on the start mark: a process blocked in it never enters the step's
        # collectives, and its peers wait there (as they would for a hung host or device).
        batch = {**batch, "tokens": batch["tokens"] + token.astype(batch["tokens"].dtype)}
        out = step_fn(state, batch, *inputs)
        new_state, metrics = out[0], out[1]
        on_every_device(marks.end, new_state["step"], metrics["loss"])  # effectful: kept though unused
        return out

    return marked
