"""Where tokens come from: flat binary token files (memory-mapped) or text/jsonl tokenized at open.

Both sources become a `Corpus`: one virtual stream of token ids, the files one after another,
with documents ended by an end-of-document id (`eod_id`). A file boundary is always a document
boundary too, so a file need not end with eod.

Token files (`data.source=tokens`) are raw little-endian uint16 or uint32 arrays, the format
`jaxtrain prepare-data` writes and most pre-training pipelines export. A `meta.json` beside them
(same directory) records dtype, eod id, vocabulary size, largest id and tokenizer; without it the
dtype is `data.token_dtype`, the eod id is `data.eod_id` (null: documents end only at file ends)
and the largest id is found by scanning the files once at open time.

Text (`data.source=text`): a `.jsonl` file holds one document per line in the field
`data.text_field`; any other file (`.txt`, or any name given explicitly or by glob) is one
document (read here: `iter_documents`); `documents.open_text` tokenizes each file once per host into
the token cache and memory-maps it.
Nothing read from a data file is ever executed: JSON is parsed with `json.loads`, tokens are
raw integers. Both sources take gs:// and s3:// paths too: the objects (and a meta.json beside token
files) are copied once to a local cache and read from there (`remote_files.local_files`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data.remote_files import META_NAME, local_files, resolve_paths, source_url, urls_in_errors  # noqa: F401 (re-exported)
from jaxtrain.data.tokenizer import Tokenizer
from jaxtrain.storage.paths import is_remote

META_FORMAT = "jaxtrain.tokens"
TOKEN_SUFFIXES = (".bin",)
TEXT_SUFFIXES = (".txt", ".jsonl")
_SCAN_CHUNK = 1 << 24  # tokens per step when scanning for the largest id (bounded memory)


# ----------------------------------------------------------------------------- the corpus


@dataclasses.dataclass
class Corpus:
    """Files of token ids read as one stream; `read` returns any window of it.

    Attributes:
      arrays: one 1-D integer array per file (np.memmap for token files).
      names: file names, for messages.
      eod_id: end-of-document id, or None when documents end only at file boundaries.
      max_id: the largest token id in the corpus (checked against model.vocab_size).
    """

    arrays: list[np.ndarray]
    names: list[str]
    eod_id: Optional[int]
    max_id: int

    def __post_init__(self):
        lengths = np.array([len(a) for a in self.arrays], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # file i spans [offsets[i], offsets[i+1])

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [start, stop) of the stream, clipped to its end.

        Returns:
          (tokens int32 [n], file_start bool [n]) where file_start marks the first token of a file:
          a document starts there even without an eod before it.
        """
        stop = min(stop, self.num_tokens)
        parts, starts = [], []
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo, hi = pos - self.offsets[i], min(stop, self.offsets[i + 1]) - self.offsets[i]
            parts.append(np.asarray(self.arrays[i][lo:hi], dtype=np.int32))
            mark = np.zeros(hi - lo, dtype=bool)
            mark[0] = lo == 0
            starts.append(mark)
            pos += hi - lo
            i += 1
        if not parts:
            return np.zeros(0, np.int32), np.zeros(0, bool)
        return np.concatenate(parts), np.concatenate(starts)


def check_vocab(corpus: Corpus, vocab_size: int, key: str) -> None:
    """Raise ConfigError when an id (or the eod id) does not fit `model.vocab_size`."""
    if corpus.max_id >= vocab_size:
        raise ConfigError(f"{key}: the data holds token id {corpus.max_id} but model.vocab_size={vocab_size}; "
                          f"set model.vocab_size to at least {corpus.max_id + 1}")
    if corpus.eod_id is not None and corpus.eod_id >= vocab_size:
        raise ConfigError(f"{key}: the end-of-document id {corpus.eod_id} does not fit model.vocab_size={vocab_size}; "
                          f"set model.vocab_size to at least {corpus.eod_id + 1}")


# ----------------------------------------------------------------------------- token files


def read_meta(path: Path) -> dict:
    """The `meta.json` sidecar at `path` (checked), as a dict."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"data.path: '{path}' is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ConfigError(f"data.path: '{path}' is not a jaxtrain token metadata file (format != {META_FORMAT})")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ConfigError(f"data.path: '{path}' has dtype {meta.get('dtype')!r}; expected uint16 or uint32")
    for field in ("eod_id", "max_id"):
        if not isinstance(meta.get(field), int) or meta[field] < 0:
            raise ConfigError(f"data.path: '{path}' needs a non-negative integer '{field}'")
    return meta


def write_meta(path: Path, *, dtype: str, eod_id: int, vocab_size: int, max_id: int, tokenizer: str,
               files: dict[str, int], num_documents: int, skipped_empty_files: int = 0) -> None:
    """Write the `meta.json` sidecar that `open_tokens` reads (see the module docstring).

    `skipped_empty_files`: empty input files `prepare-data` left out (a record for the reader only).
    """
    meta = {
        "format": META_FORMAT, "version": 1, "dtype": dtype, "eod_id": eod_id, "vocab_size": vocab_size,
        "max_id": max_id, "tokenizer": tokenizer, "num_tokens": sum(files.values()),
        "num_documents": num_documents, "files": files, "skipped_empty_files": skipped_empty_files,
    }
    path.write_text(json.dumps(meta, indent=2) + "\n")


def _scan_max(arr: np.ndarray) -> int:
    return max(int(arr[i:i + _SCAN_CHUNK].max()) for i in range(0, len(arr), _SCAN_CHUNK))


def open_tokens(spec: str, *, token_dtype: str, eod_id: Optional[int], vocab_size: int,
                key: str = "data.path") -> Corpus:
    """Memory-map the token files named by `spec`.

    Args:
      spec: file, directory (its `.bin` files) or glob; local, gs:// or s3:// (copied to local disk first,
        with the meta.json beside them: `remote_files.local_files`).
      token_dtype: dtype of files without a meta.json (`data.token_dtype`).
      eod_id: eod id of files without a meta.json (`data.eod_id`); must agree with meta.json.
      vocab_size: model.vocab_size; every id must be below it.
      key: config key named in error messages.
    Returns:
      The corpus; only the pages a process reads are ever loaded.
    Raises:
      ConfigError: missing/empty/truncated files, bad meta.json, conflicting eod ids, ids >= vocab_size.
        A bucket's files are named by their URLs.
      TransientStorageError: a bucket did not answer, even after retries.
    """
    files = local_files(spec, key, TOKEN_SUFFIXES, (META_NAME,))
    with urls_in_errors(files):
        return _open_token_files(files, spec, token_dtype=token_dtype, eod_id=eod_id, vocab_size=vocab_size, key=key)


def _open_token_files(files: list[Path], spec: str, *, token_dtype: str, eod_id: Optional[int], vocab_size: int,
                      key: str) -> Corpus:
    metas: dict[Path, Optional[dict]] = {}
    arrays, eods, max_id = [], {}, 0
    for f in files:
        meta_path = f.parent / META_NAME
        if f.parent not in metas:
            metas[f.parent] = read_meta(meta_path) if meta_path.is_file() else None
        meta = metas[f.parent]
        dtype = np.dtype(meta["dtype"] if meta else token_dtype).newbyteorder("<")  # files are little-endian
        size = f.stat().st_size
        if size % dtype.itemsize:
            raise ConfigError(f"{key}: file '{f}' has {size} bytes, not a whole number of {dtype.name} tokens "
                              "(truncated, or the wrong data.token_dtype)")
        arr = np.memmap(f, dtype=dtype, mode="r")
        if meta:
            expected = meta.get("files", {}).get(f.name)
            if expected is not None and expected != len(arr):
                raise ConfigError(f"{key}: file '{f}' has {len(arr)} tokens but {meta_path} says {expected} "
                                  "(truncated or rewritten)")
            eods[f] = meta["eod_id"]
            max_id = max(max_id, meta["max_id"])
        else:
            if eod_id is not None:
                eods[f] = eod_id
            # No sidecar: scan once for the largest id, unless the dtype cannot exceed the vocabulary.
            if np.iinfo(dtype).max >= vocab_size:
                max_id = max(max_id, _scan_max(arr))
        arrays.append(arr)
    distinct = sorted(set(eods.values()))
    if len(distinct) > 1 or (eod_id is not None and distinct and distinct != [eod_id]):
        where = ", ".join(f"{f}: {e}" for f, e in list(eods.items())[:4])
        raise ConfigError(f"{key}: files disagree on the end-of-document id ({where}; data.eod_id={eod_id}); "
                          "use files from one tokenizer and unset or fix data.eod_id")
    if len(eods) not in (0, len(files)):
        raise ConfigError(f"{key}: some files have an end-of-document id (meta.json) and others not; "
                          "set data.eod_id for the files without meta.json")
    names = [(source_url(f) if is_remote(spec) else None) or str(f) for f in files]
    corpus = Corpus(arrays, names, distinct[0] if distinct else None, max_id)
    check_vocab(corpus, vocab_size, key)
    return corpus


# ----------------------------------------------------------------------------- text files


def iter_documents(path: Path, text_field: str = "text", key: str = "data.path") -> Iterator[str]:
    """The documents of one text file: each line's `text_field` for .jsonl, else the whole file.

    Raises:
      ConfigError: a .jsonl line is not a JSON object with a string `text_field` (names file:line).
    """
    if path.suffix != ".jsonl":
        yield path.read_bytes().decode("utf-8", errors="replace")
        return
    for where, obj in jsonl_rows(path, key):
        if not isinstance(obj.get(text_field), str):
            raise ConfigError(f"{key}: {where} has no string field '{text_field}' "
                              "(set data.text_field, or --text-field for prepare-data)")
        yield obj[text_field]


def jsonl_rows(path: Path, key: str) -> Iterator[tuple[str, dict]]:
    """The JSON objects of a .jsonl file as `(file:line, object)`, blank lines skipped.

    Raises:
      ConfigError: a line that is not valid JSON or not an object (names file:line).
    """
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ConfigError(f"{key}: {path}:{lineno} is not valid JSON") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{key}: {path}:{lineno} is not a JSON object")
            yield f"{path}:{lineno}", obj


def tokenize_files(files: list[Path], tokenizer: Tokenizer, text_field: str = "text", key: str = "data.path",
                   batch_docs: int = 256) -> Iterator[tuple[np.ndarray, int, int]]:
    """Tokenize documents file by file, each document followed by the eod id.

    Yields:
      (uint32 ids of some whole documents, how many documents, how many characters of text they
      came from: for progress). Empty documents are skipped.
    """
    for f in files:
        docs = iter_documents(f, text_field, key)
        while batch := list(itertools.islice(docs, batch_docs)):
            joined, n = encode_with_eod(batch, tokenizer)
            yield joined, n, sum(len(d) for d in batch)


def encode_with_eod(texts: list[str], tokenizer: Tokenizer, dtype: type = np.uint32) -> tuple[np.ndarray, int]:
    """The non-empty texts' ids, each followed by the eod id, as one array of `dtype`; and how many texts gave ids
    (an empty text, or one that encodes to nothing, adds nothing, not even an eod)."""
    eod = np.array([tokenizer.eod_id], dtype)
    ids = [x.astype(dtype) for x in tokenizer.encode_batch([t for t in texts if t]) if len(x)]
    return (np.concatenate([part for x in ids for part in (x, eod)]) if ids else np.zeros(0, dtype)), len(ids)
