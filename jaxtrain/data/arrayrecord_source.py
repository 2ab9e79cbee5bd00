"""ArrayRecord files (`data.source=arrayrecord`): records read by index with the `array_record` package.

Two kinds of file:
- Records that are UTF-8 JSON objects, one row each: the text of `data.text_field` is tokenized at open,
  or `data.tokens_field` holds a list of token ids. Those lists are read once at open (their lengths,
  largest id and types are checked) and then again by record index when a row of training data needs
  them, so only their lengths stay in memory.
- Token files written by `jaxtrain prepare-data --output-format arrayrecord`: `part-NNNNN.arrayrecord`,
  each record one document's ids as little-endian uint32 bytes (no eod inside), a
  `part-NNNNN.arrayrecord.lengths.npy` (int64 ids per record) and a `meta.json` (format
  `jaxtrain.arrayrecord_tokens`: eod id, vocabulary size, largest id, tokenizer, records per file).
  They are recognised by that meta.json and read lazily: opening reads only the lengths and meta.json,
  and a training row reads only the records it holds. Their eod id is meta.json's (the tokenizer that
  wrote them), whatever data.tokenizer says.
Records are written one per chunk (`group_size:1`), so reading one record decompresses only it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data.record_fields import TokenDocuments, json_text, json_tokens

SUFFIXES = (".arrayrecord", ".array_record")
META_NAME = "meta.json"
PREPARED_FORMAT = "jaxtrain.arrayrecord_tokens"
LENGTHS_SUFFIX = ".lengths.npy"
SIDECARS = (META_NAME, LENGTHS_SUFFIX)  # what a reader looks for beside a file (`remote_files.local_files`)
WRITER_OPTIONS = "group_size:1"  # one record per chunk: random access decompresses only the record read
_RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"  # the reader's options for reads by index
_BATCH = 1024  # records per sequential read


def _open(path: Path, key: str, options: str = "") -> Any:
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(path), options)
    if not reader.ok():
        raise ConfigError(f"{key}: '{path}' is not a readable ArrayRecord file")
    return reader


def _records(path: Path, key: str) -> Iterator[tuple[int, bytes]]:
    reader = _open(path, key)
    try:
        n = reader.num_records()
        for start in range(0, n, _BATCH):
            try:
                batch = reader.read(start, min(n, start + _BATCH))
            except RuntimeError as e:
                raise ConfigError(f"{key}: '{path}' is not a readable ArrayRecord file ({e})") from None
            yield from enumerate(batch, start)
    finally:
        reader.close()


def _json(record: bytes, where: str, key: str) -> dict:
    try:
        row = json.loads(record)
    except (json.JSONDecodeError, UnicodeDecodeError):
        row = None
    if not isinstance(row, dict):
        raise ConfigError(f"{key}: {where} is not a UTF-8 JSON object (ArrayRecord rows are JSON objects; token "
                          "files from prepare-data need their meta.json beside them)")
    return row


def iter_rows(path: Path, key: str) -> Iterator[tuple[str, dict]]:
    """Every record of one file as `(where, row)`, where 'file:row N' (N from 0)."""
    if prepared_meta(path, key) is not None:
        raise ConfigError(f"{key}: '{path}' holds token ids written by prepare-data, not rows of text "
                          "(use data.format=text)")
    for i, record in _records(path, key):
        where = f"{path}:row {i}"
        yield where, _json(record, where, key)


def texts(path: Path, field: str, key: str) -> Iterator[list[str]]:
    """The `field` text of every record, in batches."""
    batch: list[str] = []
    for where, row in iter_rows(path, key):
        batch.append(json_text(row, field, where, key))
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


class _RandomReader:
    """A reader opened on first use and shared by the threads that read rows (one read at a time)."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key
        self._reader = None
        self._lock = threading.Lock()

    def __call__(self, i: int) -> bytes:
        with self._lock:
            if self._reader is None:
                self._reader = _open(self.path, self.key, _RANDOM_ACCESS)
            return self._reader.read([i])[0]


def token_documents(path: Path, field: str, key: str) -> TokenDocuments:
    """The token-id lists of `field` in JSON records: checked once now, read again by index later."""
    lengths, max_id = [], 0
    for where, row in iter_rows(path, key):
        ids = json_tokens(row, field, where, key)
        lengths.append(len(ids))
        if len(ids):
            max_id = max(max_id, int(ids.max()))
    record = _RandomReader(path, key)

    def read(i: int) -> np.ndarray:
        return json_tokens(json.loads(record(i)), field, f"{path}:row {i}", key)

    return TokenDocuments(np.asarray(lengths, np.int64), read, max_id)


# ----------------------------------------------------------------------------- prepare-data's token files


def prepared_meta(path: Path, key: str) -> Optional[dict]:
    """The meta.json of prepare-data's ArrayRecord token files beside `path`, or None when there is none."""
    meta_path = path.parent / META_NAME
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: '{meta_path}' is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != PREPARED_FORMAT:
        return None  # another tool's meta.json: the records are read as JSON rows
    for field in ("eod_id", "max_id"):
        if not isinstance(meta.get(field), int) or meta[field] < 0:
            raise ConfigError(f"{key}: '{meta_path}' needs a non-negative integer '{field}'")
    return meta


def prepared_documents(path: Path, meta: dict, key: str) -> TokenDocuments:
    """One of prepare-data's ArrayRecord token files: lengths from its .lengths.npy, records read when asked."""
    lengths_path = path.with_name(path.name + LENGTHS_SUFFIX)
    try:
        lengths = np.load(lengths_path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: '{lengths_path}' (the record lengths of '{path}') is missing or unreadable "
                          f"({e.__class__.__name__})") from None
    reader = _open(path, key)
    n = reader.num_records()
    reader.close()
    expected = (meta.get("files") or {}).get(path.name)
    if lengths.ndim != 1 or len(lengths) != n or (expected is not None and expected != n):
        raise ConfigError(f"{key}: '{path}' has {n} records but its {LENGTHS_SUFFIX} or meta.json say otherwise "
                          "(truncated or rewritten)")
    record = _RandomReader(path, key)

    def read(i: int) -> np.ndarray:
        return np.frombuffer(record(i), dtype="<u4")

    return TokenDocuments(lengths.astype(np.int64), read, int(meta["max_id"]))


class TokenWriter:
    """Writes one `part-NNNNN.arrayrecord` of prepare-data: a record per document, then its lengths file."""

    def __init__(self, path: Path):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.path = path
        self._writer = ArrayRecordWriter(str(path), WRITER_OPTIONS)
        self.lengths: list[int] = []

    def add(self, ids: np.ndarray) -> None:
        """Append one document's ids (no eod)."""
        self._writer.write(np.asarray(ids).astype("<u4").tobytes())
        self.lengths.append(len(ids))

    def close(self) -> None:
        """Finish the file and write `<file>.lengths.npy` beside it."""
        self._writer.close()
        np.save(self.path.with_name(self.path.name + LENGTHS_SUFFIX), np.asarray(self.lengths, np.int64),
                allow_pickle=False)


def write_meta(path: Path, *, eod_id: int, vocab_size: int, max_id: int, tokenizer: str, files: dict[str, int],
               num_tokens: int, skipped_empty_files: int = 0) -> None:
    """The `meta.json` of prepare-data's ArrayRecord token files (`files`: records per file; `num_tokens`: the
    stream's length as for token files, the ids of all records plus the eod the reader puts after each)."""
    meta = {
        "format": PREPARED_FORMAT, "version": 1, "dtype": "uint32", "eod_id": eod_id, "vocab_size": vocab_size,
        "max_id": max_id, "tokenizer": tokenizer, "num_tokens": num_tokens, "num_documents": sum(files.values()),
        "files": files, "skipped_empty_files": skipped_empty_files,
    }
    path.write_text(json.dumps(meta, indent=2) + "\n")
