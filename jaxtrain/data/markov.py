"""Synthetic token sequences from a seeded random Markov chain with an exactly known entropy rate.

Each state has `branching` successors with random probabilities. Sequences start in the chain's
stationary distribution, so the best achievable next-token loss is exactly the entropy rate
`sum_s pi(s) * H(P(. | s))` in nats: a model that reaches it has learned the data.
"""

from __future__ import annotations

import numpy as np


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
