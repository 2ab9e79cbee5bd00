"""Host values shared across processes without stalling the device: gather now, read one step later.

Each process puts a small row of numbers (flags, step times) into one tiny device all-gather,
queued behind the step it belongs to. The result is read after the next step has been queued, by
which time it has long finished: the host never waits for the device on its account, and every
process reads the same table at the same step. Used at sync points only (every N steps), never on
ordinary steps.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


class LateAllGather:
    """`start(step, row)` on every process at the same step; `result(step + 1)` gives every row."""

    def __init__(self, mesh: Mesh):
        self.process_count = jax.process_count()
        self._local_devices = len(mesh.local_devices)
        self._sharding = NamedSharding(mesh, P(mesh.axis_names))  # one row per device, in mesh order
        self._owner = np.array([d.process_index for d in mesh.devices.flat])  # row i's process
        self._gather = jax.jit(lambda rows: rows, out_shardings=NamedSharding(mesh, P()))
        self._pending: tuple[int, jax.Array] | None = None

    def start(self, step: int, row: np.ndarray) -> None:
        """Queue this process's `row` (1-D float64-convertible) for the gather of `step`."""
        rows = np.tile(np.asarray(row, np.float64)[None, :], (self._local_devices, 1)).astype(np.float32)
        self._pending = (step, self._gather(jax.make_array_from_process_local_data(self._sharding, rows)))

    def result(self, step: int) -> np.ndarray | None:
        """The gathered table [process, len(row)] if a gather was started at `step - 1`, else None."""
        if self._pending is None or self._pending[0] != step - 1:
            return None
        table = np.asarray(self._pending[1].addressable_data(0))  # replicated: any local copy is all of it
        self._pending = None
        out = np.zeros((self.process_count, table.shape[1]), np.float64)
        for process in range(self.process_count):
            out[process] = table[np.argmax(self._owner == process)]
        return out
