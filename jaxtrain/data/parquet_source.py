"""Parquet files (`data.source=parquet`, and `.parquet` files of `data.source=hf_datasets`), read with pyarrow.

A file is read one record batch at a time (at most `BATCH_ROWS` rows, within a row group), and only
the column a reader needs: `data.text_field` (strings, tokenized at open) or `data.tokens_field`
(lists of integer ids). Parquet has no cheap read by row, so a token column is read whole, column-wise,
when the source opens and kept in memory (its ids as one flat array, plus an offset per row); the text
and the other columns never are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from jaxtrain.config import ConfigError
from jaxtrain.data.record_fields import TokenDocuments, concat_documents, require_column, text_values, token_lists

SUFFIXES = (".parquet",)
BATCH_ROWS = 1024


def _open(path: Path, key: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: '{path}' is not a readable Parquet file ({first})") from None


def _batches(path: Path, key: str, columns: list[str] | None) -> Iterator[tuple[int, Any]]:
    """(first row, record batch) through the file, reading only `columns` (None: all)."""
    import pyarrow as pa

    pf = _open(path, key)
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield row, batch
            row += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: '{path}' is not a readable Parquet file ({first})") from None
    finally:
        pf.close()


def column_names(path: Path, key: str) -> list[str]:
    """The top-level column names of a Parquet file."""
    pf = _open(path, key)
    try:
        return list(pf.schema_arrow.names)
    finally:
        pf.close()


def iter_rows(path: Path, key: str) -> Iterator[tuple[str, dict]]:
    """Every row of one file as `(where, row)`, where 'file:row N' (N from 0)."""
    for first, batch in _batches(path, key, None):
        for i, row in enumerate(batch.to_pylist(), first):
            yield f"{path}:row {i}", row


def texts(path: Path, field: str, key: str) -> Iterator[list[str]]:
    """The strings of column `field`, a batch at a time."""
    require_column(column_names(path, key), field, path, key, "data.text_field")
    for first, batch in _batches(path, key, [field]):
        yield text_values(batch.column(0), field, path, first, key)


def token_documents(path: Path, field: str, key: str) -> TokenDocuments:
    """The token-id lists of column `field`, read whole now (see the module docstring)."""
    require_column(column_names(path, key), field, path, key, "data.tokens_field")
    chunks = [token_lists(batch.column(0), field, path, first, key) for first, batch in _batches(path, key, [field])]
    return concat_documents(chunks)
