"""Input pipeline: what the trainer asks of data.

`build_train_data(cfg, process_index, process_count)` returns an iterator of this process's
share of each global batch: a dict of numpy arrays, each [global_batch / process_count, seq_len]:
  tokens (int32), targets (int32), segment_ids (int32, 0 = padding), positions (int32),
  loss_mask (float32, 0 where the target is padding).
Process p holds rows [p*b, (p+1)*b) of the global batch, which is the same whatever the number
of processes. Iterators expose `get_state()` / `set_state()` (JSON-able) for checkpoints,
`skip_batches(n)`, `entropy_floor` (nats, or None when unknown) and `last_wait_s`.
"""

from __future__ import annotations

import numpy as np

from jaxtrain.config import Config, ConfigError
from jaxtrain.data.markov import MarkovChain


class MarkovData:
    """Global batch at step s is a pure function of (data.seed, s): trivially resumable."""

    def __init__(self, cfg: Config, process_index: int, process_count: int, *, stream: int = 0):
        d = cfg.data
        self.chain = MarkovChain(d.markov_states, d.markov_branching, d.markov_temperature, seed=d.seed)
        self.seed, self.stream = d.seed, stream
        self.seq_len, self.global_batch = d.seq_len, d.global_batch_size
        if self.global_batch % process_count:
            raise ConfigError(f"data.global_batch_size={self.global_batch} is not divisible by the "
                              f"{process_count} processes")
        self.local_batch = self.global_batch // process_count
        self.row0 = process_index * self.local_batch
        self.index = 0
        self.last_wait_s = 0.0

    @property
    def entropy_floor(self) -> float:
        return self.chain.entropy_rate

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.stream, self.index])
        seqs = self.chain.sample(self.seq_len + 1, rng, self.global_batch)[self.row0:self.row0 + self.local_batch]
        self.index += 1
        b, L = self.local_batch, self.seq_len
        return {
            "tokens": seqs[:, :-1],
            "targets": seqs[:, 1:],
            "segment_ids": np.ones((b, L), np.int32),
            "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (b, L)).copy(),
            "loss_mask": np.ones((b, L), np.float32),
        }

    def get_state(self) -> dict:
        return {"index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = int(state["index"])

    def skip_batches(self, n: int) -> None:
        self.index += n


def build_train_data(cfg: Config, process_index: int = 0, process_count: int = 1):
    """The training iterator for `cfg.data`, yielding this process's rows of each global batch."""
    if cfg.data.source == "markov":
        return MarkovData(cfg, process_index, process_count)
    raise ConfigError(f"data.source={cfg.data.source} is not available in this version")


def build_eval_data(cfg: Config, process_index: int = 0, process_count: int = 1):
    """The held-out iterator (data.eval), or None when no eval source is configured."""
    if cfg.data.source == "markov" and cfg.train.eval_every:
        return MarkovData(cfg, process_index, process_count, stream=1)
    return None
