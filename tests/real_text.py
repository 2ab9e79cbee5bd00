"""Real text for tests, made at test time from files on the machine: a corpus of the Python standard
library's own source (real code and docstrings, uneven documents, empty files among them), a
byte-level BPE tokenizer trained on it with `tokenizers`, and jaxtrain token files of both halves.

The Markov chain tests learning to a known floor; this tests what users meet (warmup gradient-norm
growth, a loss that falls unevenly, documents of every length). No path of this machine is named:
the corpus is found through the running interpreter's own standard library.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

EOT = "<|endoftext|>"


@dataclasses.dataclass(frozen=True)
class RealText:
    """A prepared corpus: `train` and `eval` token directories, the tokenizer that made them."""

    tokenizer: Path
    train: Path
    eval: Path
    train_files: tuple[Path, ...]
    eval_files: tuple[Path, ...]
    vocab_size: int
    eod_id: int


def stdlib_sources(max_bytes: int) -> list[Path]:
    """Top-level modules of the standard library (sorted, symlinks left out), up to `max_bytes` in all."""
    lib = Path(os.path.dirname(json.__path__[0]))
    files, total = [], 0
    for f in sorted(lib.glob("*.py")):
        if f.is_symlink() or not f.is_file():
            continue
        size = f.stat().st_size
        if total + size > max_bytes:
            continue  # a smaller one may still fit
        files.append(f)
        total += size
    return files


def train_tokenizer(files: list[Path], path: Path, vocab_size: int) -> Path:
    """A byte-level BPE (GPT-2 style) with `<|endoftext|>` as id 0, trained on `files`, saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    tok.save(str(path))
    return path


def copy_as_text(files: list[Path], folder: Path) -> list[Path]:
    """`files` copied as .txt (prepare-data reads .txt/.jsonl from a directory), names kept unique."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        target = folder / f"{f.stem}.txt"
        target.write_bytes(f.read_bytes())
        out.append(target)
    return out


def make_real_text(root: Path, *, vocab_size: int = 1024, max_bytes: int = 1_500_000, eval_every: int = 8) -> RealText:
    """The corpus under `root`: every `eval_every`-th file held out, a tokenizer trained on the rest,
    both halves prepared into token files in-process (`jaxtrain.data.prepare.prepare`)."""
    from jaxtrain.data.prepare import prepare

    files = stdlib_sources(max_bytes)
    held = files[::eval_every]
    kept = [f for f in files if f not in held]
    train_txt = copy_as_text(kept, root / "text-train")
    eval_txt = copy_as_text(held, root / "text-eval")
    tokenizer = train_tokenizer(train_txt, root / "tokenizer.json", vocab_size)
    quiet = open(os.devnull, "w")
    with quiet:
        summary = prepare([str(root / "text-train")], str(root / "train"), tokenizer=str(tokenizer), progress=quiet)
        prepare([str(root / "text-eval")], str(root / "eval"), tokenizer=str(tokenizer), progress=quiet)
    return RealText(tokenizer=tokenizer, train=root / "train", eval=root / "eval", train_files=tuple(train_txt),
                    eval_files=tuple(eval_txt), vocab_size=vocab_size, eod_id=int(summary["eod_id"]))
