"""Weighted mixtures of sources (`data.mixture`): which component each global sample comes from.

Global order. Global sample g (row g of the endless training sequence; global batch s holds samples
[s*B, (s+1)*B)) is drawn from component c(g), chosen by a uniform number that is a pure function of
(data.seed, g): Philox keyed by the seed and g's block of 4,096 samples. The weights are those of the
phase g falls in (`data.mixture_schedule`: phases start at batch positions, i.e. at steps when no
rollback skipped batches). Within component c, g takes the next row of c's own order: the rows of
c's source in a Grain index shuffle seeded by (data.seed, c's name), a new shuffle each epoch, so a
component repeats on its own clock when it runs out. So the rows a batch holds are a pure function
of (seed, components, weights, batch position): nothing depends on the number of processes, and
each process reads only the rows its devices hold.

Weights count tokens (`data.mixture_unit: tokens`, the default: every row is seq_len positions, so a
row weight is a token weight) or documents (`documents`: a component's row weight is its weight
times its rows per document, so each component's share of documents drawn follows the weights).

Resume. The state is the next sample and how many rows each component has given so far (by name).
The same mixture resumes exactly where an uninterrupted run would be, onto any process count. A
*changed* mixture (weights, components or schedule) starts a new order from the resumed batch: each
component kept continues its own order from its count (nothing it already gave repeats before its
epoch ends), a new component starts at its first row, a dropped one stops, and the new weights apply
from that batch on. The change is logged once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import zlib
from typing import Sequence

import numpy as np

from jaxtrain.config import Config, ConfigError, MixtureComponent, MixturePhase
from jaxtrain.data.packing import FIELDS
from jaxtrain.data.pipeline import PackedData, RowSource, seeded_order

log = logging.getLogger(__name__)

BLOCK = 4096  # samples per Philox block of component choices (the unit of the cached counts)


def documents_in(source: RowSource) -> int:
    """How many documents (or examples) a component's rows hold: `num_documents` of the source."""
    n = getattr(source, "num_documents", None)
    if not isinstance(n, (int, np.integer)) or n <= 0:
        raise TypeError(f"{type(source).__name__} has no positive num_documents (data.mixture_unit=documents)")
    return int(n)


def row_weights(phases: Sequence[MixturePhase], sources: Sequence[RowSource], unit: str) -> np.ndarray:
    """[phases, components] probabilities that a row comes from each component, per phase."""
    w = np.array([p.weights for p in phases], dtype=np.float64)
    if unit == "documents":  # a document of c fills len(c)/docs(c) rows on average
        w = w * np.array([len(s) / documents_in(s) for s in sources])
    return w / w.sum(axis=1, keepdims=True)


class MixedOrder:
    """Component choices and within-component counts of the global samples (see the module docstring).

    `locate(g)` -> (component, index within the component's order). Counts are kept from an anchor
    (a sample and the counts there: 0 and zeros for a fresh run, the checkpoint's on resume) and cached
    per block, so asking for any g after the anchor costs at most one block of draws plus those since
    the last cached block. Thread-safe: the prefetch thread and the trainer both ask.
    """

    def __init__(self, seed: int, phase_starts: Sequence[int], probabilities: np.ndarray):
        self.seed = seed
        self.phase_starts = np.asarray(phase_starts, dtype=np.int64)  # first global sample of each phase
        self.cumulative = np.cumsum(probabilities, axis=1)
        self.cumulative[:, -1] = 1.0  # rounding must never leave a draw past the last component
        self.num_components = probabilities.shape[1]
        self._lock = threading.Lock()
        self.set_anchor(0, np.zeros(self.num_components, np.int64))

    def choices(self, block: int) -> np.ndarray:
        """The component of every sample of `block` (samples [block*BLOCK, (block+1)*BLOCK))."""
        u = np.random.Generator(np.random.Philox(key=[self.seed, block])).random(BLOCK)
        g = block * BLOCK + np.arange(BLOCK, dtype=np.int64)
        phase = np.searchsorted(self.phase_starts, g, side="right") - 1
        return (u[:, None] >= self.cumulative[phase]).sum(axis=1).astype(np.int64)

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(choices, within[i] = rows each component gave to the block's first i samples), cached: batches
        ask for the same few blocks over and over."""
        hit = self._recent.get(block)
        if hit is None:
            c = self.choices(block)
            within = np.zeros((BLOCK + 1, self.num_components), np.int64)
            within[1:] = np.cumsum(np.eye(self.num_components, dtype=np.int64)[c], axis=0)
            hit = self._recent[block] = (c, within)
            if len(self._recent) > 4:
                self._recent.pop(next(iter(self._recent)))
        return hit

    def set_anchor(self, sample: int, counts: np.ndarray) -> None:
        """Counts are `counts` at global sample `sample`; later samples are counted from there."""
        with self._lock:
            self.anchor = int(sample)
            self.anchor_counts = np.asarray(counts, dtype=np.int64).copy()
            self._starts: list[np.ndarray] = []  # counts at the start of block anchor//BLOCK + i + 1
            self._recent: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def counts_at(self, g: int) -> np.ndarray:
        """Rows each component gave to samples before `g` (g >= the anchor)."""
        if g < self.anchor:
            raise ValueError(f"sample {g} is before the anchor {self.anchor}")
        with self._lock:
            first, block = self.anchor // BLOCK, g // BLOCK
            while len(self._starts) < block - first:  # counts at each block start up to g's block
                b = first + len(self._starts)
                _, within = self._block(b)
                prev = self._starts[-1] if self._starts else self.anchor_counts - within[self.anchor - b * BLOCK]
                self._starts.append(prev + within[BLOCK])
            if block == first:
                base = self.anchor_counts - self._block(block)[1][self.anchor - block * BLOCK]
            else:
                base = self._starts[block - first - 1]
            return base + self._block(block)[1][g - block * BLOCK]

    def locate(self, g: int) -> tuple[int, int]:
        """(component of sample g, how many rows that component gave before g)."""
        counts = self.counts_at(g)
        with self._lock:
            c = int(self._block(g // BLOCK)[0][g % BLOCK])
        return c, int(counts[c])


class _MixedSamples:
    """The global sample sequence of a mixture: `[g]` is the row sample g draws (with its component id)."""

    def __init__(self, order: MixedOrder, components: list):
        self.order, self.components = order, components

    def __len__(self) -> int:
        return 1 << 62  # endless (a repeating order)

    def __getitem__(self, g: int) -> dict[str, np.ndarray]:
        c, j = self.order.locate(g)
        return {**self.components[c][j], "component": np.int32(c)}


def fingerprint(components: Sequence[MixtureComponent], phases: Sequence[MixturePhase], unit: str, seed: int) -> str:
    """What decides the order besides the position: equal fingerprints resume exactly."""
    spec = {"components": [[c.name, c.path, c.source, c.format] for c in components],
            "phases": [[p.step, list(p.weights)] for p in phases], "unit": unit, "seed": seed}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


class MixtureData(PackedData):
    """This process's rows of each global batch of a mixture (a `TrainData`; see the module docstring).

    Each batch also holds `component` (int32 [local rows]): the index, in `names`, of each row's component.
    """

    def __init__(self, cfg: Config, components: Sequence[MixtureComponent], sources: Sequence[RowSource], *,
                 process_index: int, process_count: int, rows: Sequence[int] | None = None):
        d = cfg.data
        self.names = [c.name for c in components]
        phases = d.mixture_phases()
        for c, s in zip(components, sources):
            if len(s) == 0:
                raise ConfigError(f"data.mixture ({c.name}): '{c.path}' fills no training row")
        probabilities = row_weights(phases, sources, d.mixture_unit)
        self.order = MixedOrder(d.seed, [p.step * d.global_batch_size for p in phases], probabilities)
        self.fingerprint = fingerprint(components, phases, d.mixture_unit, d.seed)
        # Each component's own order: seeded by its name, so adding or reordering components changes no other's.
        orders = [seeded_order(s, (d.seed + zlib.crc32(c.name.encode())) % 2**32, d.shuffle, repeat=True)
                  for c, s in zip(components, sources)]
        total = _TotalRows(sources)
        super().__init__(total, global_batch=d.global_batch_size, process_index=process_index,
                         process_count=process_count, seed=d.seed, shuffle=d.shuffle, repeat=True,
                         prefetch=d.prefetch, rows=rows, key="data.mixture",
                         samples=_MixedSamples(self.order, orders), fields=FIELDS + ("component",))
        self.num_batches = None  # a mixture has no single pass

    # ------------------------------------------------------------------ state

    def get_state(self) -> dict:
        """The next sample, each component's rows given so far (by name), and the mixture's fingerprint."""
        counts = self.order.counts_at(self.next_sample)
        return {"next_sample": self.next_sample, "mixture": self.fingerprint,
                "component_rows": {n: int(k) for n, k in zip(self.names, counts)}}

    def set_state(self, state: dict) -> None:
        """Continue from `state`: exactly, for the same mixture; a new order from there for a changed one."""
        if not isinstance(state, dict) or not isinstance(state.get("component_rows"), dict):
            raise ConfigError(f"the data state {state!r} (from a checkpoint?) holds no mixture position: it was "
                              "written without data.mixture; resume with the data it was written with")
        rows = state["component_rows"]
        next_sample = state.get("next_sample")
        if not isinstance(next_sample, (int, np.integer)) or next_sample < 0 or \
                not all(isinstance(v, (int, np.integer)) and v >= 0 for v in rows.values()):
            raise ConfigError(f"the data state {state!r} (from a checkpoint?) is not a valid mixture position")
        if state.get("mixture") != self.fingerprint:
            log.warning("data.mixture changed since the checkpoint (components %s then, %s now): a new order from "
                        "batch %d, each kept component continuing from its count", sorted(rows), self.names,
                        int(next_sample) // self.global_batch)
        self.order.set_anchor(int(next_sample), np.array([int(rows.get(n, 0)) for n in self.names], np.int64))
        super().set_state({"next_sample": int(next_sample)})

    def skip_batches(self, n: int) -> None:
        """Skip the next `n` global batches (the counts follow the draws of the skipped samples)."""
        PackedData.set_state(self, {"next_sample": self.next_sample + n * self.global_batch})

    def reset(self) -> None:
        """Back to the first batch."""
        self.order.set_anchor(0, np.zeros(len(self.names), np.int64))
        PackedData.set_state(self, {"next_sample": 0})

    # ------------------------------------------------------------------ statistics

    def batch_stats(self, position: int) -> dict:
        """metrics.jsonl's mixture fields for global batch `position`: its rows per component
        (`data_rows`), and the tokens each component has given through it (`data_tokens`: rows x seq_len,
        padding of packed examples included)."""
        first = position * self.global_batch
        before, after = self.order.counts_at(first), self.order.counts_at(first + self.global_batch)
        return {"data_rows": {n: int(a - b) for n, a, b in zip(self.names, after, before)},
                "data_tokens": {n: int(a) * self.seq_len for n, a in zip(self.names, after)}}


class _TotalRows:
    """The sizes `PackedData` checks, for all components together."""

    def __init__(self, sources: Sequence[RowSource]):
        self.seq_len = sources[0].seq_len
        self._len = sum(len(s) for s in sources)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int):  # never read: the mixture passes its own samples
        raise IndexError(i)

