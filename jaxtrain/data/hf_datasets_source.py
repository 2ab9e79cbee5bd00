"""Hugging Face `datasets` files (`data.source=hf_datasets`), read with pyarrow (the `datasets` package is
not needed).

- A directory written by `Dataset.save_to_disk`: its `state.json` lists the Arrow files (`_data_files`,
  Arrow IPC stream format) in row order; other `.arrow` files there (`cache-*.arrow` left by `map`) are
  not part of it. A `DatasetDict` saved to disk (`dataset_dict.json`, one folder per split) must be
  named by one split's folder, so that a held-out split never leaks into training.
- `.arrow` files (IPC stream or file format, e.g. the `datasets` cache) and `.parquet` files
  (`Dataset.to_parquet`, the Hub's parquet exports), named directly, by directory or by glob.
Arrow files are memory-mapped: a token column (`data.tokens_field`, lists of ids) is read in place by
row, so only the pages a process's rows touch are loaded; its largest id is found by one pass at open.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from jaxtrain.config import ConfigError
from jaxtrain.data import parquet_source
from jaxtrain.data.record_fields import TokenDocuments, concat_documents, require_column, text_values, token_lists

SUFFIXES = (".arrow", ".parquet")
STATE_NAME = "state.json"
DICT_NAME = "dataset_dict.json"
SIDECARS = (STATE_NAME, f"../{DICT_NAME}")  # what a reader looks for beside a file (`remote_files.local_files`)
BATCH_ROWS = 1024
_FILE_MAGIC = b"ARROW1"  # the first bytes of the IPC file format (the stream format has none)


def _saved_files(folder: Path, key: str) -> list[Path]:
    """The Arrow files a save_to_disk folder's state.json lists, in order."""
    state_path = folder / STATE_NAME
    try:
        state = json.loads(state_path.read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{key}: '{state_path}' is not a datasets state.json with a _data_files list "
                          f"({e.__class__.__name__})") from None
    return [folder / name for name in names]


def _dict_error(folder: Path | str, splits: list[str], key: str) -> None:
    example = Path(folder) / ("train" if "train" in splits or not splits else splits[0])
    raise ConfigError(f"{key}: '{folder}' is a DatasetDict saved to disk (splits {', '.join(splits) or 'none'}); "
                      f"name one split's folder, e.g. '{example}'")


def refuse_dataset_dict(spec: str, key: str) -> None:
    """ConfigError when `spec` is a local folder holding a saved DatasetDict (splits would be read as one)."""
    folder = Path(spec).expanduser()
    if "://" not in spec and (folder / DICT_NAME).is_file():
        _dict_error(spec, sorted(p.name for p in folder.iterdir() if (p / STATE_NAME).is_file()), key)


def data_files(files: list[Path], key: str) -> list[Path]:
    """`files` (local, sorted) in the order to read them: each save_to_disk folder as its state.json says.

    A folder whose state.json lists files that are all among `files` is read as state.json lists them
    (and only those). Files named otherwise (a glob of some of them, a loose .arrow) stay as given.
    Raises:
      ConfigError: files of several splits of one saved DatasetDict, or a state.json naming missing files.
    """
    folders = sorted({f.parent for f in files if (f.parent / STATE_NAME).is_file()})
    for d in {f.parent.parent for f in files if f.parent in folders and (f.parent.parent / DICT_NAME).is_file()}:
        splits = sorted({f.parent.name for f in files if f.parent.parent == d})
        if len(splits) > 1:
            _dict_error(d, splits, key)
    given = set(files)
    out: list[Path] = []
    done: set[Path] = set()
    for f in files:
        if f.parent in folders and f.parent not in done:
            listed = _saved_files(f.parent, key)
            if all(p in given for p in listed):
                out += listed
                done.add(f.parent)
                continue
            missing = [p for p in listed if not p.is_file()]
            if missing:
                raise ConfigError(f"{key}: '{f.parent / STATE_NAME}' lists '{missing[0].name}', which is not there")
        if f.parent not in done:
            out.append(f)
    return out


def _table(path: Path, key: str) -> Any:
    """An Arrow file as a table over a memory map (nothing is read until used)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path), "r")
        is_file_format = source.read(len(_FILE_MAGIC)) == _FILE_MAGIC
        source.seek(0)
        reader = pa.ipc.open_file(source) if is_file_format else pa.ipc.open_stream(source)
        return reader.read_all()
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: '{path}' is not a readable Arrow file ({first})") from None


def _batches(table: Any, field: str | None) -> Iterator[tuple[int, Any]]:
    """(first row, record batch) over a table's rows, only column `field` (None: all)."""
    if field is not None:
        table = table.select([field])
    row = 0
    for batch in table.to_batches(max_chunksize=BATCH_ROWS):
        yield row, batch
        row += batch.num_rows


def iter_rows(path: Path, key: str) -> Iterator[tuple[str, dict]]:
    """Every row of one .arrow or .parquet file as `(where, row)`, where 'file:row N' (N from 0)."""
    if path.suffix == ".parquet":
        yield from parquet_source.iter_rows(path, key)
        return
    for first, batch in _batches(_table(path, key), None):
        for i, row in enumerate(batch.to_pylist(), first):
            yield f"{path}:row {i}", row


def texts(path: Path, field: str, key: str) -> Iterator[list[str]]:
    """The strings of column `field`, a batch at a time."""
    if path.suffix == ".parquet":
        yield from parquet_source.texts(path, field, key)
        return
    table = _table(path, key)
    require_column(table.column_names, field, path, key, "data.text_field")
    for first, batch in _batches(table, field):
        yield text_values(batch.column(0), field, path, first, key)


def token_documents(path: Path, field: str, key: str) -> TokenDocuments:
    """The token-id lists of column `field`: in place over the memory map for .arrow, read whole for .parquet."""
    if path.suffix == ".parquet":
        return parquet_source.token_documents(path, field, key)
    table = _table(path, key)
    require_column(table.column_names, field, path, key, "data.tokens_field")
    chunks, first = [], 0
    for chunk in table.column(field).chunks:
        chunks.append(token_lists(chunk, field, path, first, key))
        first += len(chunk)
    return concat_documents(chunks)
