"""Host-level barriers with a timeout that names the processes that never arrived.

Built on the jax.distributed coordination service, because
`jax.experimental.multihost_utils.sync_global_devices` is a device collective with no timeout:
a dead or hung host makes it wait forever without saying who is missing.

Cost: O(1) coordinator calls per process and O(P) for the whole job. Each process sets its own
arrival key, waits in the service's own barrier (`wait_at_barrier`, which the coordinator
answers for all P processes at once) and deletes its key again; only on a timeout does it read the
barrier's key directory, once, to name who never arrived. (Formerly every process read every
peer's key in turn: P^2 calls per barrier, 10^6 at P = 1,000.)
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator, Optional

import jax


class BarrierTimeoutError(TimeoutError):
    """Some processes did not reach a host-level barrier in time; the message names them."""


_local = threading.local()  # per-thread client override: the simulated-scale harness (tests/coordination_stand_in.py)


@contextlib.contextmanager
def use_client(kv: Any) -> Iterator[None]:
    """Make `client()` return `kv` in this thread (the harness runs one simulated process per thread,
    each with its own fake client, and calls the real code, which looks the client up itself)."""
    previous = getattr(_local, "client", None), getattr(_local, "counters", None)
    _local.client, _local.counters = kv, getattr(kv, "call_counters", {})
    try:
        yield
    finally:
        _local.client, _local.counters = previous


_counters: dict[str, itertools.count] = {}


def next_call(what: str) -> int:
    """How many times this process asked before: numbers barrier names that every process makes
    equally often (job_hosts, preflight turns), so they agree without talking. Per process, i.e.
    per simulated process under `use_client` (the client's `call_counters`)."""
    counters = getattr(_local, "counters", None)
    return next((_counters if counters is None else counters).setdefault(what, itertools.count()))


def client() -> Any:
    """The jax.distributed coordination-service client (raises if not initialized)."""
    override = getattr(_local, "client", None)
    if override is not None:
        return override
    # The coordination-service client of jax.distributed.initialize(). jax has no public
    # accessor; its key-value store is what lets a barrier say WHO is missing, which
    # multihost_utils.sync_global_devices (a device collective without a timeout) cannot.
    from jax._src import distributed

    kv = distributed.global_state.client
    if kv is None:
        raise RuntimeError("several JAX processes but jax.distributed.initialize() was not called")
    return kv


def barrier(name: str, timeout_s: float, *, process_index: Optional[int] = None,
            process_count: Optional[int] = None, kv: Any = None) -> None:
    """Block until every process reached barrier `name`, or fail naming the ones that did not.

    Three coordinator calls per process (arrival key, `wait_at_barrier`, deleting the key), three
    on a timeout too (the directory read replaces the delete: the keys stay, so that a process
    arriving after the deadline can tell it was the late one). The coordinator counts the timeout
    from the first process's arrival.

    Args:
      name: unique per use in the job (the service keeps every barrier id it has seen).
      timeout_s: how long to wait for the others.
      process_index, process_count, kv: this process, the job's size and the client; jax's own
        by default (given explicitly by the simulated-scale harness).
    Raises:
      BarrierTimeoutError: naming the process ids that never arrived.
    """
    n = jax.process_count() if process_count is None else process_count
    if n == 1:
        return
    me = jax.process_index() if process_index is None else process_index
    kv = client() if kv is None else kv
    prefix = f"jaxtrain/barrier/{name}/"
    kv.key_value_set(prefix + str(me), "1", allow_overwrite=True)
    try:
        kv.wait_at_barrier(prefix[:-1], max(1, int(timeout_s * 1000)))
    except Exception as e:  # the client raises a bare JaxRuntimeError (DEADLINE_EXCEEDED)
        raise barrier_timeout_error(kv, name, prefix, timeout_s, me, n, e) from None
    kv.key_value_delete(prefix + str(me))  # every process has arrived: nobody reads it again


def barrier_timeout_error(kv: Any, name: str, prefix: str, timeout_s: float, me: int, n: int,
             error: Exception) -> BarrierTimeoutError:
    """The error of a barrier that timed out, naming the missing processes (one directory read)."""
    try:
        arrived = {k.rsplit("/", 1)[-1] for k, _ in kv.key_value_dir_get(prefix)}
    except Exception as e:  # the coordinator itself is gone: say so rather than name nobody
        return BarrierTimeoutError(
            f"barrier '{name}' failed after {timeout_s:g} s on process {me}: {error}; the arrivals could "
            f"not be read either ({type(e).__name__}: {e}; see checkpoint.barrier_timeout_s)")
    missing = [p for p in range(n) if str(p) not in arrived]
    if not missing:  # everyone is here now: the deadline passed before the last one came
        return BarrierTimeoutError(
            f"barrier '{name}' timed out after {timeout_s:g} s on process {me}: every process of {n} "
            "arrived, but not all within the timeout of the first (this one, or one just before it, "
            "was far behind; see checkpoint.barrier_timeout_s)")
    return BarrierTimeoutError(
        f"barrier '{name}' timed out after {timeout_s:g} s on process {me}: "
        f"process(es) {missing} of {n} never arrived (dead, hung or far behind; "
        "see checkpoint.barrier_timeout_s)")


def wait_key(kv: Any, key: str, timeout_s: float) -> Optional[str]:
    """`blocking_key_value_get` that returns None on a timeout instead of raising."""
    try:
        return kv.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    except Exception:  # a bare JaxRuntimeError on DEADLINE_EXCEEDED
        return None

