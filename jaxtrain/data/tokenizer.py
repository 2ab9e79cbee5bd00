"""Tokenizers for the `text` source and `jaxtrain prepare-data`: bytes, or a Hugging Face JSON file.

Both give token ids as numpy arrays plus an end-of-document id (`eod_id`) that the packer uses
to find document boundaries:
- `bytes`: ids 0..255 are the UTF-8 bytes of the text; eod is 256, so `vocab_size` is 257 and
  `model.vocab_size` must be at least 257.
- a `tokenizers` JSON file (e.g. `tokenizer.json` of a Hugging Face model): eod is `data.eod_id`
  when set, else the first of the usual end-of-text special tokens that the file defines
  (`EOD_CANDIDATES`), else one id past the tokenizer's vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from jaxtrain.config import ConfigError

BYTES_EOD_ID = 256  # one past the 256 byte values: no byte can be mistaken for a boundary
# Special tokens that mean "end of document" in common tokenizers, most specific first.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|eot_id|>")


class Tokenizer(Protocol):
    name: str  # "bytes" or the resolved path of the JSON file (recorded in meta.json)
    eod_id: int
    vocab_size: int  # smallest model.vocab_size that covers every id, eod included

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), as uint32 arrays."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (generated text; special tokens such as end-of-text left out)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; end of document is 256."""

    name = "bytes"
    eod_id = BYTES_EOD_ID
    vocab_size = BYTES_EOD_ID + 1

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", errors="replace"), np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids: list[int]) -> str:
        # A cut multi-byte character (a sample stopped mid-way) shows as U+FFFD, never an error.
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (the Rust library, no Python code is loaded)."""

    def __init__(self, path: str, eod_id: Optional[int] = None, key: str = "data.tokenizer"):
        import tokenizers  # imported here: only this tokenizer needs it

        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"{key}: tokenizer file '{path}' does not exist (use 'bytes' or a tokenizer.json path)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # the Rust loader raises a plain Exception for any bad file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{key}: tokenizer file '{path}' does not load as a tokenizers JSON file: {first}") from None
        self.name = str(p.resolve())
        base_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        if eod_id is None:
            found = [self._tok.token_to_id(t) for t in EOD_CANDIDATES]
            found = [i for i in found if i is not None]
            # No end-of-text token in the file: append one right after the vocabulary.
            eod_id = found[0] if found else base_vocab
        self.eod_id = int(eod_id)
        self.vocab_size = max(base_vocab, self.eod_id + 1)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids: list[int]) -> str:
        # An appended end-of-text id (one past the file's vocabulary) is not the file's to decode.
        return self._tok.decode([i for i in ids if i != self.eod_id], skip_special_tokens=True)


def load_tokenizer(spec: str, eod_id: Optional[int] = None, key: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer named by `spec`.

    Args:
      spec: "bytes" or a path to a Hugging Face `tokenizers` JSON file.
      eod_id: end-of-document id to use instead of the tokenizer's own (JSON tokenizers only).
      key: config key or CLI flag named in error messages.
    Returns:
      A tokenizer with `name`, `eod_id`, `vocab_size` and `encode_batch`.
    Raises:
      ConfigError: the file is missing or does not load, or eod_id is set for `bytes`.
    """
    if spec == "bytes":
        if eod_id is not None and eod_id != BYTES_EOD_ID:
            raise ConfigError(f"data.eod_id={eod_id} cannot be used with the bytes tokenizer, whose eod id is "
                              f"{BYTES_EOD_ID}; remove data.eod_id")
        return ByteTokenizer()
    return HFTokenizer(spec, eod_id, key)
