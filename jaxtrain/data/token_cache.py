"""Text tokenized once per host, by worker processes, and kept on disk.

Every source that holds text (`data.source: text`, the record sources' `text_field`, chat and
prompt/completion rows) must be turned into ids before its rows can be cut. Done in the training
process, that would hold the training thread for minutes on a real corpus, hold the ids in its memory,
and be repeated at every restart. Instead each file's encoding is a **cache entry**:

  <cache>/tokenized/<digest>/    digest = sha256 of (the file's identity, the encoding)
    info.json                    written last: an entry without it is incomplete and never read
    tokens.npy                   documents: each document's ids, then the eod id (uint16 or uint32)
    ids.npy masks.npy offsets.npy where.txt    examples: ids, learn masks, example i = [o[i], o[i+1]), rows

`<cache>` is JAXTRAIN_DATA_CACHE (else ~/.cache/jaxtrain/data: beside the copies of bucket files). A
file's identity is its path, size, modification time, inode and a hash of its first and last 64 KiB; the
encoding is everything that decides the ids: the tokenizer file's content hash, the eod id, the field, the
row format, the chat template and its variables, and `CACHE_VERSION`. A changed file or setting is a new
entry; nothing is ever overwritten. Entries are written into a temporary folder and renamed into place,
so a killed encoder leaves nothing that is read (its folder is removed by the next encoder of that file
once a day old), and processes encoding the same file at once (hosts sharing a file system) each write a
whole entry and one wins.

Files still to encode go to `data.tokenize_workers` worker processes (`python -m jaxtrain.data.tokenize_worker`,
started fresh: never a fork of a process that runs JAX), the largest files first, each worker a share
of the files. Inputs under `INLINE_BYTES` are encoded in the opening process: starting a worker costs
more than they do. The processes of one host that open the same files at once take turns on a lock file:
one encodes, the others then read its entries. The ids are then memory-mapped from the entry (documents) or read (examples, which
are packed in memory). So the tokenizer runs once per file per host, on no training thread, and a
restarted or resumed run opens its corpus without tokenizing anything.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data.tokenizer import Tokenizer

_log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when an encoder's output changes: old entries are then never read
INLINE_BYTES = 4 << 20  # inputs smaller than this are encoded in the opening process (module constant: tests)
_EDGE_BYTES = 64 << 10  # hashed from each end of a file, besides its size and times
ABANDONED_S = 24 * 3600  # a temporary folder older than this belongs to a writer that died
ERROR_MARK = "jaxtrain-token-cache-config-error: "  # a worker's ConfigError, as the last line of its stderr
WORKER_MODULE = "jaxtrain.data.tokenize_worker"  # run as `python -m`: it imports the encoders, this module does not


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a file's text becomes ids: everything that decides them besides the file.

    Attributes:
      kind: `documents` (each text, then the eod id) or `examples` (chat / prompt-completion rows: ids and masks).
      source: data.source of the file (text, arrayrecord, parquet, hf_datasets): how its rows are read.
      tokenizer: data.tokenizer (`bytes` or a tokenizers JSON file); eod_id: data.eod_id (None: the tokenizer's).
      text_field: documents: the field of a row that holds the text.
      fmt: examples: `chat` or `prompt_completion`.
      template, variables: examples of format chat: the template source and the strings passed to it.
    """

    kind: Literal["documents", "examples"]
    source: str
    tokenizer: str
    eod_id: Optional[int]
    text_field: str = "text"
    fmt: str = "text"
    template: Optional[str] = None
    variables: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, kind: Literal["documents", "examples"], source: str, tokenizer: Tokenizer, **fields) -> "Encoding":
        """The encoding by a loaded tokenizer (its file, or `bytes`, and its resolved eod id)."""
        return cls(kind, source, tokenizer.name, tokenizer.eod_id, **fields)


@dataclasses.dataclass
class EncodedDocuments:
    """A file's documents: `tokens` (memory-mapped; each document's ids then the eod id), `max_id` (0 if empty)."""

    tokens: np.ndarray
    max_id: int


@dataclasses.dataclass
class EncodedExamples:
    """A file's examples: example i is `ids[offsets[i]:offsets[i + 1]]` (int32) with its learn mask in `masks`
    (bool); `where(i)` names its row (file:line) for messages."""

    ids: np.ndarray
    masks: np.ndarray
    offsets: np.ndarray
    max_id: int
    entry: Path

    def where(self, i: int) -> str:
        with open(self.entry / "where.txt", encoding="utf-8") as fh:
            for k, line in enumerate(fh):
                if k == i:
                    return line.rstrip("\n")
        raise IndexError(i)


def cache_root() -> Path:
    """Where entries live: `<JAXTRAIN_DATA_CACHE or ~/.cache/jaxtrain/data>/tokenized`."""
    from jaxtrain.runtime.env import data_cache_dir
    return Path(data_cache_dir()) / "tokenized"


@functools.lru_cache(maxsize=16)
def _tokenizer_digest(spec: str, size: int, mtime_ns: int) -> str:
    with open(spec, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _file_identity(path: Path) -> dict:
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(_EDGE_BYTES))
        if st.st_size > _EDGE_BYTES:
            fh.seek(max(_EDGE_BYTES, st.st_size - _EDGE_BYTES))
            h.update(fh.read(_EDGE_BYTES))
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "edges": h.hexdigest()}


def entry_digest(encoding: Encoding, path: Path) -> str:
    """The cache entry's name for `path` encoded by `encoding` (see the module docstring)."""
    fields = dataclasses.asdict(encoding)
    if encoding.tokenizer != "bytes":
        st = Path(encoding.tokenizer).expanduser().stat()
        fields["tokenizer_sha256"] = _tokenizer_digest(str(Path(encoding.tokenizer).expanduser()), st.st_size,
                                                       st.st_mtime_ns)
    blob = json.dumps({"version": CACHE_VERSION, "encoding": fields, "file": _file_identity(path)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# ----------------------------------------------------------------------------- entries


@dataclasses.dataclass
class FileEncoding:
    """What an encoder made of one file: the entry's arrays, its `info` (at least `tokens` and `max_id`) and,
    for examples, each one's row (file:line)."""

    arrays: dict[str, np.ndarray]
    info: dict
    where: Sequence[str] = ()


# encoder(encoding, file, key, tokenizer): one file's encoding (documents.encode_documents,
# examples.encode_example_file; the worker finds them by `Encoding.kind`: tokenize_worker.py)
Encoder = Callable[[Encoding, Path, str, Tokenizer], FileEncoding]


def write_entry(entry: Path, encoding: Encoding, path: Path, made: FileEncoding) -> None:
    """Write an entry into a temporary folder beside it, then rename it into place (another writer may win)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        for name, arr in made.arrays.items():
            np.save(tmp / f"{name}.npy", arr)
        if made.where:
            (tmp / "where.txt").write_text("".join(f"{w}\n" for w in made.where), encoding="utf-8")
        (tmp / "info.json").write_text(json.dumps({"kind": encoding.kind, "file": str(path), **made.info}),
                                       encoding="utf-8")
        try:
            os.rename(tmp, entry)
        except OSError:
            if (entry / "info.json").exists():  # another writer won the race: its entry is as good
                return
            shutil.rmtree(entry)  # an entry without info.json is incomplete (not ours to keep): replace it
            os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- workers


def _shares(sizes: list[int], workers: int) -> list[list[int]]:
    """Indices split into `workers` shares of about equal bytes: the largest first, each to the lightest share."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        w = load.index(min(load))
        shares[w].append(i)
        load[w] += sizes[i]
    return [s for s in shares if s]


def _run_workers(encoding: Encoding, jobs: list[tuple[Path, Path]], key: str, workers: int) -> None:
    """Encode `jobs` ((file, entry) pairs) in `workers` fresh processes; the first ConfigError is raised here."""
    shares = _shares([f.stat().st_size for f, _ in jobs], workers)
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # a worker never opens an accelerator
    # tokenizers' own threads, split between the workers rather than each taking every core
    env["RAYON_RS_NUM_CPUS"] = str(max(1, len(os.sched_getaffinity(0)) // len(shares)))
    procs: list[tuple[subprocess.Popen, object]] = []
    try:
        for share in shares:
            task = {"encoding": dataclasses.asdict(encoding), "key": key,
                    "jobs": [[str(jobs[i][0]), str(jobs[i][1])] for i in share]}
            err = tempfile.TemporaryFile()
            p = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=err, env=env)
            p.stdin.write(json.dumps(task).encode())
            p.stdin.close()
            procs.append((p, err))
        while procs:
            for p, err in list(procs):
                if p.poll() is None:
                    continue
                procs.remove((p, err))
                err.seek(0)
                text = err.read().decode("utf-8", errors="replace")
                err.close()
                if p.returncode == 0:
                    continue
                lines = text.strip().splitlines()
                if lines and lines[-1].startswith(ERROR_MARK):
                    found = json.loads(lines[-1][len(ERROR_MARK):])
                    raise ConfigError(found["message"])  # the encoders name a bucket's object by its URL
                raise RuntimeError(f"a tokenizing worker failed (exit {p.returncode}): {' | '.join(lines[-5:])}")
            time.sleep(0.05)
    finally:
        for p, err in procs:  # another worker failed: the rest stop (their partial entries are never read)
            p.kill()
            p.wait()
            err.close()


def encode(encoding: Encoding, files: Sequence[Path], key: str, tokenizer: Tokenizer, encoder: Encoder,
           workers: Optional[int] = None, inline_bytes: Optional[int] = None) -> list[EncodedDocuments | EncodedExamples]:
    """Each file's encoding, from the cache, encoding the files not yet there first.

    Args:
      encoding: how the files become ids.
      files: local files (bucket objects already copied), in reading order.
      key: the config key named in errors ('data.path', 'data.mixture[1] (web)').
      tokenizer: the tokenizer `encoding` names, loaded (used when encoding in this process).
      encoder: encodes one file in this process (workers use the one for `encoding.kind`: tokenize_worker.py).
      workers: processes that encode (data.tokenize_workers; None: one per CPU; 0: this process).
      inline_bytes: inputs smaller than this are encoded in this process (default INLINE_BYTES).
    Returns:
      One `EncodedDocuments` (kind documents) or `EncodedExamples` (kind examples) per file, in order.
    Raises:
      ConfigError: a file or row that cannot be read or encoded (one line naming `key`, the file, the row).
    """
    root = cache_root()
    entries = [root / entry_digest(encoding, f) for f in files]
    if any(not (e / "info.json").exists() for e in entries):
        _check_writable(root, key)
        # The processes of one host opening the same files take turns: the first encodes, the others then
        # find its entries (a lock file per set of entries; flock is released if its holder dies).
        locks = root / ".locks"  # left in place: removing a lock file another process holds would split the turn
        locks.mkdir(exist_ok=True)
        with open(locks / hashlib.sha256("".join(e.name for e in entries).encode()).hexdigest()[:32], "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            _encode_missing(encoding, files, entries, key, tokenizer, encoder, workers, inline_bytes)
    return [_load(e) for e in entries]


def _encode_missing(encoding: Encoding, files: Sequence[Path], entries: list[Path], key: str, tokenizer: Tokenizer,
                    encoder: Encoder, workers: Optional[int], inline_bytes: Optional[int]) -> None:
    """Encode the files whose entries are still missing (another process may have written them while this one
    waited for the lock), in this process or in workers."""
    root = cache_root()
    todo = [(f, e) for f, e in zip(files, entries) if not (e / "info.json").exists()]
    for _, e in todo:
        _remove_abandoned(e)
    if todo:
        size = sum(f.stat().st_size for f, _ in todo)
        # the CPUs this process may run on (a SLURM task's or container's share), not the machine's
        workers = min(len(os.sched_getaffinity(0)), 32) if workers is None else workers
        workers = min(workers, len(todo))
        if size < (INLINE_BYTES if inline_bytes is None else inline_bytes):
            workers = 0
        start = time.perf_counter()
        if workers == 0:
            for f, e in todo:
                write_entry(e, encoding, f, encoder(encoding, f, key, tokenizer))
        else:
            _run_workers(encoding, todo, key, workers)
        # said only where it took workers: the wait a user sees once, then never again for these files
        (_log.info if workers else _log.debug)(
            "%s: tokenized %d file(s), %.1f MB, in %.1f s (%s); cached for the next open under %s", key, len(todo),
            size / 1e6, time.perf_counter() - start, f"{workers} worker processes" if workers else "in this process",
            root)


def _remove_abandoned(entry: Path) -> None:
    """Remove temporary folders of `entry` left by writers killed mid-save (older than ABANDONED_S: a writer
    still at work elsewhere, on another host sharing the cache, keeps its folder)."""
    for tmp in entry.parent.glob(f".{entry.name}.*"):
        try:
            if time.time() - tmp.stat().st_mtime > ABANDONED_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:  # its writer renamed or removed it meanwhile
            pass


def _check_writable(root: Path, key: str) -> None:
    """A cache folder that cannot be written is the user's to fix: one line, before any worker starts."""
    from jaxtrain.runtime.env import DATA_CACHE
    try:
        root.mkdir(parents=True, exist_ok=True)
        writable = os.access(root, os.W_OK | os.X_OK)
        why = "not writable"
    except OSError as e:
        writable, why = False, e.strerror or type(e).__name__
    if not writable:
        raise ConfigError(f"{key}: the token cache '{root}' cannot be written ({why}); set {DATA_CACHE} to a "
                          "writable folder")


def _load(entry: Path) -> EncodedDocuments | EncodedExamples:
    info = json.loads((entry / "info.json").read_text(encoding="utf-8"))

    def array(name: str) -> np.ndarray:
        # np.load cannot memory-map an empty array
        return np.load(entry / f"{name}.npy", mmap_mode="r" if info["tokens"] else None)

    if info["kind"] == "documents":
        return EncodedDocuments(array("tokens"), info["max_id"])
    return EncodedExamples(array("ids"), array("masks"), np.load(entry / "offsets.npy"), info["max_id"], entry)
