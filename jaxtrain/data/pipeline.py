"""The batch iterator: a seeded global order of packed rows, this process's share, prefetched.

Global order. Rows of the packed corpus (`SequenceSource`) are put in a Grain `MapDataset`,
shuffled with Grain's index shuffle (a seeded bijection per epoch, computed per index, so no
permutation is ever stored) and repeated with a new shuffle each epoch. Global sample g is thus a
pure function of (data.seed, g), and global batch s is samples [g0 + s*B, g0 + (s+1)*B) where
g0 is where the iterator (re)started. Nothing depends on the number of processes.

This process's share. A process builds only the rows of each global batch that its devices hold
(`rows`, from the batch sharding: `jaxtrain.parallel.sharding.process_rows`; by default process p
of P the block [p*b, (p+1)*b), b = B/P) and reads only those rows' tokens. Where a mesh axis
other than the batch's crosses hosts, two processes hold, and both read, the same rows. The
trainer assembles the global array with `jax.make_array_from_process_local_data`, so the global
batch is the same for any P and any device order.

State. The whole iterator state is `next_sample` (the next global sample index): JSON-able,
independent of P, and still meaningful if the global batch size changes on resume.

Prefetch. Batches are built ahead on one daemon thread (Grain's `ThreadPrefetchIterDataset`);
`set_state`/`skip_batches` stop it, drop what it prefetched and start again from the new place.
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import Any, Iterator, Optional, Protocol, Sequence, runtime_checkable

import grain
import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data.rows import process_rows_or_block
from jaxtrain.data.packing import FIELDS, padding_row


class RowSource(Protocol):
    """Packed training rows by index (a Grain `RandomAccessDataSource`): `packing.SequenceSource` (documents
    back to back) or `examples.ExampleRows` (chat / prompt-completion examples); each row a dict of
    `packing.FIELDS`, each [seq_len]."""

    seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, np.ndarray]: ...


@runtime_checkable
class TrainData(Protocol):
    """What the Trainer asks of a training data source (`build_train_data`: `PackedData` here,
    `jaxtrain.data.markov.MarkovData`): an iterator of this process's rows of each global batch
    (a dict of numpy arrays, `jaxtrain.train.step.BATCH_KEYS`, each [local rows, seq_len]), its
    place in the data order and a JSON-able state for checkpoints."""

    @property
    def last_wait_s(self) -> float:
        """Seconds the last `next()` waited for its batch (0 when prefetch kept up)."""
        ...

    @property
    def entropy_floor(self) -> Optional[float]:
        """The best loss the data allows, nats per token; None when unknown."""
        ...

    @property
    def num_batches(self) -> Optional[int]:
        """Global batches in one pass over the data; None when endless."""
        ...

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]: ...

    def __next__(self) -> dict[str, np.ndarray]: ...

    @property
    def position(self) -> int:
        """Global batches drawn so far: the index of the next batch in the data order."""
        ...

    def get_state(self) -> dict:
        """JSON-able position (for the checkpoint's extras)."""
        ...

    def set_state(self, state: dict) -> None:
        """Continue from `state` (from `get_state`)."""
        ...

    def skip_batches(self, n: int) -> None:
        """Skip the next `n` global batches (a rollback past a bad data window)."""
        ...

    def batch_stats(self, position: int) -> dict:
        """Fields for metrics.jsonl about global batch `position` (a mixture's rows and tokens per component;
        {} for a single source)."""
        ...

    def reset(self) -> None:
        """Back to the first batch."""
        ...

    def close(self) -> None:
        """Stop background threads (a later `next()` starts them again)."""
        ...


def seeded_order(source: RowSource, seed: int, shuffle: bool, repeat: bool) -> grain.MapDataset:
    """`source`'s rows in the global order: Grain's seeded index shuffle (a new one each epoch) when
    `shuffle`, repeated endlessly when `repeat`; element g is a pure function of (seed, g)."""
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat()  # reshuffles each epoch (the shuffle's seed moves with the epoch)
    return ds


class _Holder:
    """Owns the running Grain iterator, so a finalizer can close it without referencing PackedData."""

    def __init__(self):
        self.it = None

    def close(self) -> None:
        it, self.it = self.it, None
        if it is not None:
            it.close()


class _Rows:
    """Builds this process's rows of a global batch. The prefetch thread's map function holds this,
    not the PackedData: were it to hold the PackedData, the running iterator would keep it alive, the
    finalizer that closes the iterator would never run, and every unclosed iterator and its thread
    would live until exit."""

    def __init__(self, samples: Any, rows: np.ndarray, padding: dict, fields: tuple[str, ...]):
        self.samples, self.rows, self.padding, self.fields = samples, rows, padding, fields

    def batch(self, first_sample: int) -> dict[str, np.ndarray]:
        """This process's rows of the global batch that starts at global sample `first_sample`."""
        rows = []
        for r in self.rows:
            g = first_sample + int(r)
            # Past the end of a non-repeating source (eval): padding, which the loss ignores.
            rows.append(self.samples[g] if g < len(self.samples) else self.padding)
        return {k: np.stack([row[k] for row in rows]) for k in self.fields}


class PackedData:
    """This process's rows of each global batch of packed sequences (see the module docstring).

    Attributes:
      rows: the global rows of each batch this process builds, in order.
      local_batch: how many (global_batch / process_count unless processes share rows).
      num_sequences: rows in one epoch of the source.
      num_batches: global batches in one pass over the source (for eval: a full pass).
      last_wait_s: seconds the last `next()` waited for its batch (0 when prefetch kept up).
      entropy_floor: None (unknown for real data).
    """

    def __init__(self, source: RowSource, *, global_batch: int, process_index: int, process_count: int,
                 seed: int, shuffle: bool, repeat: bool, prefetch: int, rows: Sequence[int] | None = None,
                 key: str = "data.path", samples: Any = None, fields: tuple[str, ...] = FIELDS):
        """`samples`: the global sample sequence (`samples[g]` = global sample g, endless when repeating) in place
        of `source`'s own seeded order (a mixture passes its mixed order; `source` then only gives the sizes);
        `fields`: the keys of each batch."""
        rows = process_rows_or_block(global_batch, process_index, process_count, rows)
        if len(source) == 0:
            raise ConfigError(f"{key}: the data fills no training row (packing needs at least 2 tokens)")
        if repeat and len(source) < global_batch:
            # Training: every row of a global batch would repeat within the batch (and each process's share
            # of the first epoch would not exist), so a corpus this small is a mistake, refused before anything starts.
            raise ConfigError(f"{key}: the data fills {len(source)} row(s) of data.seq_len={source.seq_len} tokens, "
                              f"fewer than one global batch (data.global_batch_size={global_batch}); add data or "
                              "lower data.global_batch_size / data.seq_len")
        self.seq_len = source.seq_len
        self.global_batch = global_batch
        self.rows = rows
        self.local_batch = len(rows)
        self.num_sequences = len(source)
        self.num_batches = -(-self.num_sequences // global_batch)
        self.prefetch = prefetch
        if samples is None:
            samples = seeded_order(source, seed, shuffle, repeat)
        self._rows = _Rows(samples, self.rows, padding_row(self.seq_len), fields)
        self.next_sample = 0
        self.last_wait_s = 0.0
        self.entropy_floor: Optional[float] = None
        self._holder = _Holder()
        # Close the background thread at interpreter exit even if nobody calls close():
        # Grain's own finalizer would otherwise run during module teardown and complain.
        weakref.finalize(self, self._holder.close)
        self._start()

    # ------------------------------------------------------------------ building batches

    def _start(self) -> None:
        g0, B, rows = self.next_sample, self.global_batch, self._rows  # no `self` in the lambda (see _Rows)
        batches = grain.MapDataset.range(0, sys.maxsize).map(lambda k: rows.batch(g0 + k * B))
        it = batches.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        if self.prefetch > 0:
            it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=self.prefetch)
        self._holder.it = iter(it)
        if self.prefetch > 0:
            self._holder.it.start_prefetch()  # start now: the first batch is ready while the step compiles

    # ------------------------------------------------------------------ iterator protocol

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._holder.it is None:  # closed earlier: start again where we are
            self._start()
        t0 = time.perf_counter()
        batch = next(self._holder.it)
        self.last_wait_s = time.perf_counter() - t0
        self.next_sample += self.global_batch
        return batch

    @property
    def position(self) -> int:
        """Global batches drawn so far: the index of the next batch in the data order."""
        return self.next_sample // self.global_batch

    def get_state(self) -> dict:
        """JSON-able position: the global sample index of the next batch's first row."""
        return {"next_sample": self.next_sample}

    def set_state(self, state: dict) -> None:
        """Continue from `state` (from `get_state`); what was prefetched is discarded."""
        next_sample = state.get("next_sample") if isinstance(state, dict) else None
        # Accept numpy integers too: a checkpoint library may hand back np.int64.
        if not isinstance(next_sample, (int, np.integer)) or next_sample < 0:
            raise ConfigError(f"the data state {state!r} (from a checkpoint?) has no valid 'next_sample': it was "
                              "written for another data.source; resume with the same data.source")
        self._holder.close()
        self.next_sample = int(next_sample)
        self._start()

    def skip_batches(self, n: int) -> None:
        """Skip the next `n` global batches (rollback past a bad data window)."""
        self.set_state({"next_sample": self.next_sample + n * self.global_batch})

    def reset(self) -> None:
        """Back to the first batch (eval: call before each evaluation)."""
        self.set_state({"next_sample": 0})

    def batch_stats(self, position: int) -> dict:
        """Nothing per batch for a single source (a mixture's rows per component: `mixture.MixtureData`)."""
        return {}

    def close(self) -> None:
        """Stop the prefetch thread and drop its batches. A later `next()` starts it again."""
        self._holder.close()
