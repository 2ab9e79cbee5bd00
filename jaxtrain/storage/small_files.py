"""Small whole files, local or on an object store: written so a reader sees the old or the new
contents, never a part (a local write goes to a temporary name, is fsynced and renamed; one
object write is atomic on gs:// and s3://), read back fresh (fsspec caches listings per process).
"""

from __future__ import annotations

import os

from etils import epath
from etils.epath import backend as epath_backend

from jaxtrain.storage.object_store import filesystem
from jaxtrain.storage.paths import is_local, is_remote

def write_text(path: str, text: str) -> None:
    """Write a whole small file, local or remote (one object write: readers see old or new)."""
    if is_remote(path):
        filesystem(path).pipe_file(path, text.encode())
    else:
        with open(path, "w") as f:
            f.write(text)


def read_bytes(path: str) -> bytes:
    """The contents of a local file or an object."""
    if is_remote(path):
        return filesystem(path).cat_file(path)
    with open(path, "rb") as f:
        return f.read()


def is_file(path: str) -> bool:
    """True when a local file or an object exists at `path` (listings are read fresh)."""
    if is_remote(path):
        fs = filesystem(path)
        fs.invalidate_cache()  # gcsfs/s3fs cache listings per process; another writer may have added it
        return fs.isfile(path)
    return os.path.isfile(path)


def makedirs(path: str) -> None:
    """Create a local directory (object stores have no directories: nothing to do)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def write_atomic(path: epath.Path, text: str) -> None:
    """Write a small file so readers see either nothing or all of it."""
    if not is_local(os.fspath(path)):
        path.write_text(text)  # a single object write is atomic on gs:// and s3://
        return
    tmp = os.fspath(path) + f".tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.fspath(path))
    fd = os.open(os.path.dirname(os.fspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: epath.Path) -> None:
    """Flush every file and folder below a local `folder` to disk (no-op for URLs)."""
    if not is_local(os.fspath(folder)):
        return
    for dirpath, _, names in os.walk(os.fspath(folder)):
        for name in names + ["."]:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def forget_listings(path: str | os.PathLike) -> None:
    """Drop fsspec's cached listings before looking at a remote folder: gcsfs and s3fs cache
    them per process, and tensorstore (the arrays) and other processes write behind their back.
    Both instances: epath makes its own gcsfs (other arguments, so another instance and cache),
    and a bucket listing it cached earlier hides every folder made since."""
    text = os.fspath(path)
    if not is_local(text):
        filesystem(text).invalidate_cache()
        epath_backend.fsspec_backend.fs(text).invalidate_cache()
