"""Which rows of each global batch a process reads.

The batch sharding decides it (`jaxtrain.parallel.sharding.process_rows`, which the trainer
passes down); the sources here only need the resulting row numbers, or fall back to the block a
batch split over every process in order gives.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxtrain.config import ConfigError


def process_rows_or_block(global_batch: int, process_index: int, process_count: int,
                          rows: Sequence[int] | None) -> np.ndarray:
    """The global rows a process reads: `rows` as given (from the batch sharding,
    `jaxtrain.parallel.sharding.process_rows`), else the contiguous block
    [p * B/P, (p+1) * B/P) that a batch split over every process in order gives.

    Raises:
      ConfigError: no `rows` and a global batch the processes do not divide; rows outside the batch.
    """
    if rows is None:
        if global_batch % process_count:
            raise ConfigError(f"data.global_batch_size={global_batch} is not divisible by the "
                              f"{process_count} processes")
        local = global_batch // process_count
        return np.arange(process_index * local, (process_index + 1) * local)
    out = np.asarray(rows, dtype=np.int64)
    if out.ndim != 1 or not len(out) or out.min() < 0 or out.max() >= global_batch:
        raise ConfigError(f"rows {out.tolist()} are not rows of a global batch of {global_batch}")
    return out
