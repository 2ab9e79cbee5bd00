"""What a row's fields must hold, for every record format (ArrayRecord, Parquet, `datasets` files): a text
field is a string, a token field a list of non-negative integers. The checks for JSON values and for
Arrow columns, and the one-line errors when a file breaks them, live here so each format says the same.

A format module (`arrayrecord_source.py`, `parquet_source.py`, `hf_datasets_source.py`) gives a file's
token ids as `TokenDocuments`: how many ids each document holds, a function that reads document i, and
the largest id. `documents.DocumentStream` turns that into one stream with eod ids between documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from jaxtrain.config import ConfigError


class TokenDocuments(NamedTuple):
    """One file's documents of token ids, read by index.

    Attributes:
      lengths: int64 [documents], token ids per document (no eod).
      read: document index -> its ids (a 1-D integer array of `lengths[i]` ids).
      max_id: the largest id in the file (0 when it holds none).
    """

    lengths: np.ndarray
    read: Callable[[int], np.ndarray]
    max_id: int


# ----------------------------------------------------------------------------- JSON values


def json_text(row: dict, field: str, where: str, key: str) -> str:
    """`row[field]` when it is a string, else ConfigError naming the place (`where`: 'file:row N')."""
    value = row.get(field)
    if not isinstance(value, str):
        got = "missing" if field not in row else f"a {type(value).__name__}"
        raise ConfigError(f"{key}: {where} has no string field '{field}' ({got}; set data.text_field)")
    return value


def json_tokens(row: dict, field: str, where: str, key: str) -> np.ndarray:
    """`row[field]` as uint32 ids when it is a list of non-negative integers, else ConfigError."""
    value = row.get(field)
    ids = None
    # JSON true/false parse as bools, which numpy would take as 1/0: not token ids.
    if isinstance(value, list) and not any(isinstance(v, bool) for v in value):
        try:
            arr = np.asarray(value)
        except (ValueError, OverflowError):
            arr = None
        if arr is not None and arr.ndim == 1 and (arr.dtype.kind in "iu" or len(arr) == 0):
            if len(arr) == 0 or (int(arr.min()) >= 0 and int(arr.max()) < 2**32):
                ids = arr.astype(np.uint32)
    if ids is None:
        got = "missing" if field not in row else f"a {type(value).__name__}"
        raise ConfigError(f"{key}: {where} field '{field}' is not a list of token ids ({got}; "
                          "expected non-negative integers below 2**32; set data.tokens_field)")
    return ids


# ----------------------------------------------------------------------------- Arrow columns


def require_column(names: list[str], field: str, path: Path, key: str, setting: str) -> None:
    """ConfigError unless a file with columns `names` has `field` (`setting`: the config key that names it)."""
    if field not in names:
        raise ConfigError(f"{key}: '{path}' has no column '{field}' (its columns: {', '.join(names) or 'none'}); "
                          f"set {setting}")


def text_values(column: Any, field: str, path: Path, first_row: int, key: str) -> list[str]:
    """The strings of an Arrow text column chunk (`first_row`: its first row's index in the file, for messages).

    Raises:
      ConfigError: the column is not text, or a row of it is null.
    """
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            or pa.types.is_string_view(column.type)):
        raise ConfigError(f"{key}: column '{field}' of '{path}' holds {column.type}, not text (set data.text_field, "
                          "or data.tokens_field for token ids)")
    if column.null_count:
        row = first_row + int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise ConfigError(f"{key}: {path}:row {row} field '{field}' is null, not a string")
    return column.to_pylist()


def token_lists(column: Any, field: str, path: Path, first_row: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """An Arrow column chunk of token-id lists as (values, offsets): document j is values[offsets[j]:offsets[j+1]].

    `values` is the chunk's own buffer where Arrow allows it (no copy: a memory-mapped file stays on disk).
    Raises:
      ConfigError: the column is not a list of integers, or a row is null or holds a negative id.
    """
    import pyarrow as pa

    t = column.type
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if not is_list or not pa.types.is_integer(t.value_type):
        held = f"lists of {t.value_type}" if is_list else str(t)
        raise ConfigError(f"{key}: column '{field}' of '{path}' holds {held}, not lists of integer token ids "
                          "(set data.tokens_field, or unset it to tokenize data.text_field)")
    if column.null_count:
        row = first_row + int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise ConfigError(f"{key}: {path}:row {row} field '{field}' is null, not a list of token ids")
    if pa.types.is_fixed_size_list(t):
        offsets = (np.arange(len(column) + 1, dtype=np.int64) + column.offset) * t.list_size
    else:
        offsets = column.offsets.to_numpy().astype(np.int64, copy=False)  # absolute positions in .values
    values = column.values
    lo, hi = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
    if values.slice(lo, hi - lo).null_count:
        raise ConfigError(f"{key}: column '{field}' of '{path}' holds null token ids")
    flat = values.to_numpy(zero_copy_only=values.null_count == 0)
    used = flat[lo:hi]
    if len(used) and pa.types.is_signed_integer(t.value_type) and int(used.min()) < 0:
        raise ConfigError(f"{key}: column '{field}' of '{path}' holds negative token ids")
    return flat, offsets


def concat_documents(chunks: list[tuple[np.ndarray, np.ndarray]]) -> TokenDocuments:
    """`TokenDocuments` over (values, offsets) chunks (`token_lists`), read in place."""
    lengths = np.concatenate([np.diff(off) for _, off in chunks]) if chunks else np.zeros(0, np.int64)
    first = np.cumsum([0] + [len(off) - 1 for _, off in chunks])  # first document index of each chunk
    max_id = max((int(v[off[0]:off[-1]].max()) for v, off in chunks if len(off) and off[-1] > off[0]), default=0)

    def read(i: int) -> np.ndarray:
        c = int(np.searchsorted(first, i, side="right")) - 1
        values, offsets = chunks[c]
        j = i - int(first[c])
        return values[offsets[j]:offsets[j + 1]]

    return TokenDocuments(lengths.astype(np.int64), read, max_id)
