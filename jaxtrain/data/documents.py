"""Rows and documents of the record sources: one interface over text/jsonl, ArrayRecord, Parquet and
Hugging Face `datasets` files.

- `iter_rows(source, spec, key)` yields `(where, row)` for every row in file order: `row` a dict of the
  row's fields, `where` "file:row" for messages. Chat and prompt/completion data read their rows here.
- `open_documents(...)` (the record sources with `data.format: text`) gives a `Corpus`: each row's
  `text_field` tokenized, or its `tokens_field` read as ids.

(In progress: the ArrayRecord, Parquet and `datasets` readers land in their own modules.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from jaxtrain.config import ConfigError
from jaxtrain.data.sources import resolve_paths


def _jsonl_rows(path: Path, key: str) -> Iterator[tuple[str, dict]]:
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


def iter_rows(source: str, spec: str, key: str) -> Iterator[tuple[str, dict]]:
    """Every row of the files `spec` names, in file order, as `(where, fields)`.

    Args:
      source: data.source (text: .jsonl lines; arrayrecord, parquet, hf_datasets).
      spec: file, directory or glob.
      key: config key named in error messages.
    Raises:
      ConfigError: missing files, unreadable rows.
    """
    if source == "text":
        for f in resolve_paths(spec, key, (".jsonl",)):
            if f.suffix != ".jsonl":
                raise ConfigError(f"{key}: '{f}' is not a .jsonl file; rows of chat or prompt/completion data are "
                                  "JSON lines")
            yield from _jsonl_rows(f, key)
        return
    raise ConfigError(f"{key}: rows of data.source={source} are not readable yet")
