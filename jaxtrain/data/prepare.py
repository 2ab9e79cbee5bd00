"""What `jaxtrain prepare-data` does (`commands/prepare_data.py` parses and prints): tokenize
.txt/.jsonl files into token files for `data.source=tokens` (or ArrayRecord files for
`data.source=arrayrecord` with --output-format arrayrecord).

Output (DIR): `tokens-00000.bin`, `tokens-00001.bin`, ... (flat little-endian uint16/uint32
ids, documents each followed by the eod id, a new file every --shard-tokens tokens at a document
boundary) and `meta.json` (dtype, eod id, vocabulary size, largest id, tokenizer, tokens per
file). With --output-format arrayrecord: `part-00000.arrayrecord`, ... (a record per document: its
ids as little-endian uint32, no eod), a `part-NNNNN.arrayrecord.lengths.npy` per file and a meta.json
(`arrayrecord_source.py` says what they hold). Everything is written to a temporary directory
beside DIR and moved in only when complete, so a failed or interrupted run leaves DIR as it was.

  jaxtrain prepare-data --input corpus/*.jsonl --output data/tok [--tokenizer bytes|tokenizer.json]
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import IO, Optional

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data import arrayrecord_source
from jaxtrain.data.sources import META_NAME, TEXT_SUFFIXES, iter_documents, resolve_paths, tokenize_files, write_meta
from jaxtrain.data.tokenizer import load_tokenizer

SHARD_PREFIX = "tokens-"
RECORD_PREFIX = "part-"  # --output-format arrayrecord: part-00000.arrayrecord, ...
OUTPUT_FORMATS = ("tokens", "arrayrecord")
DEFAULT_SHARD_TOKENS = 1 << 28  # 256 Mi tokens = 512 MiB of uint16: big enough, small enough to copy around


class Progress:
    """A one-line progress bar on a terminal; silent when `stream` is not a tty (logs, pipes)."""

    def __init__(self, total_bytes: int, stream: IO[str]):
        self.total, self.stream = max(total_bytes, 1), stream
        self.enabled = stream.isatty()
        self.t0 = self.last = time.perf_counter()

    def update(self, done_bytes: int, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.1 and not force):
            return
        self.last = now
        frac = min(done_bytes / self.total, 1.0)
        bar = "#" * int(30 * frac)
        rate = done_bytes / max(now - self.t0, 1e-9) / 1e6
        self.stream.write(f"\r[{bar:<30}] {100 * frac:5.1f}%  {done_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB  "
                          f"{tokens:,} tokens  {rate:,.1f} MB/s")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _input_files(specs: list[str]) -> tuple[list[Path], int]:
    """The non-empty files named by `specs` (each once) and how many empty ones were left out.

    Real corpora hold empty files (an empty `__init__.py`): they add no document, so they are skipped,
    not refused. Only when every file is empty is it an error: there would be nothing to write.
    """
    files, seen, empty = [], set(), 0
    for spec in specs:
        for f in resolve_paths(spec, "--input", TEXT_SUFFIXES, allow_empty=True):
            if f.resolve() in seen:  # the same file named twice is read once
                continue
            seen.add(f.resolve())
            if f.stat().st_size == 0:
                empty += 1
            else:
                files.append(f)
    if not files:
        raise ConfigError(f"--input: all {empty} file(s) are empty")
    return files, empty


def _check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output: '{out}' exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--output: directory '{out}' is not empty; pass --overwrite to replace its token files "
                          "or choose another directory")


def prepare(inputs: list[str], output: str, *, tokenizer: str = "bytes", dtype: Optional[str] = None,
            eod_id: Optional[int] = None, text_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS,
            overwrite: bool = False, progress: IO[str] = sys.stderr, output_format: str = "tokens") -> dict:
    """Tokenize `inputs` into token files in `output` (see the module docstring).

    Args:
      inputs: files, directories or globs of .txt/.jsonl text.
      output: directory to write; created if missing.
      tokenizer: 'bytes' or a tokenizers JSON path.
      dtype: 'uint16' or 'uint32'; None picks the smallest that holds every id.
      eod_id: end-of-document id (None: the tokenizer's).
      text_field: field of .jsonl lines holding the text.
      shard_tokens: tokens per output file (rounded up to a document boundary).
      overwrite: allow replacing token files in a non-empty output directory.
      progress: where the progress bar goes (only drawn on a tty).
      output_format: 'tokens' (.bin token files) or 'arrayrecord' (a record of uint32 ids per document).
    Returns:
      Summary: num_tokens, num_documents, files, dtype, eod_id, vocab_size, max_id, inputs (files read),
      skipped_empty (empty input files left out).
    Raises:
      ConfigError: bad inputs, tokenizer, dtype or output; nothing is written then.
    """
    tok = load_tokenizer(tokenizer, eod_id, key="--tokenizer")
    if output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"--output-format must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}")
    if output_format == "arrayrecord":
        if dtype not in (None, "uint32"):
            raise ConfigError(f"--dtype {dtype} is for token files; ArrayRecord records always hold uint32 ids")
        dtype = "uint32"
    if dtype is None:
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    if dtype == "uint16" and tok.vocab_size > 1 << 16:
        raise ConfigError(f"--dtype uint16 cannot hold ids of a {tok.vocab_size}-token vocabulary; use --dtype uint32")
    if shard_tokens <= 0:
        raise ConfigError(f"--shard-tokens must be positive, got {shard_tokens}")
    files, skipped_empty = _input_files(inputs)
    out = Path(output)
    _check_output(out, overwrite)

    # Everything goes to a sibling temporary directory first, moved in only when complete.
    tmp = out.parent / f".{out.name}.prepare-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if output_format == "arrayrecord":
            summary = _write_records(files, tok, text_field, shard_tokens, tmp, progress)
        else:
            summary = _write_shards(files, tok, np.dtype(dtype).newbyteorder("<"), text_field, shard_tokens, tmp,
                                    progress)
        if summary["num_tokens"] == 0:
            raise ConfigError(f"--input: {len(files)} file(s) hold no text")
        if output_format == "arrayrecord":
            arrayrecord_source.write_meta(tmp / META_NAME, eod_id=tok.eod_id, vocab_size=tok.vocab_size,
                                          max_id=summary["max_id"], tokenizer=tok.name, files=summary["files"],
                                          num_tokens=summary["num_tokens"], skipped_empty_files=skipped_empty)
        else:
            write_meta(tmp / META_NAME, dtype=dtype, eod_id=tok.eod_id, vocab_size=tok.vocab_size,
                       max_id=summary["max_id"], tokenizer=tok.name, files=summary["files"],
                       num_documents=summary["num_documents"], skipped_empty_files=skipped_empty)
        out.mkdir(parents=True, exist_ok=True)
        # Earlier output of either format goes: one directory never mixes them under one meta.json.
        for old in (list(out.glob(f"{SHARD_PREFIX}*.bin")) + list(out.glob(f"{RECORD_PREFIX}*.arrayrecord*"))
                    + [out / META_NAME]):
            old.unlink(missing_ok=True)
        for name in sorted(p.name for p in tmp.iterdir() if p.name != META_NAME):
            os.replace(tmp / name, out / name)
        os.replace(tmp / META_NAME, out / META_NAME)  # last: the directory is complete once it is there
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary.update(dtype=dtype, eod_id=tok.eod_id, vocab_size=tok.vocab_size, inputs=len(files),
                   skipped_empty=skipped_empty)
    return summary


def _write_shards(files: list[Path], tok, dtype: np.dtype, text_field: str, shard_tokens: int, tmp: Path,
                  progress: IO[str]) -> dict:
    bar = Progress(sum(f.stat().st_size for f in files), progress)
    shard_sizes: dict[str, int] = {}
    total = docs = max_id = done_bytes = 0
    fh, name = None, ""  # the open shard and its file name
    try:
        for f in files:
            file_bytes, file_chars = f.stat().st_size, 0
            for ids, n_docs, chars in tokenize_files([f], tok, text_field, key="--input"):
                if fh is None or shard_sizes[name] >= shard_tokens:
                    if fh is not None:
                        fh.close()
                    name = f"{SHARD_PREFIX}{len(shard_sizes):05d}.bin"
                    shard_sizes[name] = 0
                    fh = open(tmp / name, "wb")
                if len(ids):
                    fh.write(ids.astype(dtype).tobytes())
                    max_id = max(max_id, int(ids.max()))
                shard_sizes[name] += len(ids)
                total += len(ids)
                docs += n_docs
                file_chars += chars
                # Characters approximate bytes within a file; exact at each file's end.
                bar.update(done_bytes + min(file_chars, file_bytes), total)
            done_bytes += file_bytes
            bar.update(done_bytes, total, force=True)
    finally:
        if fh is not None:
            fh.close()
        bar.done()
    empty = [n for n, size in shard_sizes.items() if size == 0]
    for n in empty:
        (tmp / n).unlink()
        del shard_sizes[n]
    return {"num_tokens": total, "num_documents": docs, "max_id": max_id, "files": shard_sizes}


def _write_records(files: list[Path], tok, text_field: str, shard_tokens: int, tmp: Path, progress: IO[str]) -> dict:
    """prepare-data's ArrayRecord output: a record per non-empty document, a new file every `shard_tokens`."""
    bar = Progress(sum(f.stat().st_size for f in files), progress)
    records: dict[str, int] = {}
    total = docs = max_id = done_bytes = 0
    writer: Optional[arrayrecord_source.TokenWriter] = None
    shard = 0  # stream tokens in the open file
    try:
        for f in files:
            texts, file_bytes, file_chars = iter_documents(f, text_field, key="--input"), f.stat().st_size, 0
            while batch := list(itertools.islice(texts, 256)):
                file_chars += sum(len(t) for t in batch)
                for ids in tok.encode_batch([t for t in batch if t]):
                    if not len(ids):
                        continue
                    if writer is None or shard >= shard_tokens:
                        if writer is not None:
                            writer.close()
                        name = f"{RECORD_PREFIX}{len(records):05d}.arrayrecord"
                        writer, shard, records[name] = arrayrecord_source.TokenWriter(tmp / name), 0, 0
                    writer.add(ids)
                    records[writer.path.name] += 1
                    shard += len(ids) + 1
                    total += len(ids) + 1  # the stream's length: ids and the eod the reader adds
                    docs += 1
                    max_id = max(max_id, int(ids.max()))
                bar.update(done_bytes + min(file_chars, file_bytes), total)  # characters approximate bytes
            done_bytes += file_bytes
            bar.update(done_bytes, total, force=True)
    finally:
        if writer is not None:
            writer.close()
        bar.done()
    return {"num_tokens": total, "num_documents": docs, "max_id": max(max_id, tok.eod_id if docs else 0),
            "files": records}
