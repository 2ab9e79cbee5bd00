"""Host-level barriers with a timeout that names the processes that never arrived.

Built on the key-value store of the jax.distributed coordination service, because
`jax.experimental.multihost_utils.sync_global_devices` is a device collective with no timeout:
a dead or hung host makes it wait forever without saying who is missing.
"""

from __future__ import annotations

import time

import jax


class BarrierTimeoutError(TimeoutError):
    """Some processes did not reach a host-level barrier in time; the message names them."""


def client():
    """The jax.distributed coordination-service client (raises if not initialized)."""
    # The coordination-service client of jax.distributed.initialize(). jax has no public
    # accessor; its key-value store is what lets a barrier say WHO is missing, which
    # multihost_utils.sync_global_devices (a device collective without a timeout) cannot.
    from jax._src import distributed

    kv = distributed.global_state.client
    if kv is None:
        raise RuntimeError("several JAX processes but jax.distributed.initialize() was not called")
    return kv


def barrier(name: str, timeout_s: float) -> None:
    """Block until every process reached barrier `name`, or fail naming the ones that did not.

    Args:
      name: unique per use (a second barrier with the same name passes at once).
      timeout_s: how long to wait for the others.
    Raises:
      BarrierTimeoutError: naming the process ids that never arrived.
    """
    n = jax.process_count()
    if n == 1:
        return
    kv = client()
    prefix = f"jaxtrain/barrier/{name}/"
    kv.key_value_set(prefix + str(jax.process_index()), "1", allow_overwrite=True)
    deadline = time.monotonic() + timeout_s
    for pid in range(n):
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            kv.blocking_key_value_get(prefix + str(pid), remaining_ms)
        except Exception:  # the client raises a bare XlaRuntimeError on DEADLINE_EXCEEDED
            arrived = {k.rsplit("/", 1)[-1] for k, _ in kv.key_value_dir_get(prefix)}
            missing = [p for p in range(n) if str(p) not in arrived]
            raise BarrierTimeoutError(
                f"barrier '{name}' timed out after {timeout_s:g} s on process {jax.process_index()}: "
                f"process(es) {missing} of {n} never arrived (dead, hung or far behind; "
                "see checkpoint.barrier_timeout_s)") from None
