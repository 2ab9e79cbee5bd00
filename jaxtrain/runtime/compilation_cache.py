"""Persistent XLA compilation cache: a restarted job loads its compiled programs from disk.

JAX writes cache entries from process 0 only; every other process only reads. So the cache helps
every host only when every host sees the same folder: the default (`auto`) is
`<run.output_dir>/compilation_cache`, inside the run directory, which multi-host jobs already
share (a shared filesystem or a gs:// bucket) and which outlives a recreated Kubernetes pod. A
per-host folder (`~/.cache/...`, the old default) warms only process 0's host.

The longest compile of a run is also recorded there (`compile_time.json`, see `last_compile_s`),
so a start-up deadline can be sized from it instead of killing a healthy long first compile at
every attempt before it is ever cached.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from typing import Optional

import jax
import jax.monitoring

from jaxtrain.storage.paths import is_local, to_path
from jaxtrain.storage.small_files import write_atomic
from jaxtrain.storage.paths import join

_log = logging.getLogger(__name__)

AUTO = "auto"  # <run.output_dir>/compilation_cache
SUBDIR = "compilation_cache"
PER_HOST_DIR = "~/.cache/jaxtrain/xla"  # where `auto` falls back when the run directory cannot hold it
COMPILE_TIME_FILE = "compile_time.json"
RECORD_MIN_S = 1.0  # compiles shorter than this are not worth a write (they do not threaten a deadline)
# Run directories on these schemes can hold JAX's cache (it goes through etils.epath, as Orbax does).
# s3:// is left out: epath's s3fs route does not get our endpoint settings (storage.py), so a cache
# there could fail on every compile.
_SHARED_SCHEMES = ("gs://",)

_record_lock = threading.Lock()
_record_dir: Optional[str] = None  # where the listener records compile times (None: nowhere)
_record_gate: Optional[str] = None  # ... once this (the run directory) exists
_listener_registered = False


def shared_cache_run_dir(run_dir: Optional[str], process_count: int, one_machine: bool) -> Optional[str]:
    """The run directory `auto` should put the cache in, or None for the per-host folder.

    A job whose processes all run on one machine (one process, or `jaxtrain launch`'s local
    processes) has nothing to share across hosts: the per-host folder serves every process there
    and stays warm across runs (new run directories) too. Only a job spread over several hosts needs
    the run directory, which they all see.
    """
    return None if process_count == 1 or one_machine else run_dir


def resolve_cache_dir(directory: Optional[str], run_dir: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """Where the cache goes, and a warning line when that is per host.

    Args:
      directory: `checkpoint.compilation_cache_dir`: None/"" (off), "auto", a path or a URL.
      run_dir: `run.output_dir`, or None when the run directory must stay untouched
        (write_files=False) or is not needed (the job runs on one machine, `shared_cache_run_dir`):
        then "auto" means the per-host folder, without a warning.
    Returns:
      (folder or URL or None, warning or None).
    """
    if not directory:
        return None, None
    if directory != AUTO:
        return directory, None
    if run_dir is None:
        return PER_HOST_DIR, None
    if is_local(run_dir) or run_dir.startswith(_SHARED_SCHEMES):
        return join(run_dir, SUBDIR), None
    return PER_HOST_DIR, (f"checkpoint.compilation_cache_dir=auto: the run directory '{run_dir}' cannot hold "
                          f"the XLA cache, using the per-host {PER_HOST_DIR}: only process 0's host restarts warm; "
                          "set checkpoint.compilation_cache_dir to a folder every host shares")


def enable_compilation_cache(directory: Optional[str], run_dir: Optional[str] = None) -> Optional[str]:
    """Turn on JAX's persistent compilation cache so a restarted job skips recompiling.

    Args:
      directory: cache folder (`~` expanded) or a URL; "auto" for `<run_dir>/compilation_cache`
        (see `resolve_cache_dir`); `{process}` in it becomes the process index (a per-host cache,
        for measurements); None/"" turns it off (also when an earlier Trainer in this
        process turned it on).
      run_dir: the run directory, for "auto"; None keeps it untouched.
    Returns:
      The folder in use, or None.

    Nothing is created here. Inside the run directory ("auto"), cache writes also wait until the
    Trainer has created it (after every user-error check; see `_HeldCache`), so a run refused for
    a user error leaves no run directory behind.
    """
    from jax.experimental.compilation_cache import compilation_cache

    global _record_dir
    asked = directory
    directory, warning = resolve_cache_dir(directory, run_dir)
    in_run_dir = asked == AUTO and run_dir is not None and directory != PER_HOST_DIR
    run_dir = None if run_dir is None else (os.path.abspath(os.path.expanduser(run_dir)) if is_local(run_dir)
                                            else run_dir)
    if directory and not cache_is_safe_here():
        if jax.process_index() == 0:
            _log.warning(f"compilation cache off: jax {jax.__version__} hangs running collectives loaded from the "
                         "persistent cache on CPU across processes; restarts recompile")
        directory = None
    if not directory:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        with _record_lock:
            _record_dir = None
        return None
    if warning and jax.process_index() == 0:
        _log.warning(warning)
    # `{process}`: one folder per process, as per-host disks behave (bench/bench_recovery.py measures it).
    directory = directory.replace("{process}", str(jax.process_index()))
    jax.config.update("jax_enable_compilation_cache", True)
    path = os.path.abspath(os.path.expanduser(directory)) if is_local(directory) else directory
    jax.config.update("jax_compilation_cache_dir", path)
    # By default only programs that took >= 1 s to compile are stored; a restart pays for every
    # program it compiles, and small CPU programs add up, so store everything.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # JAX decides once per process whether the cache is in use; if something compiled before
    # this call, that decision was "no". Reset it so the next compile looks again.
    compilation_cache.reset_cache()
    if in_run_dir:
        _hold_writes_until(path, run_dir)
    _record_compile_times(path, run_dir if in_run_dir else None)
    return path


# From this JAX version on, a multi-process CPU job hangs in its first cross-process collective
# (a shard_map psum over gloo) when that program was loaded from the persistent cache: reproduced
# with jax 0.12.1 (two processes, two CPU devices each, the second run of the same program);
# 0.12.0 runs it. Re-check before lifting. GPU and TPU jobs keep the cache.
CPU_MULTIPROCESS_CACHE_HANGS_FROM = (0, 12, 1)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


def cache_is_safe_here() -> bool:
    """False for a multi-process job on CPU under a JAX that hangs on cached collectives there."""
    if jax.process_count() == 1 or jax.default_backend() != "cpu":
        return True
    return _version_tuple(jax.__version__) < CPU_MULTIPROCESS_CACHE_HANGS_FROM


class _HeldCache:
    """JAX's file cache, but writes wait (in memory) until the run directory exists.

    Small programs compile before the Trainer's last user-error check (phase 2), and a run refused
    for a user error must leave no run directory behind; the Trainer creates it only after every
    such check. Held entries are written at the first cache call after it appears (the train
    step's compile comes after it); reads go to disk only once it exists. Bounded: entries past
    HELD_MAX_BYTES are dropped (a recompile on restart, nothing worse).
    """

    HELD_MAX_BYTES = 256 << 20

    def __init__(self, path: str, run_dir: str):
        self._path, self._run_dir = path, run_dir
        self._inner = None
        self._held: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _open(self):
        if self._inner is None and to_path(self._run_dir).exists():
            from jax._src import compilation_cache as jcc
            self._inner = jcc.get_file_cache(self._path)[0]
        if self._inner is not None and self._held:
            held, self._held = self._held, {}
            for key, value in held.items():
                self._inner.put(key, value)
        return self._inner

    def get(self, key: str):
        with self._lock:
            inner = self._open()
            return inner.get(key) if inner is not None else self._held.get(key)

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            inner = self._open()
            if inner is not None:
                inner.put(key, value)
            elif sum(map(len, self._held.values())) + len(value) <= self.HELD_MAX_BYTES:
                self._held[key] = value


def _hold_writes_until(path: str, run_dir: str) -> None:
    """Install `_HeldCache` as JAX's cache (jax 0.10 internals; without them, JAX's own cache,
    which creates the folder at the first compile)."""
    try:
        from jax._src import compilation_cache as jcc
        from jax._src.compilation_cache_interface import CacheInterface

        held = type("HeldCache", (_HeldCache, CacheInterface), {})(path, run_dir)
        with jcc._cache_initialized_mutex:
            jcc._cache, jcc._cache_initialized = held, True
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another JAX version
        pass


def last_compile_s(cache_dir: Optional[str]) -> Optional[float]:
    """The longest XLA compile recorded in `cache_dir` (by an earlier attempt of the run), or None.

    A compile that hits the cache is not recorded (no backend compile runs), so after a warm
    restart this still says how long a cold compile takes. For the start-up deadline: an attempt
    that may compile cold should get at least about this long (see docs/checkpoint.md).
    """
    if not cache_dir:
        return None
    try:
        p = to_path(cache_dir) / COMPILE_TIME_FILE
        return float(json.loads(p.read_text())["longest_compile_s"]) if p.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_compile_times(path: str, run_dir: Optional[str]) -> None:
    """Record every long backend compile of this process (process 0 only, like JAX's cache writes;
    inside a run directory only once it exists, as `_HeldCache`)."""
    global _record_dir, _record_gate, _listener_registered
    with _record_lock:
        _record_dir, _record_gate = path, run_dir
        if _listener_registered:
            return
        _listener_registered = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _on_duration(event: str, duration_s: float, **_: object) -> None:
    if event != "/jax/core/compile/backend_compile_duration" or duration_s < RECORD_MIN_S:
        return
    with _record_lock:
        where, gate = _record_dir, _record_gate
    if where is None or jax.process_index() != 0:
        return
    try:
        if gate is not None and where.startswith(gate.rstrip("/") + "/") and not to_path(gate).exists():
            return  # a run directory that does not exist yet is not created for this
        longest = max(duration_s, last_compile_s(where) or 0.0)
        folder = to_path(where)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / COMPILE_TIME_FILE, json.dumps(
            {"longest_compile_s": round(longest, 3), "last_compile_s": round(duration_s, 3), "unix_time": time.time()}))
    except Exception:  # noqa: BLE001 - bookkeeping must never fail a compile
        pass
