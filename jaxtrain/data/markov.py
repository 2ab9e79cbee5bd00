"""Synthetic token sequences from a seeded random Markov chain with an exactly known entropy rate.

Each state has `branching` successors with random probabilities. Sequences start in the chain's
stationary distribution, so the best achievable next-token loss is exactly the entropy rate
`sum_s pi(s) * H(P(. | s))` in nats: a model that reaches it has learned the data.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from jaxtrain.config import Config
from jaxtrain.data.rows import process_rows_or_block


class MarkovChain:
    """A sparse random Markov chain over `states` tokens (token ids 0..states-1)."""

    def __init__(self, states: int, branching: int, temperature: float = 1.0, seed: int = 0):
        rng = np.random.default_rng([seed, 0x6D61726B])  # 'mark': keeps it apart from other seeded streams
        self.states, self.branching = states, branching
        self.successors = np.stack([rng.choice(states, size=branching, replace=False) for _ in range(states)])
        logits = rng.normal(size=(states, branching)) / max(temperature, 1e-6)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        self.probs = probs / probs.sum(axis=1, keepdims=True)
        self.cumprobs = np.cumsum(self.probs, axis=1)
        self.cumprobs[:, -1] = 1.0
        self.stationary = self._stationary()
        self.stationary_cum = np.cumsum(self.stationary)
        self.stationary_cum[-1] = 1.0

    def _stationary(self, iters: int = 10_000, tol: float = 1e-13) -> np.ndarray:
        # Power iteration on the sparse transition table; a lazy step (half stay) makes it converge
        # even for periodic chains and has the same stationary distribution.
        pi = np.full(self.states, 1.0 / self.states)
        for _ in range(iters):
            nxt = np.zeros_like(pi)
            np.add.at(nxt, self.successors.ravel(), (pi[:, None] * self.probs).ravel())
            nxt = 0.5 * pi + 0.5 * nxt
            if np.abs(nxt - pi).sum() < tol:
                return nxt / nxt.sum()
            pi = nxt
        return pi / pi.sum()

    @property
    def entropy_rate(self) -> float:
        """Exact entropy rate in nats per token: the floor for the next-token cross-entropy."""
        h = -(self.probs * np.log(np.maximum(self.probs, 1e-300))).sum(axis=1)
        return float((self.stationary * h).sum())

    def sample(self, length: int, rng: np.random.Generator, batch: int) -> np.ndarray:
        """`batch` sequences of `length` tokens, as int32 [batch, length]."""
        out = np.empty((batch, length), dtype=np.int32)
        cur = np.searchsorted(self.stationary_cum, rng.random(batch), side="right").clip(0, self.states - 1)
        out[:, 0] = cur
        for t in range(1, length):
            choice = (rng.random(batch)[:, None] > self.cumprobs[cur]).sum(axis=1)
            cur = self.successors[cur, choice]
            out[:, t] = cur
        return out


class MarkovData:
    """Global batch at step s is a pure function of (data.seed, s): trivially resumable. A
    `jaxtrain.data.pipeline.TrainData`, like the packed sources."""

    def __init__(self, cfg: Config, process_index: int, process_count: int, *, stream: int = 0,
                 rows: Sequence[int] | None = None):
        d = cfg.data
        self.chain = MarkovChain(d.markov_states, d.markov_branching, d.markov_temperature, seed=d.seed)
        self.seed, self.stream = d.seed, stream
        self.seq_len, self.global_batch = d.seq_len, d.global_batch_size
        self.rows = process_rows_or_block(self.global_batch, process_index, process_count, rows)
        self.local_batch = len(self.rows)
        self.index = 0
        self.last_wait_s = 0.0  # sampled in next() itself, on demand (cheap at test sizes)
        self.num_batches = None  # endless: every index is a fresh sample

    @property
    def entropy_floor(self) -> float:
        return self.chain.entropy_rate

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        rng = np.random.default_rng([self.seed, self.stream, self.index])
        seqs = self.chain.sample(self.seq_len + 1, rng, self.global_batch)[self.rows]
        self.index += 1
        b, L = self.local_batch, self.seq_len
        self.last_wait_s = time.perf_counter() - t0
        return {
            "tokens": seqs[:, :-1],
            "targets": seqs[:, 1:],
            "segment_ids": np.ones((b, L), np.int32),
            "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (b, L)).copy(),
            "loss_mask": np.ones((b, L), np.float32),
        }

    @property
    def position(self) -> int:
        """Global batches drawn so far: the index of the next batch in the data order."""
        return self.index

    def get_state(self) -> dict:
        return {"index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = int(state["index"])

    def skip_batches(self, n: int) -> None:
        self.index += n

    def batch_stats(self, position: int) -> dict:
        """Nothing per batch (one synthetic source)."""
        return {}

    def reset(self) -> None:
        self.index = 0

    def close(self) -> None:
        """Nothing to stop: batches are sampled on demand."""
