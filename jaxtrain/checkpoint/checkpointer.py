"""The `Checkpointer`: asynchronous Orbax saves, commit marker, retention, restore onto any mesh."""

from __future__ import annotations

import datetime
import importlib.metadata
import itertools
import collections
import json
import os
import threading
import time
from typing import Any, Callable, Optional, Protocol

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxtrain.checkpoint.layout import FORMAT, MARKER, check_checkpoint, latest_good, list_files, scan
from jaxtrain.storage.small_files import forget_listings, fsync_tree, write_atomic
from jaxtrain.storage.paths import is_local, to_path
from jaxtrain.runtime.multihost import BarrierTimeoutError, barrier, client as _client
from jaxtrain.storage.object_store import TransientStorageError, check_access, is_transient, split_url
from jaxtrain.config import CheckpointConfig, ConfigError
from jaxtrain.numerics import all_finite_on_host as all_finite

EventFn = Callable[..., None]  # on_event(kind: str, step: int, **details)

# How long wait() lets queued retention deletions finish. Bounded: a run that ends (or is
# preempted) should not wait long for garbage; what is left is deleted by the next run's retention.
DELETION_DRAIN_S = 120.0


def _delete_step(folder: epath.Path) -> None:
    """Delete one checkpoint folder: its commit marker first, so a crash halfway leaves an
    invisible folder, never a half-deleted one that looks committed; then the bulk (on an object
    store, thousands of objects: this is why it runs on the deletion queue, off the save path)."""
    if (folder / MARKER).exists():
        (folder / MARKER).unlink()
    if folder.exists():
        folder.rmtree()


class _Deleter:
    """A single background worker that deletes retired checkpoint folders in the order queued.

    Saves never join it: on object storage a deletion is thousands of requests, and the next save
    (the emergency save in a 120-180 s grace period included) must not wait for it. `wait_idle`
    is for the few callers that must (wait(), discard_after, re-saving a step being deleted).
    """

    def __init__(self, on_error: Callable[[int, BaseException], None]):
        self._on_error = on_error
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, epath.Path]] = collections.deque()
        self._busy: set[int] = set()  # queued or being deleted
        self._thread: Optional[threading.Thread] = None

    def pending(self) -> set[int]:
        with self._cond:
            return set(self._busy)

    def submit(self, step: int, folder: epath.Path) -> None:
        with self._cond:
            if step in self._busy:
                return
            self._busy.add(step)
            self._queue.append((step, folder))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="jaxtrain-retention", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._thread = None
                    return
                step, folder = self._queue[0]
            try:
                _delete_step(folder)
            except BaseException as e:  # noqa: BLE001 - reported; the next retention tries again
                self._on_error(step, e)
            with self._cond:
                self._queue.popleft()
                self._busy.discard(step)
                self._cond.notify_all()

    def wait_idle(self, timeout_s: Optional[float] = None, step: Optional[int] = None) -> bool:
        """Block until nothing (or `step`, if given) is pending, or `timeout_s` passed; True if so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy if step is None else step not in self._busy,
                                       timeout=timeout_s)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not usable (damaged, failed background write)."""


class CheckpointTier(Protocol):
    """What the trainer asks of a checkpoint tier: the persistent `Checkpointer` (here) and the
    node-local `jaxtrain.checkpoint.local_tier.LocalTier`. Every method but `should_save` is
    collective: every process calls it, in the same order. Which step to restore is each tier's
    own question: the persistent tier's `latest_step()` (its newest good checkpoint), the local
    tier's `plan()` (its newest step complete on every process and newer than the persistent one,
    and where each process reads its part)."""

    def should_save(self, step: int, *, last: bool = False, time_due: bool = False) -> bool:
        """Whether this tier saves after `step` (`last`: the run's final step; `time_due`: a
        time-based save agreed by every process). The same answer on every process."""
        ...

    def save(self, step: int, state: Any, extra: dict) -> Any:
        """Start saving `state` (and the JSON `extra`) as `step`; returns once the caller may donate `state`."""
        ...

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """(state, extra) of `step`, straight into the shardings of `abstract_state`.
        Raises CheckpointError when the step cannot be restored."""
        ...

    def discard_after(self, step: int) -> Any:
        """Delete this tier's steps newer than `step` (a rollback's target), so none wins a restart."""
        ...

    def wait(self) -> None:
        """Block until the save in flight is written."""
        ...

    def close(self) -> None:
        """Wait for the save in flight, then release the tier's threads."""
        ...


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flat(tree: Any) -> dict[str, Any]:
    """'opt_state.0.mu.w' -> leaf. NamedTuple fields and list indices are spelled the way Orbax
    names them in its metadata, so a model tree and a checkpoint tree compare by these names."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _check_compatible(folder: epath.Path, abstract: Any, *, prefix: str = "") -> None:
    """Raise ConfigError unless the saved arrays have the abstract tree's names and shapes.

    Reads only Orbax's metadata file, so nothing is loaded and nothing is written. With a
    `prefix` ('params'), only that subtree is compared and other saved entries are ignored.
    """
    saved = _flat(_pytree_handler(folder).metadata(folder / "state").tree)
    wanted = _flat({prefix: abstract} if prefix else abstract)
    problems = []
    # Parameters first: a model-shape change shows there, the optimizer state only mirrors it.
    for name, leaf in sorted(wanted.items(), key=lambda kv: not kv[0].startswith("params.")):
        if name not in saved:
            problems.append(f"'{name}' is in the model but not in the checkpoint")
        elif tuple(saved[name].shape) != tuple(leaf.shape):
            kind = "parameter" if name.startswith("params.") else "entry"
            problems.append(f"{kind} '{name}' has shape {tuple(saved[name].shape)} in the checkpoint "
                            f"but {tuple(leaf.shape)} in the model")
    for name in saved:
        if name not in wanted and (not prefix or name.startswith(prefix + ".")):
            problems.append(f"'{name}' is in the checkpoint but not in the model")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(f"checkpoint {folder} does not match this model: {'; '.join(problems[:3])}{more}. "
                          "Use the model config it was saved with, or start a new run directory")


def mesh_shape(tree: Any) -> Optional[dict]:
    """{axis: size} of the mesh the first sharded leaf of `tree` lives on (None: no mesh); both
    checkpoint tiers record it to refuse a restore onto another mesh."""
    for x in jax.tree.leaves(tree):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None:
            return {str(k): int(v) for k, v in mesh.shape.items()}
    return None


def _version() -> str:
    try:
        return importlib.metadata.version("jaxtrain")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _is_s3(directory: epath.Path | str) -> bool:
    return not is_local(os.fspath(directory)) and split_url(os.fspath(directory))[0] == "s3"


def _pytree_handler(directory: epath.Path | str) -> ocp.PyTreeCheckpointHandler:
    """Orbax's PyTree handler for checkpoints in `directory`: local disks and gs:// use Orbax's own
    array handler (OCDBT); s3:// uses ours, the same OCDBT format over tensorstore's s3 driver
    (Orbax 0.12 has no S3 route; see s3_arrays.py)."""
    if _is_s3(directory):
        from jaxtrain.checkpoint.s3_arrays import s3_pytree_handler
        return s3_pytree_handler()
    # Orbax by default splits each replicated shard among its replicas ("replica parallel") so
    # that data-parallel hosts share the write. The split is a device-side slice done in the
    # blocking phase; on the CPU it is a memcpy that made up ~90% of the blocked time (200 MB:
    # 90 of 100 ms). On GPU/TPU the slice is cheap and sharing the write pays off, so keep it.
    try:
        from orbax.checkpoint._src.metadata import array_metadata_store
        store = array_metadata_store.Store()
    except ImportError:  # pragma: no cover - only the metadata used for resharding hints
        store = None
    handlers = [(t, ocp.type_handlers.get_type_handler(t)) for t in ocp.type_handlers.supported_types()]
    handlers = [(t, h) for t, h in handlers if t is not jax.Array]
    handlers.append((jax.Array, ocp.type_handlers.ArrayHandler(
        use_replica_parallel=jax.default_backend() != "cpu", array_metadata_store=store)))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=ocp.type_handlers.create_type_handler_registry(*handlers))


class Checkpointer:
    """Saves and restores the training state in `directory`; see the package docstring.

    Every method is collective: call it on every process, in the same order. `on_event` is
    called on process 0 only, always from the calling (main) thread: events of the background
    commit are queued and delivered by the next call into the Checkpointer.
    """

    _instances = itertools.count()  # same order on every process -> same key-value names

    def __init__(self, directory: str, cfg: CheckpointConfig, *, barrier_timeout_s: Optional[float] = None,
                 on_event: Optional[EventFn] = None):
        """Args:
          directory: the run's `checkpoints/` folder; a local path or a tensorstore URL.
          cfg: the `checkpoint` config section (every_steps, every_minutes, keep_last, ...).
          barrier_timeout_s: overrides cfg.barrier_timeout_s for every host-level wait.
          on_event: `on_event(kind, step, **details)` for checkpoint_saved/_skipped/_damaged/_failed.
        """
        check_access(os.fspath(directory), key="checkpoint directory")  # object stores: fail now, in one line
        self.directory = to_path(directory)
        self.cfg = cfg
        self.timeout_s = float(cfg.barrier_timeout_s if barrier_timeout_s is None else barrier_timeout_s)
        self._on_event = on_event
        self._primary = jax.process_index() == 0
        self._uid = next(Checkpointer._instances)
        self._calls = itertools.count()
        self._generation = 0  # saves started so far; names the key-value directory (see _keys)
        self._events: list[tuple[str, int, dict]] = []
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._inflight: Optional[int] = None
        self._damaged_reported: set[int] = set()
        self._last_save_time = time.monotonic()
        # (step, wall time, blocking s, write s) of this process's last committed save (live metrics read it)
        self.last_commit: tuple[int, float, float, float] | None = None
        # Retention: decided by process 0 alone (in the commit thread, after the marker), carried
        # out by the deletion queue. `_pin_before` is set by the rollback guard (pin_before).
        self._deleter = _Deleter(lambda step, e: self._emit("checkpoint_delete_failed", step,
                                                             error=f"{type(e).__name__}: {e}"))
        self._pin_before: Optional[int] = None
        # An object store has no atomic folder rename: there Orbax writes in place and finishes
        # with commit_success.txt (its default on gs://, made explicit for s3://). Our commit.json
        # comes after either way, so what counts as committed is the same everywhere.
        commit_file = {} if is_local(os.fspath(self.directory)) else {
            "temporary_path_class": ocp.path.atomicity.CommitFileTemporaryPath}
        self._orbax = ocp.AsyncCheckpointer(
            ocp.CompositeCheckpointHandler(state=_pytree_handler(self.directory), extra=ocp.JsonCheckpointHandler(),
                                           composite_options=ocp.CompositeOptions(**commit_file)),
            # Deadline for one whole background write; barriers inside it use barrier_timeout_s.
            timeout_secs=int(max(3600, self.timeout_s)),
            async_options=ocp.options.AsyncOptions(barrier_sync_fn=self._orbax_barrier),
            **commit_file,
        )

    # -- coordination --------------------------------------------------------------------

    def _keys(self) -> str:
        """The key-value directory of this save generation: every barrier and agreement key made
        between two saves lives under it, and the whole directory is deleted once every process
        is provably past it (see `_forget_previous_generation`), so the coordinator's store does
        not grow with the number of checkpoints."""
        return f"ckpt{self._uid}/g{self._generation}"

    def _barrier(self, what: str) -> None:
        """A named barrier that names missing processes when it times out."""
        if jax.process_count() == 1:
            return
        barrier(f"{self._keys()}/{next(self._calls)}/{what}", self.timeout_s)

    def _forget_previous_generation(self) -> None:
        # Called right after the first barrier of a new generation: every process has joined the
        # previous save's commit thread (Orbax's barriers included) and passed all of its calls,
        # so nobody reads the previous generation's keys again.
        if jax.process_count() > 1 and self._primary and self._generation > 0:
            _client().key_value_delete(f"jaxtrain/barrier/ckpt{self._uid}/g{self._generation - 1}")

    def _orbax_barrier(self, *, key: str, timeout_ms: int) -> None:
        # Orbax's own barriers (write complete, commit complete) go through ours so a missing
        # process is named, and under this generation's keys so they are deleted with it.
        barrier(f"{self._keys()}/orbax/{key}", min(timeout_ms / 1000, self.timeout_s))

    def agree(self, what: str, decide: Callable[[], str]) -> str:
        """Process 0 runs `decide()` and every process returns its answer (see `_agree`)."""
        return self._agree(what, decide)

    def _agree(self, what: str, decide: Callable[[], str]) -> str:
        """Process 0 runs `decide()`; every process gets its answer through the key-value store.

        Unlike broadcast_one_to_all this is no device collective: it neither waits for queued
        device work nor hangs silently; a process whose answer does not come names process 0.
        """
        if jax.process_count() == 1:
            return decide()
        key = f"jaxtrain/barrier/{self._keys()}/agree/{next(self._calls)}"
        client = _client()
        if self._primary:
            value = decide()
            client.key_value_set(key, f"{what}={value}")
            return value
        try:
            got = client.blocking_key_value_get(key, max(1, int(self.timeout_s * 1000)))
        except Exception:
            raise BarrierTimeoutError(
                f"process {jax.process_index()} waited {self.timeout_s:g} s for process 0 to decide "
                f"'{what}': process(es) [0] never arrived (see checkpoint.barrier_timeout_s)") from None
        asked, value = got.split("=", 1)
        if asked != what:
            raise CheckpointError(f"processes call the Checkpointer in different orders: process 0 "
                                  f"answered '{asked}' while process {jax.process_index()} asked '{what}'")
        return value

    def _emit(self, kind: str, step: int, **details: Any) -> None:
        if self._primary and self._on_event is not None:
            with self._lock:
                self._events.append((kind, step, details))

    def _drain_events(self) -> None:
        with self._lock:
            events, self._events = self._events, []
        for kind, step, details in events:
            self._on_event(kind, step, **details)

    # -- public API ----------------------------------------------------------------------

    def should_save(self, step: int, *, last: bool = False, time_due: bool = False) -> bool:
        """Whether to save after `step`: every_steps, a time-based save that is due, or the final step.

        Args:
          step: optimizer steps completed.
          last: True on the final step (saves when cfg.save_at_end).
          time_due: a time-based save is due, as agreed by all processes (see `time_due`).
        Returns:
          The same answer on every process, with no cross-process call.
        """
        self._drain_events()
        cfg = self.cfg
        if (last and cfg.save_at_end) or (cfg.every_steps > 0 and step > 0 and step % cfg.every_steps == 0):
            return True
        return cfg.every_minutes > 0 and time_due

    def time_due(self) -> bool:
        """This process's view: checkpoint.every_minutes have passed since the last save.

        Clocks differ between hosts, so the trainer agrees on it (`preemption.HostSync`) before
        passing it to `should_save`.
        """
        return self.cfg.every_minutes > 0 and time.monotonic() - self._last_save_time >= self.cfg.every_minutes * 60

    def save(self, step: int, state: Any, extra: Optional[dict] = None) -> bool:
        """Start saving `state` (+ JSON `extra`) as checkpoint `step`; returns when the arrays are
        copied off the devices, so the caller may donate or overwrite `state` at once.

        Args:
          step: the step number (the folder name).
          state: pytree of jax.Arrays (sharded over any mesh, any number of processes).
          extra: JSON-serialisable dict (data iterator state, config, ...); no pickles.
        Returns:
          True if a save was started; False if skipped (non-finite values, or this step is
          already committed) with a `checkpoint_skipped` event.
        Raises:
          CheckpointError: the previous background save failed.
          BarrierTimeoutError: a process did not arrive; the message names it.
        """
        t0 = time.monotonic()
        self._join()
        self._drain_events()
        self._generation += 1
        folder = self.directory / str(step)
        if self._agree(f"prepare {step}", lambda: self._prepare(step, folder)) == "exists":
            self._emit("checkpoint_skipped", step, reason="a committed checkpoint of this step exists")
            self._drain_events()
            return False
        self._barrier(f"save {step}")  # before the first collective: a missing host is named
        self._forget_previous_generation()
        if not all_finite(state):
            self._emit("checkpoint_skipped", step, reason="state has non-finite values (NaN/Inf)")
            self._drain_events()
            return False
        meta = {"format": FORMAT, "step": int(step), "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "unix_time": time.time(), "mesh": mesh_shape(state),
            "process_count": jax.process_count(), "jaxtrain_version": _version(), "jax_version": jax.__version__}
        self._orbax.save(folder, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), extra=ocp.args.JsonSave(dict(extra or {}))))
        self._last_save_time = time.monotonic()
        blocked_s = time.monotonic() - t0
        self._inflight = step
        self._thread = threading.Thread(target=self._commit, args=(step, folder, meta, t0, blocked_s),
                                        name=f"jaxtrain-commit-{step}", daemon=True)
        self._thread.start()
        if not self.cfg.async_save:
            self.wait()
        return True

    @property
    def busy(self) -> bool:
        """True while a save is still being written in the background (no collective)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, deletions_s: float = DELETION_DRAIN_S) -> None:
        """Block until the save in flight (if any) is committed on every process, then give the
        retention deletions it queued up to `deletions_s` to finish (process 0 deletes; others
        have nothing queued). Leftovers are harmless: the next retention deletes them."""
        self._join()
        self._barrier("wait")
        self._deleter.wait_idle(deletions_s)
        self._drain_events()

    def pin_before(self, step: Optional[int]) -> None:
        """Keep the newest committed checkpoint older than `step` from retention (None: unpin).

        The rollback guard pins for the oldest spike still in its window: a rollback would go
        back to exactly that checkpoint (`latest_step(before=first spike)`), and keep_last alone
        would delete it once enough newer checkpoints are saved. No collective call: every
        process's guard sees the same replicated flags and pins alike, and only process 0's pin
        is read, by process 0's retention decision.
        """
        with self._lock:
            self._pin_before = None if step is None else int(step)

    def latest_step(self, before: Optional[int] = None) -> Optional[int]:
        """The newest good (committed, intact) checkpoint's step, or None.

        Args:
          before: only steps below this one (a rollback's target precedes the first spike).
        Damaged newer checkpoints are skipped and reported once each as `checkpoint_damaged`.
        """
        self._drain_events()

        def report(step: int, reason: str) -> None:
            if step not in self._damaged_reported:
                self._damaged_reported.add(step)
                self._emit("checkpoint_damaged", step, reason=reason, path=os.fspath(self.directory / str(step)))

        # The save in flight (its folder may exist before its marker) and folders being deleted
        # (their marker may already be gone) are neither candidates nor "damaged".
        skip = ({self._inflight} if self.busy else set()) | self._deleter.pending()
        value = self._agree(f"latest {before}", lambda: str(latest_good(self.directory, skip, report, before)))
        self._drain_events()
        return None if value == "None" else int(value)

    def discard_after(self, step: int, committed_before: Optional[float] = None) -> list[int]:
        """Delete the checkpoints newer than `step` (a rollback's target), so none wins a later restart.

        Like retention, each loses its commit marker first: a crash halfway leaves it invisible,
        never half-trusted. Waits for the save in flight first.

        Args:
          step: keep this step and older ones.
          committed_before: delete only checkpoints committed before this Unix time (re-applying
            an old rollback must not delete what was saved after it).
        Returns:
          The steps deleted (process 0's answer, the same on every process).
        """
        self._join()
        self._deleter.wait_idle()  # nothing of the queue may delete a folder under our hands
        self._drain_events()

        def discard() -> str:
            deleted = []
            for s, folder, tmp in scan(self.directory):
                if s <= step:
                    continue
                if committed_before is not None:
                    meta = check_checkpoint(folder)[2] if not tmp else None
                    if meta is None or meta.get("unix_time", 0) >= committed_before:
                        continue
                _delete_step(folder)
                deleted.append(s)
            return json.dumps(deleted)

        deleted = json.loads(self._agree(f"discard_after {step}", discard))
        self._barrier(f"discarded after {step}")  # nobody restores before process 0 has deleted
        return deleted

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Load checkpoint `step` straight into the shardings of `abstract_state`.

        Args:
          step: a step from `latest_step()`.
          abstract_state: pytree of jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding)
            with the same structure as the saved state; the mesh may differ from the one saved.
        Returns:
          (state, extra): the arrays, sharded as asked, and the JSON extras.
        Raises:
          ConfigError: names, shapes differ (checked before reading any array).
          CheckpointError: the checkpoint is missing or damaged.
        """
        self._join()
        self._drain_events()
        folder = self.directory / str(step)
        # Process 0 checks and every process gets its verdict: one listing per restart instead of P,
        # and a transient error or a stale view on one process cannot make it raise alone while
        # the others wait out the barrier below.
        verdict = self._agree(f"restore {step}", lambda: _restore_verdict(folder, abstract_state))
        kind, _, message = verdict.partition(":")
        if kind == "damaged":
            raise CheckpointError(message)
        if kind == "mismatch":
            raise ConfigError(message)
        if kind == "transient":
            raise TransientStorageError(message)
        self._barrier(f"restore {step}")
        out = self._orbax.restore(folder, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(abstract_state, ocp.checkpoint_utils.construct_restore_args(abstract_state)),
            extra=ocp.args.JsonRestore()))
        return out["state"], dict(out["extra"] or {})

    def close(self) -> None:
        """Wait for the save in flight (and, bounded, its deletions), then release Orbax's threads."""
        self.wait()
        self._orbax.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # already failing: let the write in flight finish, but wait for no other host
            self._orbax.close()

    # -- background commit (process 0 writes the marker) ----------------------------------

    def _prepare(self, step: int, folder: epath.Path) -> str:
        """Process 0, before a save: 'exists' if `step` is committed, else clear leftovers.

        The directory is created here, at the first save, never earlier: a run that stops on a
        user error before its first save leaves no trace.
        """
        if is_local(os.fspath(self.directory)):
            os.makedirs(os.fspath(self.directory), exist_ok=True)
        # A step being deleted (re-saved after a rollback went back past it): let that finish
        # first, so the deletion cannot remove the files of the new write. Rare; bounded.
        self._deleter.wait_idle(self.timeout_s, step=step)
        if check_checkpoint(folder)[0]:
            return "exists"
        for s, p, _ in scan(self.directory):
            if s == step:  # a crashed write of this very step: garbage, never visible
                p.rmtree()
        return "ok"

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._inflight = None
        if self._error is not None:
            error, self._error = self._error, None
            self._drain_events()  # the checkpoint_failed event goes out before the exception
            raise CheckpointError(f"saving a checkpoint failed in the background: {error}") from error

    def _commit(self, step: int, folder: epath.Path, meta: dict, t0: float, blocked_s: float) -> None:
        try:
            self._orbax.wait_until_finished()  # every process's shards written, folder renamed
            if self._primary:
                fsync_tree(folder)
                meta["files"] = list_files(folder)
                meta["bytes"] = sum(meta["files"].values())
                write_atomic(folder / MARKER, json.dumps(meta, indent=1))
                deleted = self._retention(step)
                self._emit("checkpoint_saved", step, blocked_s=round(blocked_s, 4),
                           commit_s=round(time.monotonic() - t0, 4), bytes=meta["bytes"], deleted=deleted)
            self.last_commit = (int(step), time.time(), blocked_s, time.monotonic() - t0)
        except BaseException as e:  # raised to the caller by the next save()/wait()
            self._error = e
            self._emit("checkpoint_failed", step, error=f"{type(e).__name__}: {e}")

    def _retention(self, newest: int) -> list[int]:
        """Decide what keep_last / keep_every / the rollback pin do not keep and queue it for
        deletion (process 0, in the commit thread, right after `newest` committed; the deletion
        itself runs on the queue, off the next save's path). The newest good checkpoint is always
        kept and nothing at or after `newest` is touched (a later save may be writing there).

        Returns the steps queued for deletion (in the checkpoint_saved event)."""
        entries = scan(self.directory)
        doomed = self._deleter.pending()  # already queued: their markers may still exist
        committed = [s for s, p, tmp in entries if not tmp and s not in doomed and s <= newest
                     and (p / MARKER).exists()]
        keep = {newest} | set(committed[-max(self.cfg.keep_last, 1):])
        if self.cfg.keep_every > 0:
            keep |= {s for s in committed if s % self.cfg.keep_every == 0}
        with self._lock:
            pin = self._pin_before
        if pin is not None:  # the checkpoint a pending rollback would go back to
            keep |= set([s for s in committed if s < pin][-1:])
        deleted = []
        for s, p, tmp in entries:
            if s >= newest or (s in keep and not tmp) or s in doomed:
                continue
            self._deleter.submit(s, p)
            deleted.append(s)
        return sorted(set(deleted))


def _resolve_folder(path: str) -> epath.Path:
    """A `<step>/` folder from a step folder, a checkpoints/ folder or a run directory."""
    p = to_path(path)
    forget_listings(p)
    if (p / MARKER).exists():
        return p
    root = p / "checkpoints" if (p / "checkpoints").exists() else p
    step = latest_good(root)
    if step is None:
        raise ConfigError(f"checkpoint.init_from='{path}' holds no committed checkpoint")
    return root / str(step)


def _restore_verdict(folder: epath.Path, abstract_state: Any) -> str:
    """Process 0's verdict on restoring `folder`: "ok", or "damaged:", "mismatch:" (names or shapes
    differ: a user error) or "transient:" (the store gave no definite answer) and one line."""
    try:
        good, reason, _ = check_checkpoint(folder)
        if not good:
            return f"damaged:checkpoint {folder} cannot be restored: {reason}"
        _check_compatible(folder, abstract_state)
    except ConfigError as e:
        return f"mismatch:{e}"
    except Exception as e:  # every process raises the same, instead of process 0 alone
        kind = "transient" if is_transient(e) else "damaged"
        return f"{kind}:checking checkpoint {folder} failed: {type(e).__name__}: {e}"
    return "ok"


def saved_entries(path: str) -> set[str]:
    """The top-level entries of the state a committed checkpoint folder holds (`params`, `opt_state`,
    `moe`, ...), read from Orbax's metadata only."""
    folder = _resolve_folder(path)
    return {name.split(".")[0] for name in _flat(_pytree_handler(folder).metadata(folder / "state").tree)}


def restore_params_only(path: str, abstract_params: Any, subtree: str = "params") -> Any:
    """Load only the parameters of another run's checkpoint (for `checkpoint.init_from`).

    Args:
      path: a `<step>/` folder, a `checkpoints/` folder or a run directory (latest good step).
      abstract_params: pytree of jax.ShapeDtypeStruct with shardings, like the model's params.
      subtree: the state's entry to load: `params`, or another one shaped by `abstract_params`
        (`moe`: the router bias decoding routes with).
    Returns:
      The parameters, sharded as asked.
    Raises:
      ConfigError: nothing committed there, or the shapes differ (named, before reading).
    """
    check_access(path, key="checkpoint.init_from")
    folder = _resolve_folder(path)
    good, reason, _ = check_checkpoint(folder)
    if not good:
        raise ConfigError(f"checkpoint.init_from='{path}': {folder} is damaged: {reason}")
    _check_compatible(folder, abstract_params, prefix=subtree)
    item = {subtree: abstract_params}
    restored = ocp.Checkpointer(_pytree_handler(folder)).restore(folder / "state", args=ocp.args.PyTreeRestore(
        item, ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    return restored[subtree]


def restore_latest_read_only(checkpoint_dir: str, abstract_state: Any) -> tuple[int, Any, dict] | None:
    """The newest good checkpoint of a run, restored without writing anything (`Trainer(...,
    write_files=False)`: a notebook reading a trained run). No key-value agreement, no barrier:
    each process reads its own listing, which is safe because nothing here can change the folder.

    Returns:
      (step, state, extra), or None when the folder holds no committed checkpoint.
    Raises:
      ConfigError: names or shapes differ from `abstract_state` (checked before reading arrays).
      CheckpointError: the newest good checkpoint became unreadable while reading it.
    """
    root = to_path(checkpoint_dir)
    if not root.exists():
        return None
    step = latest_good(root)
    if step is None:
        return None
    folder = root / str(step)
    verdict = _restore_verdict(folder, abstract_state)
    kind, _, message = verdict.partition(":")
    if kind == "mismatch":
        raise ConfigError(message)
    if kind != "ok":
        raise CheckpointError(message)
    handler = ocp.CompositeCheckpointHandler(state=_pytree_handler(root), extra=ocp.JsonCheckpointHandler())
    with ocp.Checkpointer(handler) as reader:
        out = reader.restore(folder, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(abstract_state, ocp.checkpoint_utils.construct_restore_args(abstract_state)),
            extra=ocp.args.JsonRestore()))
    return step, out["state"], dict(out["extra"] or {})
