"""Packing: cut the token stream into training rows with segment ids, positions and a loss mask.

The stream (documents one after another, each ended by the eod id) is cut into fixed windows:
row i holds stream tokens [i*L, i*L + L + 1), so every token but the first is a target exactly
once and nothing is padded except the very last row. This is concat-and-split packing, as in
GPT-2 and most pre-training pipelines; a document longer than what is left of a row continues in
the next row of the stream (that row is shuffled elsewhere, so the continuation is a new segment
without its beginning).

Within a row, each document is its own segment (ids 1, 2, ...; 0 = padding) and its positions
restart at 0, so attention (masked by segment id) never crosses a document boundary. The eod id
belongs to the document it ends: the model learns to predict it after the last token. The target
of the eod itself (the next document's first token) is masked out of the loss: with attention cut
at the boundary there is nothing to predict it from. Row layout, L = seq_len:

  stream window  a1 a2 a3 EOD b1 b2 | b3      (L + 1 tokens)
  tokens         a1 a2 a3 EOD b1 b2
  targets        a2 a3 EOD b1 b2 b3
  segment_ids     1  1  1   1  2  2
  positions       0  1  2   3  0  1
  loss_mask       1  1  1   0  1  1
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from jaxtrain.data.sources import Corpus

FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
_SCAN = 1 << 24  # tokens per step when counting documents (bounded memory)


def pack_window(window: np.ndarray, file_start: np.ndarray, seq_len: int, eod_id: Optional[int]) -> dict[str, np.ndarray]:
    """One training row from up to seq_len + 1 consecutive stream tokens.

    Args:
      window: int token ids [n], 1 <= n <= seq_len + 1 (n < seq_len + 1 only at the stream's end).
      file_start: bool [n], True where a file (and so a document) begins.
      seq_len: L, the row length.
      eod_id: the end-of-document id, or None when only file starts begin documents.
    Returns:
      tokens, targets, segment_ids, positions (int32 [L]) and loss_mask (float32 [L]).
    """
    n, L = len(window), seq_len
    full = np.zeros(L + 1, np.int32)
    full[:n] = window
    starts = np.zeros(L + 1, bool)
    starts[:n] = file_start
    starts[0] = n > 0  # a row always opens a segment (possibly the middle of a document)
    if eod_id is not None and n > 1:
        starts[1:n] |= window[:-1] == eod_id  # the token after an eod begins a new document
    seg = np.cumsum(starts, dtype=np.int32)
    seg[n:] = 0  # padding
    idx = np.arange(L + 1, dtype=np.int32)
    pos = idx - np.maximum.accumulate(np.where(starts, idx, 0))
    pos[n:] = 0
    return {
        "tokens": full[:L],
        "targets": full[1:],
        "segment_ids": seg[:L],
        "positions": pos[:L],
        # A target counts only inside the same document; padding never counts.
        "loss_mask": ((seg[:L] > 0) & (seg[:L] == seg[1:])).astype(np.float32),
    }


def padding_row(seq_len: int) -> dict[str, np.ndarray]:
    """A row of padding only (segment 0, nothing in the loss): fills eval batches past the end."""
    return pack_window(np.zeros(0, np.int32), np.zeros(0, bool), seq_len, None)


class SequenceSource:
    """Row i of the packed corpus, by random access (a Grain `RandomAccessDataSource`).

    Reading row i touches only tokens [i*L, i*L + L + 1) of the corpus, so a process reads only
    the rows it is asked for.
    """

    def __init__(self, corpus: Corpus, seq_len: int):
        self.corpus, self.seq_len = corpus, seq_len
        # Each row needs L inputs plus one more target; the last row may be shorter (padded).
        self._len = max(0, -(-(corpus.num_tokens - 1) // seq_len))

    def __len__(self) -> int:
        return self._len

    @functools.cached_property
    def num_documents(self) -> int:
        """Documents in the corpus: eod ids, plus a file that does not end with one (a scan, done once)."""
        eod, total = self.corpus.eod_id, 0
        for arr in self.corpus.arrays:
            if hasattr(arr, "num_documents"):  # a DocumentStream knows its count without reading
                total += arr.num_documents
                continue
            if eod is not None:
                total += sum(int(np.count_nonzero(np.asarray(arr[i:i + _SCAN]) == eod)) for i in range(0, len(arr), _SCAN))
            total += len(arr) > 0 and (eod is None or int(arr[len(arr) - 1]) != eod)
        return total

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self._len:
            raise IndexError(f"row {i} out of range [0, {self._len})")
        start = i * self.seq_len
        window, file_start = self.corpus.read(start, start + self.seq_len + 1)
        return pack_window(window, file_start, self.seq_len, self.corpus.eod_id)
