"""Data files named by gs:// or s3:// URLs, copied once to local disk and read from there.

The readers want local files: token files and Arrow files are memory-mapped, ArrayRecord reads by
record index, and `datasets` directories are found by their `state.json`. So every file source (tokens,
text and the record sources) takes its files from `local_files`, and a remote spec (an object, a "directory"
prefix or a glob) is listed with the bucket's fsspec client (`storage.object_store.filesystem`), and
each object is copied into a cache folder (JAXTRAIN_DATA_CACHE, else ~/.cache/jaxtrain/data) under its
bucket and name: `<cache>/s3/bucket/path/file`. Beside each copy, `<file>.source` records the URL,
size and version (etag or generation) it came from; a copy whose record no longer matches the object
is fetched again, one that matches is used as it is (the next run, or the other processes of a host).
A copy is written under a temporary name and renamed when complete, so a killed copy is never read.

Listing and copying are retried on errors that mean "no answer" (5xx, throttling, timeouts:
`object_store.is_transient`); after RETRY_ATTEMPTS it is TransientStorageError (the CLI exits 75:
restart the job). A definite answer (no such object, no access) is ConfigError at once. Errors about
a copy's contents name the object's URL, which the user wrote (`urls_in_errors`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

from jaxtrain.config import ConfigError
from jaxtrain.runtime import env
from jaxtrain.storage import object_store
from jaxtrain.storage.paths import is_remote

T = TypeVar("T")
META_NAME = "meta.json"  # token files' sidecar (sources.py): never a data file itself, also not in a glob
RETRY_ATTEMPTS = 4  # module constants, read at each call, so tests can shorten them
RETRY_FIRST_WAIT_S = 0.5  # then 2x each attempt, times a jitter in [0.5, 1.5)
_COPY_CHUNK = 8 << 20


def resolve_paths(spec: str, key: str, dir_suffixes: tuple[str, ...], allow_empty: bool = False) -> list[Path]:
    """The local files named by `spec`, in a fixed (sorted) order (`remote_files.local_files` takes buckets too).

    Args:
      spec: a file, a directory (its files ending in `dir_suffixes`, recursively) or a glob, on local disk.
      key: config key or CLI flag named in error messages (e.g. 'data.path').
      dir_suffixes: which files of a directory belong to the source.
      allow_empty: return empty files too, for a caller that skips them (`prepare-data`).
    Returns:
      Non-empty list of existing, non-empty files (empty ones too with `allow_empty`). The order decides
      the stream order.
    Raises:
      ConfigError: nothing matches, a matched file is empty (unless `allow_empty`), or `spec` is a URL.
    """
    if is_remote(spec):  # else "does not exist", as if the URL were a local name
        raise ConfigError(f"{key}: '{spec}' is a URL; {key} takes local files only (copy them to local disk first)")
    p = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(str(p), recursive=True))]
        files = [f for f in files if f.is_file() and f.name != META_NAME]
        if not files:
            raise ConfigError(f"{key}: the glob '{spec}' matches no files")
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in dir_suffixes)
        if not files:
            raise ConfigError(f"{key}: directory '{spec}' has no {' or '.join(dir_suffixes)} files; to read files "
                              f"with other names, pass them or a quoted glob, e.g. '{os.path.join(spec, '*.md')}'")
    elif p.is_file():
        files = [p]
    else:
        raise ConfigError(f"{key}: '{spec}' does not exist (expected a file, directory or glob)")
    for f in files:
        if f.stat().st_size == 0 and not allow_empty:
            raise ConfigError(f"{key}: file '{f}' is empty")
    return files


def local_files(spec: str, key: str, suffixes: tuple[str, ...], sidecars: tuple[str, ...] = (),
                cache_dir: Optional[str] = None) -> list[Path]:
    """The files `spec` names, on local disk: local paths as they are, remote objects as cached copies.

    Args:
      spec: a file, a directory (its files ending in `suffixes`, recursively) or a glob; local, gs:// or s3://.
      key: config key named in error messages.
      suffixes: which files of a directory belong to the source.
      sidecars: files a reader looks for beside the data files, copied along when they exist: a name
        ('meta.json': in the data file's folder), '../name' (in the folder above) or '.suffix' (the data
        file's own name plus it: '.lengths.npy'). Local specs need nothing copied.
      cache_dir: where copies go (default: JAXTRAIN_DATA_CACHE, else ~/.cache/jaxtrain/data).
    Returns:
      The data files in a fixed (sorted) order; their sidecars sit beside them.
    Raises:
      ConfigError: nothing matches, a file is empty, no access to the bucket or an object.
      TransientStorageError: the store did not answer, even after retries.
    """
    if not is_remote(spec):
        return resolve_paths(spec, key, suffixes)
    object_store.check_access(spec, key=key)  # scheme, client library, credentials, bucket: one line each
    scheme = object_store.split_url(spec)[0]
    fs = object_store.filesystem(spec)
    # A glob never matches meta.json, a sidecar of token and ArrayRecord files (as `resolve_paths` locally).
    objects = _retry(lambda: _list(fs, spec, key, suffixes, (META_NAME, *sidecars)), f"{key}: listing '{spec}'")
    root = Path(cache_dir or env.data_cache_dir()).expanduser()
    folders: dict[str, dict[str, dict]] = {}  # folder -> its objects, listed once for all its files' sidecars
    files = []
    for name in sorted(objects):
        files.append(_fetch(fs, scheme, name, objects[name], root, key))
        for side in sidecars:
            side_name = _sidecar_name(name, side)
            folder = side_name.rpartition("/")[0]
            if folder not in folders:
                folders[folder] = _retry(lambda: _folder(fs, f"{scheme}://{folder}"), f"{key}: listing '{folder}'")
            if side_name in folders[folder]:
                _fetch(fs, scheme, side_name, folders[folder][side_name], root, key)
            else:  # a copy left from an earlier version of the folder would be read as if it belonged
                _local_path(root, scheme, side_name, key).unlink(missing_ok=True)
    return files


def source_url(path: Path) -> Optional[str]:
    """The gs:// or s3:// URL a cached copy came from (for messages), or None for a file that is not one."""
    try:
        return json.loads(path.with_name(path.name + ".source").read_text())["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def urls_in_errors(files: list[Path]) -> Iterator[None]:
    """ConfigErrors raised inside name the bucket objects among `files` by their URLs, not by their cached copies.

    A copy is `<cache>/<scheme>/<bucket>/<name>`, so each copy's folder stands for its URL's folder; local
    files (no `.source` record beside them) are left as they are.
    """
    try:
        yield
    except ConfigError as e:
        message = str(e)
        for folder, f in {f.parent: f for f in files}.items():
            url = source_url(f)
            if url is not None:
                message = message.replace(str(folder), url.rpartition("/")[0])
        if message == str(e):
            raise
        raise ConfigError(message) from None


def _sidecar_name(name: str, side: str) -> str:
    folder, _, base = name.rpartition("/")
    if side.startswith("../"):
        return f"{folder.rpartition('/')[0]}/{side[3:]}"
    if side.startswith("."):
        return name + side
    return f"{folder}/{side}"


def _list(fs: Any, spec: str, key: str, suffixes: tuple[str, ...], sidecars: tuple[str, ...]) -> dict[str, dict]:
    """Object name ('bucket/path') -> info for the data files of a remote spec (fresh: no cached listing)."""
    fs.invalidate_cache()
    side_names = {s.rpartition("/")[2] for s in sidecars if not s.startswith(".")}
    if any(c in spec for c in "*?["):
        found = fs.glob(spec, detail=True)
        found = {n: i for n, i in found.items() if i.get("type") == "file" and n.rpartition("/")[2] not in side_names
                 and not any(n.endswith(s) for s in sidecars if s.startswith("."))}
        if not found:
            raise ConfigError(f"{key}: the glob '{spec}' matches no objects")
    else:
        info = _info_or_none(fs, spec)
        if info is None:
            raise ConfigError(f"{key}: '{spec}' does not exist (expected an object, a folder of objects or a glob)")
        if info.get("type") == "file":
            found = {info["name"]: info}
        else:
            found = {n: i for n, i in fs.find(spec, detail=True).items() if any(n.endswith(s) for s in suffixes)
                     and i.get("type") == "file"}
            if not found:
                raise ConfigError(f"{key}: '{spec}' holds no {' or '.join(suffixes)} objects")
    for name, info in found.items():
        if not info.get("size"):
            raise ConfigError(f"{key}: object '{object_store.split_url(spec)[0]}://{name}' is empty")
    return found


def _folder(fs: Any, url: str) -> dict[str, dict]:
    """Object name -> info for the objects directly in a remote folder ({} when there is none)."""
    try:
        return {i["name"]: i for i in fs.ls(url, detail=True) if i.get("type") == "file"}
    except FileNotFoundError:
        return {}


def _info_or_none(fs: Any, url: str) -> Optional[dict]:
    try:
        return fs.info(url)
    except FileNotFoundError:
        return None


def _version(info: dict) -> str:
    """What changes when an object is rewritten: its generation (GCS) or etag (S3), else its modification time."""
    for field in ("generation", "ETag", "etag", "md5Hash", "crc32c", "LastModified", "updated", "mtime"):
        if info.get(field):
            return str(info[field])
    return ""


def _local_path(root: Path, scheme: str, name: str, key: str) -> Path:
    parts = name.split("/")
    # An object key may hold '..' or empty parts; copied as they are they would land outside the cache.
    if any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"{key}: object name '{scheme}://{name}' has empty, '.' or '..' parts; it cannot be "
                          "copied to local disk")
    return root.joinpath(scheme, *parts)


def _fetch(fs: Any, scheme: str, name: str, info: dict, root: Path, key: str) -> Path:
    """The local copy of object `name`, copied now unless a copy of this very version is already there."""
    url = f"{scheme}://{name}"
    local = _local_path(root, scheme, name, key)
    record = local.with_name(local.name + ".source")
    want = {"url": url, "size": int(info.get("size") or 0), "version": _version(info)}
    try:
        if json.loads(record.read_text()) == want and local.stat().st_size == want["size"]:
            return local
    except (OSError, ValueError):
        pass  # no copy yet, or a damaged record: copy again
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}-{random.getrandbits(32):08x}")
    try:
        _retry(lambda: _copy(fs, url, tmp, want["size"]), f"{key}: copying '{url}'")
        # The old record goes first, the new one last: a copy is used only beside a record of its own
        # version, so a process killed anywhere in between leaves a copy that is fetched again.
        record.unlink(missing_ok=True)
        os.replace(tmp, local)
        side = record.with_name(f".{record.name}.tmp-{os.getpid()}")
        side.write_text(json.dumps(want))
        os.replace(side, record)
    finally:
        tmp.unlink(missing_ok=True)
    return local


def _copy(fs: Any, url: str, tmp: Path, size: int) -> None:
    with fs.open(url, "rb") as src, open(tmp, "wb") as dst:
        while chunk := src.read(_COPY_CHUNK):
            dst.write(chunk)
    if tmp.stat().st_size != size:  # a connection cut mid-way that the client did not notice
        raise ConnectionError(f"copied {tmp.stat().st_size} of {size} bytes of '{url}'")


def _retry(fn: Callable[[], T], what: str) -> T:
    """`fn()`, again after errors that mean "no answer" (see the module docstring)."""
    for attempt in range(1, RETRY_ATTEMPTS + 1):
        try:
            return fn()
        except ConfigError:
            raise
        except Exception as e:
            line = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}".rstrip(": ")
            if isinstance(e, FileNotFoundError):
                raise ConfigError(f"{what}: the object does not exist ({line})") from None
            if not object_store.is_transient(e):
                raise ConfigError(f"{what}: {line}") from None
            if attempt == RETRY_ATTEMPTS:
                raise object_store.TransientStorageError(
                    f"{what}: no definite answer after {attempt} attempts: {line}") from None
            time.sleep(RETRY_FIRST_WAIT_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
    raise AssertionError("unreachable")
