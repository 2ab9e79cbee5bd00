"""Held-out loss, computed on the parameters of the step it is reported with.

The loop queues an evaluation right after the step it belongs to (before the next step is
queued and donates the state), and reads the result when that step is logged: the device never
waits for the host, and `eval_loss` at step N is the loss of the parameters after step N.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxtrain.config import Config
from jaxtrain.data import build_eval_data
from jaxtrain.parallel.sharding import global_batch, process_rows
from jaxtrain.train.state import StateLayout, init_moe_state
from jaxtrain.train.step import BATCH_KEYS, make_eval_step, partitioning

PendingEval = list[tuple[jax.Array, jax.Array]]  # (loss sum, token count) per batch, on device


class Evaluator:
    """Mean loss per token on `data.eval` (or the Markov source's held-out stream)."""

    def __init__(self, cfg: Config, layout: StateLayout, process_index: int, process_count: int):
        self.cfg, self.layout = cfg, layout
        self.process_index, self.process_count = process_index, process_count
        self.every = cfg.train.eval_every
        part = partitioning(cfg, layout.mesh, layout.rules)
        # MoE: the routing bias (train state `moe.router_bias`) chooses experts at evaluation too.
        self._moe = cfg.model.num_experts > 0
        self._step = jax.jit(make_eval_step(layout.graphdef, part),
                             in_shardings=(layout.param_shardings, layout.batch_sharding)
                             + ((layout.replicated,) if self._moe else ()),
                             out_shardings=(layout.replicated, layout.replicated))

    def due(self, step: int) -> bool:
        """Whether step `step` is an evaluation step (train.eval_every)."""
        return self.every > 0 and step % self.every == 0

    def dispatch(self, params: Any, num_batches: int | None = None, router_bias: Any = None) -> PendingEval | None:
        """Queue the evaluation of `params` on the device; None when there is no eval data.
        `router_bias`: the MoE routing bias of the state (zeros when None)."""
        size = self.cfg.data.global_batch_size
        rows = process_rows(self.layout.mesh, self.layout.rules, size, self.process_index)
        data = build_eval_data(self.cfg, self.process_index, self.process_count, rows=rows)
        if data is None:
            return None
        try:
            pending = []
            for _ in range(num_batches or self.cfg.train.eval_batches):
                local = next(data)
                batch = global_batch({k: local[k] for k in BATCH_KEYS}, self.layout.mesh, self.layout.rules, size)
                if self._moe:
                    bias = router_bias if router_bias is not None else init_moe_state(self.cfg)["router_bias"]
                    pending.append(self._step(params, batch, bias))
                else:
                    pending.append(self._step(params, batch))
        finally:
            if hasattr(data, "close"):
                data.close()
        return pending

    @staticmethod
    def result(pending: PendingEval | None) -> float | None:
        """Read a dispatched evaluation (a host sync): mean loss per counted token."""
        if pending is None:
            return None
        sums = jax.device_get(pending)
        total = sum(float(loss) for loss, _ in sums)
        count = sum(float(tokens) for _, tokens in sums)
        return total / max(count, 1.0)

    def evaluate(self, params: Any, num_batches: int | None = None, router_bias: Any = None) -> float | None:
        """Evaluate `params` now (notebooks, tests)."""
        return self.result(self.dispatch(params, num_batches, router_bias))
