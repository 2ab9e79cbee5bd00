"""Held-out loss, computed on the parameters of the step it is reported with.

The loop queues an evaluation right after the step it belongs to (before the next step is
queued and donates the state), and reads the result when that step is logged: the device never
waits for the host, and `eval_loss` at step N is the loss of the parameters after step N.

What one evaluation covers (`train.eval_batches`, docs/data.md "Evaluation"):
- 0 (the default): the whole `data.eval` set, one pass: every packed row once, the last partial
  batch padded with rows the loss mask leaves out, so the mean is exact over every eval token;
- N > 0: a cap of N global batches spread over the set (the middle batch of each of N equal
  parts), not its first N batches, which would favour the first files;
- the Markov source's held-out stream is endless: 0 there means `MARKOV_EVAL_BATCHES` batches.
Every process runs the same batches (the plan depends only on the config and the set's size) and
reads the replicated sums of the global batch, so every process gets the same result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax

from jaxtrain.config import Config
from jaxtrain.data import build_eval_data
from jaxtrain.parallel.sharding import global_batch, process_rows
from jaxtrain.train.state import StateLayout, init_moe_state
from jaxtrain.train.step import BATCH_KEYS, make_eval_step, partitioning

MARKOV_EVAL_BATCHES = 4  # batches per evaluation of the (endless) Markov held-out stream when uncapped
# Batches queued on the device before the host reads the oldest back: bounds the device memory that
# queued eval batches hold (the host would otherwise copy a whole eval set to the device ahead of it).
MAX_IN_FLIGHT = 16


class EvalResult(NamedTuple):
    """One evaluation: mean loss per counted token, and how many tokens were counted."""
    loss: float
    tokens: int


@dataclasses.dataclass
class PendingEval:
    """An evaluation queued on the device: float64 host sums of the batches read back so far, and the
    (loss sum, token count) device scalars of the batches still queued."""
    loss_sum: float = 0.0
    tokens: float = 0.0
    queued: list[tuple[jax.Array, jax.Array]] = dataclasses.field(default_factory=list)
    progress: Callable[[], None] | None = None  # called as each batch is read back (Evaluator.on_progress)

    def read_oldest(self) -> None:
        """Move the oldest queued batch's sums to the host (waits for that batch)."""
        loss, tokens = jax.device_get(self.queued.pop(0))
        self.loss_sum += float(loss)
        self.tokens += float(tokens)
        if self.progress is not None:
            self.progress()


def eval_batch_plan(num_batches: int | None, cap: int) -> list[int]:
    """The global batch indices one evaluation reads, in order.

    Args:
      num_batches: global batches in one pass over the eval set (None: an endless stream).
      cap: at most this many batches (0 = no cap: the whole set; an endless stream gets
        MARKOV_EVAL_BATCHES).
    Returns:
      Every batch index when uncapped (or the cap covers the set); otherwise `cap` indices spread over
      the set: the middle batch of each of `cap` equal parts.
    """
    if num_batches is None:
        return list(range(cap or MARKOV_EVAL_BATCHES))
    if cap <= 0 or cap >= num_batches:
        return list(range(num_batches))
    return [(2 * k + 1) * num_batches // (2 * cap) for k in range(cap)]


class Evaluator:
    """Mean loss per token on `data.eval` (or the Markov source's held-out stream)."""

    def __init__(self, cfg: Config, layout: StateLayout, process_index: int, process_count: int):
        self.cfg, self.layout = cfg, layout
        self.process_index, self.process_count = process_index, process_count
        self.every = cfg.train.eval_every
        # A held-out set without train.eval_every is still evaluated once, after the last step: a user
        # who names data.eval expects an eval_loss.
        self.at_end = self.every == 0 and bool(cfg.data.eval)
        # Told as each batch is read back: a whole-set evaluation longer than fault.hang_timeout_s is
        # progress, not a hang (the loop passes the watchdog's `progress`).
        self.on_progress: Callable[[], None] | None = None
        part = partitioning(cfg, layout.mesh, layout.rules)
        # MoE: the routing bias (train state `moe.router_bias`) chooses experts at evaluation too.
        self._moe = cfg.model.num_experts > 0
        self._step = jax.jit(make_eval_step(layout.graphdef, part),
                             in_shardings=(layout.param_shardings, layout.batch_sharding)
                             + ((layout.replicated,) if self._moe else ()),
                             out_shardings=(layout.replicated, layout.replicated))

    def due(self, step: int) -> bool:
        """Whether step `step` is an evaluation step: every train.eval_every steps, or, with data.eval
        set and eval_every 0, the last step (train.steps)."""
        if self.every > 0:
            return step % self.every == 0
        return self.at_end and step == self.cfg.train.steps

    def dispatch(self, params: Any, num_batches: int | None = None, router_bias: Any = None) -> PendingEval | None:
        """Queue the evaluation of `params` on the device; None when there is no eval data.

        Args:
          params: the model parameters (the train state's `params`).
          num_batches: the cap for this evaluation (None: train.eval_batches; 0: the whole set;
            see `eval_batch_plan`).
          router_bias: the MoE routing bias of the state (zeros when None).
        """
        size = self.cfg.data.global_batch_size
        cap = self.cfg.train.eval_batches if num_batches is None else num_batches
        rows = process_rows(self.layout.mesh, self.layout.rules, size, self.process_index)
        # A spread cap jumps between batches: prefetching would read batches that are then dropped.
        data = build_eval_data(self.cfg, self.process_index, self.process_count, rows=rows,
                               prefetch=0 if cap > 0 else None)
        if data is None:
            return None
        pending = PendingEval(progress=self.on_progress)
        try:
            for index in eval_batch_plan(data.num_batches, cap):
                if index != data.position:
                    data.skip_batches(index - data.position)
                local = next(data)
                batch = global_batch({k: local[k] for k in BATCH_KEYS}, self.layout.mesh, self.layout.rules, size)
                if self._moe:
                    bias = router_bias if router_bias is not None else init_moe_state(self.cfg)["router_bias"]
                    pending.queued.append(self._step(params, batch, bias))
                else:
                    pending.queued.append(self._step(params, batch))
                if len(pending.queued) > MAX_IN_FLIGHT:
                    pending.read_oldest()
        finally:
            if hasattr(data, "close"):
                data.close()
        return pending

    @staticmethod
    def read(pending: PendingEval | None) -> EvalResult | None:
        """Read a dispatched evaluation (a host sync): mean loss per counted token and the count.
        The sums are added in float64 on the host, batch by batch."""
        if pending is None:
            return None
        while pending.queued:
            pending.read_oldest()
        tokens = int(round(pending.tokens))
        return EvalResult(pending.loss_sum / max(pending.tokens, 1.0), tokens)

    @staticmethod
    def result(pending: PendingEval | None) -> float | None:
        """Read a dispatched evaluation (a host sync): mean loss per counted token (see `read`)."""
        outcome = Evaluator.read(pending)
        return None if outcome is None else outcome.loss

    def run(self, params: Any, num_batches: int | None = None, router_bias: Any = None) -> EvalResult | None:
        """Evaluate `params` now: (mean loss per token, tokens counted), or None without eval data."""
        return self.read(self.dispatch(params, num_batches, router_bias))

    def evaluate(self, params: Any, num_batches: int | None = None, router_bias: Any = None) -> float | None:
        """Evaluate `params` now (notebooks, tests): the mean loss per token only (see `run`)."""
        outcome = self.run(params, num_batches, router_bias)
        return None if outcome is None else outcome.loss
