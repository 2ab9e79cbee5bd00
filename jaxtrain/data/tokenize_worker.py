"""A token-cache worker: `python -m jaxtrain.data.tokenize_worker` encodes the files of the task on its stdin.

`token_cache.encode` starts these (fresh interpreters: never a fork of a process that runs JAX) and hands each
a JSON task: `{"encoding": Encoding's fields, "key": config key, "jobs": [[file, entry], ...]}`. The worker
loads the tokenizer once, encodes each file with the encoder for the encoding's kind and writes its entry. A
`ConfigError` (a bad file or row) is printed as the last line of stderr after `token_cache.ERROR_MARK`, with
the file, and the worker exits 2; the opening process raises it as the same one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxtrain.config import ConfigError
from jaxtrain.data import token_cache
from jaxtrain.data.documents import encode_documents
from jaxtrain.data.examples import encode_example_file
from jaxtrain.data.tokenizer import load_tokenizer

ENCODERS: dict[str, token_cache.Encoder] = {"documents": encode_documents, "examples": encode_example_file}


def main() -> int:
    """Encode the jobs of the JSON task on stdin; 0 when all are written, 2 on a ConfigError."""
    task = json.loads(sys.stdin.read())
    fields = task["encoding"]
    fields["variables"] = tuple(tuple(v) for v in fields["variables"])
    encoding = token_cache.Encoding(**fields)
    tokenizer = load_tokenizer(encoding.tokenizer, encoding.eod_id)
    for path, entry in task["jobs"]:
        try:
            made = ENCODERS[encoding.kind](encoding, Path(path), task["key"], tokenizer)
        except ConfigError as e:
            sys.stderr.write(token_cache.ERROR_MARK + json.dumps({"path": path, "message": str(e)}) + "\n")
            return 2
        token_cache.write_entry(Path(entry), encoding, Path(path), made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
