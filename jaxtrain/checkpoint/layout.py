"""On-disk format of a checkpoint folder: paths, the commit marker and its manifest, discovery,
and the rows `jaxtrain checkpoints DIR` prints (`list_checkpoints`; the verb is `commands/checkpoints.py`). Nothing here touches JAX arrays or other processes.

See the package docstring (`jaxtrain/checkpoint/__init__.py`) for the layout and failure windows.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Collection, Optional

from etils import epath

from jaxtrain.storage.paths import is_local, to_path
from jaxtrain.storage.small_files import forget_listings
from jaxtrain.storage.object_store import filesystem

MARKER = "commit.json"
FORMAT = "jaxtrain-checkpoint/1"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's temporary folder suffix (atomic rename mode)






def list_files(folder: epath.Path) -> dict[str, int]:
    """Relative path -> size in bytes of every file below `folder` (the marker excluded)."""
    if not is_local(os.fspath(folder)):
        return _list_objects(os.fspath(folder))
    files = {}
    prefix = len(os.fspath(folder).rstrip("/")) + 1
    for dirpath, _, names in folder.walk():
        for name in names:
            p = dirpath / name
            rel = os.fspath(p)[prefix:]
            if rel == MARKER:
                continue
            try:
                files[rel] = p.stat().length
            except FileNotFoundError:  # deleted meanwhile (retention of an old checkpoint)
                pass
    return files




def _list_objects(url: str) -> dict[str, int]:
    # One recursive listing instead of a walk folder by folder: object stores have no folders,
    # and a listing is one request per 1000 objects. (epath's walk also breaks on s3fs.)
    forget_listings(url)
    fs = filesystem(url)
    root = fs._strip_protocol(url).rstrip("/") + "/"
    files = {}
    for name, info in fs.find(url, detail=True).items():
        rel = name[len(root):] if name.startswith(root) else name
        if rel != MARKER and info.get("type", "file") == "file":
            files[rel] = int(info["size"])
    return files






def scan(root: epath.Path) -> list[tuple[int, epath.Path, bool]]:
    """(step, folder, is_orbax_temporary) for every checkpoint-like folder, oldest first."""
    forget_listings(root)
    if not root.exists():
        return []
    found = []
    for p in root.iterdir():
        name = p.name
        if name.isdigit():
            found.append((int(name), p, False))
        elif name.endswith(TMP_SUFFIX) and name[: -len(TMP_SUFFIX)].isdigit():
            found.append((int(name[: -len(TMP_SUFFIX)]), p, True))
    return sorted(found, key=lambda t: (t[0], t[2]))


def check_checkpoint(folder: str | epath.Path) -> tuple[bool, Optional[str], Optional[dict]]:
    """Verify one checkpoint folder against its commit marker.

    Args:
      folder: a `<step>/` folder.
    Returns:
      (good, reason it is not good or None, the marker's contents or None).
    """
    folder = to_path(folder)
    marker = folder / MARKER
    forget_listings(folder)
    if not marker.exists():
        return False, "no commit marker (the write never finished)", None
    try:
        meta = json.loads(marker.read_text())
    except (ValueError, OSError) as e:
        return False, f"commit marker is unreadable ({type(e).__name__})", None
    if meta.get("format") != FORMAT or str(meta.get("step")) != folder.name:
        return False, f"commit marker is for format {meta.get('format')} step {meta.get('step')}", meta
    actual = list_files(folder)
    for rel, size in meta["files"].items():
        if rel not in actual:
            return False, f"file {rel} is missing", meta
        if actual[rel] != size:
            return False, f"file {rel} has {actual[rel]} bytes; the manifest says {size}", meta
    return True, None, meta


def latest_good(root: epath.Path, skip: Optional[int | Collection[int]] = None,
                report: Optional[Callable[[int, str], None]] = None, before: Optional[int] = None) -> Optional[int]:
    """Newest step (below `before`, if given) whose checkpoint verifies; damaged newer ones go to
    `report(step, reason)`. `skip`: steps not to look at (a save in flight, folders being deleted)."""
    skipped = set() if skip is None else {skip} if isinstance(skip, int) else set(skip)
    for step, folder, tmp in reversed(scan(root)):
        if tmp or step in skipped or (before is not None and step >= before):
            continue
        good, reason, _ = check_checkpoint(folder)
        if good:
            return step
        if report is not None:
            report(step, reason)
    return None


# ----------------------------------------------------------------------------- listing / CLI


def list_checkpoints(directory: str) -> list[dict]:
    """Every checkpoint-like folder in `directory`, oldest first.

    Args:
      directory: a `checkpoints/` folder (local or URL).
    Returns:
      Dicts with step, path, valid, reason (why not valid, else None), bytes, time (ISO, UTC),
      mesh (axis -> size it was saved on), process_count.
    """
    out = []
    for step, folder, tmp in scan(to_path(directory)):
        if tmp:
            good, reason, meta = False, "write in progress or interrupted (Orbax temporary folder)", None
        else:
            good, reason, meta = check_checkpoint(folder)
        meta = meta or {}
        size = meta.get("bytes") if good else sum(list_files(folder).values())
        out.append({"step": step, "path": os.fspath(folder), "valid": good, "reason": reason, "bytes": size,
                    "time": meta.get("time"), "mesh": meta.get("mesh"), "process_count": meta.get("process_count")})
    return out
