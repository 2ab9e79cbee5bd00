"""Logs that are only appended to (metrics.jsonl, events.jsonl, TensorBoard event files), local or
on an object store. An object cannot be appended to, so there `AppendOnlyFile` writes a log as a
series of bounded segment objects, uploaded by a background `Uploader` thread (see the class for
the layout and the costs); `read_appended` reads a log back, whatever its layout.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

from jaxtrain.storage import object_store
from jaxtrain.storage.paths import is_remote
from jaxtrain.storage.small_files import is_file

# Bounds of one remote segment (module constants, read at each use, so tests can make them small).
# A segment is sealed when the next record would take it past SEGMENT_BYTES, or after it was
# uploaded SEGMENT_UPLOADS times: each upload then costs at most one segment, and the bytes
# uploaded over a run are at most about SEGMENT_UPLOADS + 1 times the bytes written (O(N); a
# whole-object rewrite per upload is O(N^2)). The count bound keeps the factor small when
# uploads are frequent (one per event); the size bound keeps each upload short.
SEGMENT_BYTES = 1 << 20
SEGMENT_UPLOADS = 32
SEGMENTS_SUFFIX = ".segments"


def segments_dir(path: str) -> str:
    """The folder of the segments of the log `path`: `.../metrics.jsonl` -> `.../metrics.jsonl.segments`."""
    return os.fspath(path).rstrip("/") + SEGMENTS_SUFFIX


def segment_path(path: str, number: int) -> str:
    """Segment `number` (from 1) of the log `path`: `metrics.jsonl.segments/000001.jsonl` (the log's extension)."""
    return f"{segments_dir(path)}/{number:06d}{os.path.splitext(os.fspath(path))[1]}"


def _segment_number(name: str) -> Optional[int]:
    stem = os.path.basename(name.rstrip("/")).split(".")[0]
    return int(stem) if stem.isdigit() else None


def list_segments(path: str) -> list[str]:
    """The segments of the log `path` (objects or local files), in order of their number; one listing.

    Names that are not `<digits>.<ext>` are ignored (so is the folder when it does not exist)."""
    folder = segments_dir(path)
    if is_remote(folder):
        fs = object_store.filesystem(folder)
        fs.invalidate_cache()  # a listing cached earlier in this process would miss later segments
        try:
            names = fs.ls(folder, detail=False)
        except FileNotFoundError:
            names = []
        scheme = object_store.split_url(folder)[0]
        names = [n if "://" in n else f"{scheme}://{n}" for n in names]
    else:
        names = [os.path.join(folder, n) for n in os.listdir(folder)] if os.path.isdir(folder) else []
    numbered = [(_segment_number(n), n) for n in names]
    return [n for k, n in sorted((k, n) for k, n in numbered if k is not None)]


def read_appended(path: str) -> bytes:
    """The whole contents of the log `path` as written by `AppendOnlyFile`: the file or object at
    `path` itself (a local log, or a remote log of a run written before segments), then each of
    its segments in order. b"" when there is neither. Each part is ended with a newline if it was
    not (a part cut short by a kill must not glue its tail to the next part's first line)."""
    parts = [path] if is_file(path) else []
    parts += list_segments(path)
    if not parts:
        return b""
    if is_remote(path):
        fs = object_store.filesystem(path)
        got = fs.cat(parts)  # fetched concurrently (gcsfs, s3fs are asynchronous)
        if not isinstance(got, dict):  # one path: fsspec returns its bytes
            got = {parts[0]: got}
        # fsspec keys the result by the paths as it spells them (with or without the scheme).
        by_key = {k.split("://", 1)[-1]: v for k, v in got.items()}
        blobs = [by_key[p.split("://", 1)[-1]] for p in parts]
    else:
        blobs = []
        for p in parts:
            with open(p, "rb") as f:
                blobs.append(f.read())
    return b"".join(b if not b or b.endswith(b"\n") else b + b"\n" for b in blobs)


class Uploader:
    """One background thread that uploads remote `AppendOnlyFile`s, in the order they were added.

    A pass uploads what changed in each file. After a plain write the next pass waits until
    `interval_s` after the previous one (writes in between coalesce into one upload per file);
    `wake(urgent=True)` starts one at once. The writer never waits for a pass. Files of one run
    share an uploader so that a pass stores them in order: the metrics lines before the event
    that follows them. A failed upload is kept as the file's `background_error` and retried at
    the next pass (after `interval_s`, or at the next urgent wake).
    """

    def __init__(self, interval_s: float = 5.0):
        self.interval_s = interval_s
        self._files: list[AppendOnlyFile] = []
        self._cond = threading.Condition()
        self._pending = False  # something was written since the last pass began
        self._urgent = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def add(self, f: "AppendOnlyFile") -> None:
        with self._cond:
            self._files.append(f)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxtrain-log-upload", daemon=True)
                self._thread.start()

    def remove(self, f: "AppendOnlyFile") -> None:
        with self._cond:
            if f in self._files:
                self._files.remove(f)

    def wake(self, urgent: bool = False) -> None:
        """Ask for a pass: at the interval, or (urgent) at once. Returns at once."""
        with self._cond:
            self._pending = True
            self._urgent = self._urgent or urgent
            self._cond.notify()

    def _run(self) -> None:
        last = -float("inf")
        while True:
            with self._cond:
                while not self._closed and not (
                        self._pending and (self._urgent or time.monotonic() >= last + self.interval_s)):
                    self._cond.wait(None if not self._pending else max(0.0, last + self.interval_s - time.monotonic()))
                if self._closed:
                    return  # each file's close() uploads its rest itself
                self._pending = self._urgent = False
                files = list(self._files)
            last = time.monotonic()
            for f in files:
                try:
                    f._upload()
                    f.background_error = None
                except Exception as e:  # retried at the next pass; flush() and close() raise their own
                    f.background_error = e
                    with self._cond:
                        self._pending = True

    def close(self) -> None:
        """Stop the thread (after the pass in progress, if any). Files still added are not uploaded again."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


class AppendOnlyFile:
    """A log that is only appended to, one whole record per `write` (a JSON line, a TFRecord).

    Locally: one plain file, and every `write` goes to the OS at once (a kill keeps every record).

    On gs:// and s3:// objects cannot be appended to, so the log is a series of segment objects,
    by default `<path>.segments/000001<ext>`, `000002<ext>`, ... (`segment_path`); `segment_name`
    may name them otherwise (TensorBoard event files). `write` only adds to memory and wakes the
    background `Uploader`; each upload rewrites the one open segment, which is sealed (never
    written again) when the next record would take it past SEGMENT_BYTES or after SEGMENT_UPLOADS
    uploads. So an upload costs O(segment) and a run O(bytes written), and no `write` waits for
    the store. Records never span segments. `header()`, when given, starts every file or segment
    this writer creates (a TensorBoard file-version record). A resumed run lists the segments
    once, here, and continues after the last one; it never reads or rewrites an old segment, nor
    the whole object `path` that runs before segments wrote (`read_appended` reads both).
    `flush()` and `close()` upload everything now and wait; a kill loses only what was written
    since the last upload. One writer per log (process 0).
    """

    def __init__(self, path: str, *, flush_interval_s: float = 5.0, uploader: Optional[Uploader] = None,
                 header: Optional[Any] = None, segment_name: Optional[Any] = None):
        """
        Args:
          path: a local file, or the log's URL (its segments' names derive from it).
          flush_interval_s: the interval of the uploader made here when `uploader` is None.
          uploader: a shared background uploader (its owner closes it), else one of this file's own.
          header: a callable returning the bytes that start each new file or segment, or None.
          segment_name: a callable number -> URL for remote segments (numbers from 1, called when a
            segment starts), instead of `segment_path(path, number)` after the existing segments.
        """
        self.path = os.fspath(path)
        self.remote = is_remote(self.path)
        self._header = header
        if not self.remote:
            self._file = open(self.path, "ab")
            if header is not None and self._file.tell() == 0:
                self._file.write(header())
                self._file.flush()
            return
        self._fs = object_store.filesystem(self.path)
        if segment_name is None:
            existing = list_segments(self.path)  # the one listing: continue after the last segment
            self._next = (_segment_number(existing[-1]) or 0) + 1 if existing else 1
            self._name = lambda number: segment_path(self.path, number)
        else:
            self._next, self._name = 1, segment_name
        self._lock = threading.Lock()  # guards the segment state below
        self._upload_lock = threading.Lock()  # one upload at a time, in order
        self._open: Optional[bytearray] = None  # the open segment's contents (None: none open)
        self._open_path = ""
        self._open_records = 0
        self._open_uploaded = 0  # bytes of the open segment that are in the store
        self._open_uploads = 0
        self._sealed: list[tuple[str, bytes]] = []  # sealed segments not yet stored whole, oldest first
        self.segments: list[str] = []  # every segment this writer started, in order
        self.background_error: Optional[BaseException] = None  # the last failed background upload
        self._closed = False
        self._own_uploader = uploader is None
        self._uploader = Uploader(flush_interval_s) if uploader is None else uploader
        self._uploader.add(self)

    def write(self, data: bytes | str) -> None:
        """Append one record (locally: to the OS now; remotely: to memory, uploaded in the background)."""
        if isinstance(data, str):
            data = data.encode()
        if not self.remote:
            self._file.write(data)
            self._file.flush()
            return
        with self._lock:
            if self._open is not None and self._open_records and len(self._open) + len(data) > SEGMENT_BYTES:
                self._seal()
            if self._open is None:
                self._open_path = self._name(self._next)
                self._next += 1
                self._open = bytearray(self._header() if self._header is not None else b"")
                self._open_records = self._open_uploaded = self._open_uploads = 0
                self.segments.append(self._open_path)
            self._open += data
            self._open_records += 1
        self._uploader.wake()

    def _seal(self) -> None:
        """Close the open segment (caller holds _lock): its last contents are uploaded, then never again."""
        if self._open is not None and len(self._open) > self._open_uploaded:
            self._sealed.append((self._open_path, bytes(self._open)))
        self._open = None

    def flush(self) -> None:
        """Make everything written so far durable (locally: in the OS; remotely: uploaded), and wait."""
        if not self.remote:
            self._file.flush()
            return
        self._upload()

    def _upload(self) -> None:
        """Store the sealed segments (oldest first, stopping at a failure), then the open one if it changed."""
        with self._upload_lock:
            with self._lock:
                sealed = list(self._sealed)
                current = None
                if self._open is not None and len(self._open) > self._open_uploaded:
                    current = (self._open_path, bytes(self._open))
            for name, data in sealed:
                self._fs.pipe_file(name, data)  # one object write: readers see old or new
                with self._lock:
                    self._sealed.pop(0)  # only this method removes, under _upload_lock: it is this entry
            if current is None:
                return
            name, data = current
            self._fs.pipe_file(name, data)
            with self._lock:
                if self._open is not None and self._open_path == name:
                    self._open_uploaded = len(data)
                    self._open_uploads += 1
                    if self._open_uploads >= SEGMENT_UPLOADS:
                        self._seal()  # the next record starts a new segment

    def close(self) -> None:
        """Upload what is left (remote) and release the file."""
        if not self.remote:
            self._file.close()
            return
        if self._closed:
            return
        self._closed = True
        try:
            self._upload()
        finally:
            if self._own_uploader:
                self._uploader.close()
            else:
                self._uploader.remove(self)
