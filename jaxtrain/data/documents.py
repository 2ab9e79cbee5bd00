"""Rows and documents of the record sources: one interface over text/jsonl, ArrayRecord, Parquet and
Hugging Face `datasets` files.

- `iter_rows(source, spec, key)` yields `(where, row)` for every row in file order: `row` a dict of the
  row's fields, `where` "file:row" for messages. Chat and prompt/completion data read their rows here.
- `open_text(...)` (.txt/.jsonl) and `open_documents(...)` (the record sources with `data.format: text`) give a
  `Corpus`: each text tokenized once per host (`encode_documents` into `token_cache` entries, memory-mapped),
  or a record's `tokens_field` read as ids.
- `DocumentStream`: documents read by index as one stream of ids with the eod id after each, the
  form a `Corpus` holds a file of token-id documents in without reading it.

Each format has its module (`arrayrecord_source.py`, `parquet_source.py`, `hf_datasets_source.py`:
reading a file's rows, texts and token documents); gs:// and s3:// paths are copied to local disk
first (`remote_files.py`). pyarrow and array_record are imported only when such a file is read.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Optional

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data import arrayrecord_source, hf_datasets_source, parquet_source, token_cache
from jaxtrain.data.record_fields import TokenDocuments
from jaxtrain.data.remote_files import local_files, source_url, urls_in_errors
from jaxtrain.data.sources import TEXT_SUFFIXES, Corpus, check_vocab, encode_with_eod, iter_documents, jsonl_rows
from jaxtrain.data.tokenizer import Tokenizer

FORMATS: dict[str, ModuleType] = {"arrayrecord": arrayrecord_source, "parquet": parquet_source,
                                   "hf_datasets": hf_datasets_source}
_SIDECARS = {"arrayrecord": arrayrecord_source.SIDECARS, "parquet": (), "hf_datasets": hf_datasets_source.SIDECARS}


class DocumentStream:
    """Documents read by index as one token stream, the eod id after each: an entry of `Corpus.arrays`.

    `len()` is the stream's length (ids plus one eod per document) and `[lo:hi]` (or `[i]`) reads only
    the documents that the slice touches (found by `np.searchsorted` over the documents' ends). Empty
    documents add nothing, not even an eod (as empty texts in `sources.tokenize_files`). With
    `eod_id` None the documents run together; a file still starts a document (`Corpus.read`).
    """

    def __init__(self, lengths: np.ndarray, read: Callable[[int], np.ndarray], eod_id: Optional[int],
                 dtype: np.dtype = np.dtype(np.uint32)):
        """`lengths`: ids per document (no eod); `read(i)`: document i's ids; `dtype`: of the slices returned."""
        lengths = np.asarray(lengths, np.int64)
        self._docs = np.flatnonzero(lengths > 0)  # stream document k is document _docs[k] of the file
        self._lengths = lengths[self._docs]
        self._ends = np.cumsum(self._lengths + (eod_id is not None))  # where each document's part ends
        self._read, self.eod_id, self.dtype = read, eod_id, np.dtype(dtype)
        self.num_documents = len(self._docs)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: int | slice) -> np.ndarray:
        if not isinstance(index, slice):
            i = index + len(self) if index < 0 else index
            if not 0 <= i < len(self):
                raise IndexError(f"token {index} out of range [0, {len(self)})")
            return self[i:i + 1][0]
        lo, hi, step = index.indices(len(self))
        if step != 1:
            raise ValueError("a DocumentStream is sliced with step 1 only")
        if hi <= lo:
            return np.zeros(0, self.dtype)
        first = int(np.searchsorted(self._ends, lo, side="right"))  # the document holding token lo
        last = int(np.searchsorted(self._ends, hi - 1, side="right"))  # ... and token hi - 1
        parts = []
        for k in range(first, last + 1):
            ids = np.asarray(self._read(int(self._docs[k])))
            if len(ids) != self._lengths[k]:
                raise ValueError(f"document {self._docs[k]} holds {len(ids)} ids, not the {self._lengths[k]} it "
                                 "held when opened (the file changed while training)")
            start = int(self._ends[k]) - len(ids) - (self.eod_id is not None)
            if self.eod_id is not None:
                ids = np.append(ids.astype(self.dtype, copy=False), np.asarray(self.eod_id, self.dtype))
            parts.append(ids[max(lo - start, 0):min(hi - start, len(ids))].astype(self.dtype, copy=False))
        return np.concatenate(parts)


# ----------------------------------------------------------------------------- files


def _files(source: str, spec: str, key: str) -> list[Path]:
    """The local files of a record source, in reading order (remote ones copied first)."""
    fmt = FORMATS[source]
    if source == "hf_datasets":
        hf_datasets_source.refuse_dataset_dict(spec, key)
    files = local_files(spec, key, fmt.SUFFIXES, _SIDECARS[source])
    if source == "hf_datasets":
        files = hf_datasets_source.data_files(files, key)
    return files


def row_files(source: str, spec: str, key: str) -> list[Path]:
    """The local files of a source of rows, in reading order (remote ones copied first).

    Raises:
      ConfigError: missing files; a text file that is not .jsonl; a source that holds token ids, not rows.
    """
    if source == "text":
        files = local_files(spec, key, (".jsonl",))
        for f in files:
            if f.suffix != ".jsonl":
                raise ConfigError(f"{key}: '{source_url(f) or f}' is not a .jsonl file; rows of chat or "
                                  "prompt/completion data are JSON lines")
        return files
    if source not in FORMATS:
        raise ConfigError(f"{key}: data.source={source} has no rows (it holds token ids)")
    return _files(source, spec, key)


def file_rows(source: str, path: Path, key: str) -> Iterator[tuple[str, dict]]:
    """Every row of one local file (from `row_files`) as `(where, fields)`, `where` naming its file and row."""
    with urls_in_errors([path]):
        if source == "text":
            yield from jsonl_rows(path, key)
        else:
            yield from FORMATS[source].iter_rows(path, key)


def iter_rows(source: str, spec: str, key: str) -> Iterator[tuple[str, dict]]:
    """Every row of the files `spec` names, in file order, as `(where, fields)`.

    Args:
      source: data.source (text: .jsonl lines; arrayrecord: JSON records; parquet; hf_datasets).
      spec: file, directory or glob; local, gs:// or s3://.
      key: config key named in error messages.
    Raises:
      ConfigError: missing files, unreadable files or rows.
    """
    for f in row_files(source, spec, key):
        yield from file_rows(source, f, key)


# ----------------------------------------------------------------------------- documents

_ENCODE_DOCS = 256  # documents per tokenizer call


def _file_texts(source: str, path: Path, field: str, key: str) -> Iterator[list[str]]:
    """One local file's texts in batches: a .jsonl line's `field` or a whole .txt file (text), else the format's."""
    if source == "text":
        docs = iter_documents(path, field, key)
        while batch := list(itertools.islice(docs, _ENCODE_DOCS)):
            yield batch
        return
    yield from FORMATS[source].texts(path, field, key)


def encode_documents(encoding: token_cache.Encoding, path: Path, key: str, tokenizer: Tokenizer) -> token_cache.FileEncoding:
    """One file's documents tokenized (a `token_cache.Encoder`): each non-empty text's ids, then the eod id."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32  # halves a small vocabulary's size
    parts: list[np.ndarray] = []
    docs = 0
    with urls_in_errors([path]):
        for batch in _file_texts(encoding.source, path, encoding.text_field, key):
            ids, n = encode_with_eod(batch, tokenizer, dtype)
            parts.append(ids)
            docs += n
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return token_cache.FileEncoding({"tokens": tokens}, {"documents": docs, "tokens": len(tokens),
                                                         "max_id": int(tokens.max()) if docs else 0})


def open_text(spec: str, tokenizer: Tokenizer, *, vocab_size: int, text_field: str = "text",
              key: str = "data.path", workers: Optional[int] = None) -> Corpus:
    """The text/jsonl files named by `spec` as a corpus, tokenized once per host (`token_cache`).

    Args:
      spec: file, directory (its .txt and .jsonl files) or glob.
      tokenizer: from `load_tokenizer(data.tokenizer)`.
      vocab_size: model.vocab_size; every id must be below it.
      text_field: the field of a .jsonl line that holds the document.
      key: config key named in error messages.
      workers: data.tokenize_workers: processes that tokenize files not yet in the cache (None: one per CPU).
    Returns:
      The corpus: one memory-mapped array per file with text, its documents each ended by the eod id.
    Raises:
      ConfigError: missing/empty files, bad jsonl lines, no text at all, ids >= vocab_size.
    """
    files = local_files(spec, key, TEXT_SUFFIXES)
    encoding = token_cache.Encoding.of("documents", "text", tokenizer, text_field=text_field)
    encoded = token_cache.encode(encoding, files, key, tokenizer, encode_documents, workers=workers)
    kept = [(f, e) for f, e in zip(files, encoded) if len(e.tokens)]  # an empty entry would break Corpus.read
    if not kept:
        raise ConfigError(f"{key}: '{spec}' holds no text")
    corpus = Corpus([e.tokens for _, e in kept], [source_url(f) or str(f) for f, _ in kept], tokenizer.eod_id,
                    max(e.max_id for _, e in kept))
    check_vocab(corpus, vocab_size, key)
    return corpus


def open_documents(source: str, spec: str, *, tokenizer: Tokenizer, text_field: str, tokens_field: Optional[str],
                   vocab_size: int, key: str, workers: Optional[int] = None) -> Corpus:
    """The documents of a record source as one token stream (each document followed by the eod id).

    Without `tokens_field`, every row's `text_field` is tokenized once per host, by worker processes, into
    `token_cache` entries that are then memory-mapped (a later open reads them without tokenizing).
    With it, every row's `tokens_field` holds the document's ids: ArrayRecord files and Arrow files
    (`.arrow`, `datasets` folders) are read by record when a training row needs them (one
    `DocumentStream` per file); Parquet files are read column-wise now and kept in memory (Parquet has
    no cheap read by row). ArrayRecord token files from `prepare-data` (recognised by their meta.json)
    are read by record too, with meta.json's eod id, whatever the fields say.

    Args:
      source: data.source: arrayrecord, parquet or hf_datasets.
      spec: file, directory or glob; local, gs:// or s3:// (copied to local disk first: `remote_files`).
      tokenizer: from `load_tokenizer(data.tokenizer)`; its eod id ends the documents.
      text_field: data.text_field, the field or column of text.
      tokens_field: data.tokens_field, the field or column of token-id lists (None: tokenize the text).
      vocab_size: model.vocab_size; every id must be below it.
      key: config key named in error messages.
      workers: data.tokenize_workers (`token_cache.encode`).
    Returns:
      The corpus, one entry per file.
    Raises:
      ConfigError: a missing path, an unreadable file, a missing column, a text that is not a string,
        token ids that are not a list of non-negative integers, files that disagree on the eod id, no
        documents at all, or ids >= vocab_size (one line each, naming the key and the file).
    """
    fmt = FORMATS[source]
    arrays: list[np.ndarray | DocumentStream] = []
    names: list[str] = []
    eods: dict[str, int] = {}
    max_id = 0
    files = _files(source, spec, key)
    metas = {}
    for f in files:
        with urls_in_errors([f]):
            metas[f] = arrayrecord_source.prepared_meta(f, key) if source == "arrayrecord" else None
    texts = [f for f in files if metas[f] is None and not tokens_field]
    encoding = token_cache.Encoding.of("documents", source, tokenizer, text_field=text_field)
    encoded = dict(zip(texts, token_cache.encode(encoding, texts, key, tokenizer, encode_documents, workers=workers)))
    for f in files:
        with urls_in_errors([f]):
            meta = metas[f]
            if meta is not None or tokens_field:
                docs: TokenDocuments = (arrayrecord_source.prepared_documents(f, meta, key) if meta is not None
                                        else fmt.token_documents(f, tokens_field, key))
                eod = meta["eod_id"] if meta is not None else tokenizer.eod_id
                arr = DocumentStream(docs.lengths, docs.read, eod)
                max_id = max(max_id, docs.max_id if arr.num_documents else 0, eod)
            else:
                eod = tokenizer.eod_id
                arr = encoded[f].tokens
                max_id = max(max_id, encoded[f].max_id)
        name = source_url(f) or str(f)
        eods[name] = eod
        if len(arr):  # an empty entry would break Corpus.read's walk over files
            arrays.append(arr)
            names.append(name)
    distinct = sorted(set(eods.values()))
    if len(distinct) > 1:
        where = ", ".join(f"{f}: {e}" for f, e in list(eods.items())[:4])
        raise ConfigError(f"{key}: files disagree on the end-of-document id ({where}); prepare-data's files keep "
                          "their tokenizer's, the others use data.tokenizer's")
    if not arrays:
        raise ConfigError(f"{key}: '{spec}' holds no documents (every row's "
                          f"{'data.tokens_field' if tokens_field else 'data.text_field'} is empty)")
    corpus = Corpus(arrays, names, distinct[0], max_id)
    check_vocab(corpus, vocab_size, key)
    return corpus
