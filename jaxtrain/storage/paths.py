"""Local paths versus object-store URLs: the one definition of "is this path remote".

Imports nothing heavy: the launcher (which never imports JAX) uses it too.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from etils import epath

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_remote(path: str | os.PathLike) -> bool:
    """True for a URL such as gs://bucket/x or s3://bucket/x; False for a filesystem path."""
    return bool(_URL.match(os.fspath(path)))


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base/part/...` for a local path or a URL (os.path.join would mangle nothing, but Path('gs://b')
    collapses the double slash)."""
    out = os.fspath(base).rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def is_local(directory: str | os.PathLike) -> bool:
    """True for a plain filesystem path; False for a URL such as gs://bucket/x or s3://b/x."""
    return not is_remote(directory)


def to_path(directory: str | os.PathLike) -> "epath.Path":
    """An epath for `directory`: local paths made absolute (Orbax needs that), URLs unchanged."""
    from etils import epath  # not at the top: the launcher imports this module without etils' cost

    text = os.fspath(directory)
    if is_local(text):
        return epath.Path(os.path.abspath(os.path.expanduser(text)))
    return epath.Path(text)
