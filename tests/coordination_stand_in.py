"""What every cross-process mechanism costs the coordination service at P = 8 ... 1,000 processes.

No machine here has 1,000 hosts, and a mechanism that reads every peer's key from every process
(P^2 calls) looks harmless at P = 2. So this runs the real jaxtrain functions (barrier, agreement,
`job_hosts`, watchdog progress and hang verdict, preflight turns, checkpoint discovery ...) with P
simulated processes: one thread each, each with its own client of one in-memory fake coordination
service that counts the calls (RPCs) and bytes of every process, and the keys and barriers left in
the service afterwards. No JAX devices are used. `bench/bench_coordination.py` prints the table and
`tests/fault/test_coordination_scale.py` holds it to O(1) calls per process and O(P) per job.
A test stand-in, not part of the installed package (tests/ is on the tests' path; the benchmark
puts it on its own).

The fake implements the subset of `DistributedRuntimeClient` that jaxtrain uses, with the real
service's semantics where they matter: `wait_at_barrier` counts its timeout from the first
arrival, fails for every process at once, and fails at once for a process arriving after that;
`key_value_delete` deletes a key and the directory under it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Optional

import jax

from jaxtrain.runtime import multihost


class FakeDeadlineExceeded(RuntimeError):
    """What the real client raises (a JaxRuntimeError whose message starts with DEADLINE_EXCEEDED)."""


class _Barrier:
    def __init__(self, deadline: float):
        self.deadline = deadline
        self.arrived: set[int] = set()
        self.done = threading.Event()
        self.ok = False


class FakeCoordinationService:
    """The coordinator's key-value store and barriers, in memory, counting per process."""

    def __init__(self, process_count: int):
        self.process_count = process_count
        self._lock = threading.Lock()
        self.store: dict[str, str] = {}
        self._waiters: dict[str, threading.Event] = {}
        self.barriers: dict[str, _Barrier] = {}
        self.rpcs = [0] * process_count
        self.bytes = [0] * process_count
        self.calls: dict[str, int] = {}
        self._clients: dict[int, FakeClient] = {}
        self._dirs: dict[str, set[str]] = {}  # "a/b/" -> the keys under it (a directory read is O(its size))

    def client(self, process_index: int) -> "FakeClient":
        """Process `process_index`'s client: the same one each time, as in a real process."""
        with self._lock:
            if process_index not in self._clients:
                self._clients[process_index] = FakeClient(self, process_index)
            return self._clients[process_index]

    def _count(self, pid: int, method: str, nbytes: int) -> None:
        with self._lock:
            self.rpcs[pid] += 1
            self.bytes[pid] += nbytes
            self.calls[method] = self.calls.get(method, 0) + 1

    def _put(self, key: str, value: str) -> None:  # under the lock
        if key not in self.store:
            parts = key.split("/")
            for i in range(1, len(parts)):
                self._dirs.setdefault("/".join(parts[:i]) + "/", set()).add(key)
        self.store[key] = value

    def _drop(self, key: str) -> None:  # under the lock
        if self.store.pop(key, None) is not None:
            parts = key.split("/")
            for i in range(1, len(parts)):
                self._dirs.get("/".join(parts[:i]) + "/", set()).discard(key)

    def reset_counts(self) -> None:
        """Forget the counts (not the store): the next operation is measured on its own."""
        with self._lock:
            self.rpcs = [0] * self.process_count
            self.bytes = [0] * self.process_count
            self.calls = {}


class FakeClient:
    """One process's client of a `FakeCoordinationService` (the jaxlib client's method names)."""

    def __init__(self, service: FakeCoordinationService, process_index: int):
        self._s, self._pid = service, process_index
        self.call_counters: dict[str, Any] = {}  # multihost.next_call's, per (simulated) process

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        s = self._s
        s._count(self._pid, "key_value_set", len(key) + len(value))
        with s._lock:
            if key in s.store and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            s._put(key, value)
            waiter = s._waiters.pop(key, None)
        if waiter is not None:
            waiter.set()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        s = self._s
        with s._lock:
            value = s.store.get(key)
            waiter = None if value is not None else s._waiters.setdefault(key, threading.Event())
        if waiter is not None:
            waiter.wait(timeout_in_ms / 1000)
            with s._lock:
                value = s.store.get(key)
        s._count(self._pid, "blocking_key_value_get", len(key) + len(value or ""))
        if value is None:
            raise FakeDeadlineExceeded(f"DEADLINE_EXCEEDED: key {key} not set in {timeout_in_ms} ms")
        return value

    def key_value_try_get(self, key: str) -> str:
        s = self._s
        with s._lock:
            value = s.store.get(key)
        s._count(self._pid, "key_value_try_get", len(key) + len(value or ""))
        if value is None:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return value

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        s = self._s
        prefix = key if key.endswith("/") else key + "/"
        with s._lock:
            entries = sorted((k, s.store[k]) for k in s._dirs.get(prefix, ()))
        s._count(self._pid, "key_value_dir_get", len(key) + sum(len(k) + len(v) for k, v in entries))
        return entries

    def key_value_delete(self, key: str) -> None:
        s = self._s
        s._count(self._pid, "key_value_delete", len(key))
        with s._lock:
            for k in [key, *s._dirs.get(key + "/", ())]:
                s._drop(k)

    def key_value_increment(self, key: str, increment: int) -> int:
        s = self._s
        s._count(self._pid, "key_value_increment", len(key) + 8)
        with s._lock:
            value = int(s.store.get(key, "0")) + increment
            s._put(key, str(value))
        return value

    def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int,
                        process_ids: Optional[list[int]] = None) -> None:
        s = self._s
        s._count(self._pid, "wait_at_barrier", len(barrier_id))
        expected = s.process_count if process_ids is None else len(process_ids)
        with s._lock:
            b = s.barriers.get(barrier_id)
            if b is None:  # the first arrival's timeout is the barrier's
                b = s.barriers[barrier_id] = _Barrier(time.monotonic() + timeout_in_ms / 1000)
            if not b.done.is_set():
                b.arrived.add(self._pid)
                if len(b.arrived) == expected:
                    b.ok = True
                    b.done.set()
        b.done.wait(max(0.0, b.deadline - time.monotonic()))
        with s._lock:
            if not b.done.is_set():
                b.done.set()  # timed out: it fails for everyone, latecomers included
        if not b.ok:
            raise FakeDeadlineExceeded(
                f"DEADLINE_EXCEEDED: Barrier timed out. Id: {barrier_id}. # of tasks that reached the "
                f"barrier: {len(b.arrived)}/{expected}")


# -- running the real code as P simulated processes ---------------------------------------------

_me = threading.local()  # the simulated process of this thread (index, count)


@contextlib.contextmanager
def _simulated_jax() -> Iterator[None]:
    """jax.process_index()/process_count() answer per thread while simulating: the code of others'
    modules (the Checkpointer's agreement) asks jax rather than taking them as arguments."""
    real_index, real_count = jax.process_index, jax.process_count

    def process_index(*args: Any, **kwargs: Any) -> int:
        return _me.index if hasattr(_me, "index") else real_index(*args, **kwargs)

    def process_count(*args: Any, **kwargs: Any) -> int:
        return _me.count if hasattr(_me, "count") else real_count(*args, **kwargs)

    jax.process_index, jax.process_count = process_index, process_count
    try:
        yield
    finally:
        jax.process_index, jax.process_count = real_index, real_count


@dataclasses.dataclass
class Measurement:
    """One operation at P processes, as the coordination service saw it."""

    operation: str
    processes: int
    rpcs_total: int
    rpcs_max_per_process: int
    bytes_total: int
    bytes_max_per_process: int
    keys_left: int  # keys the operation left in the coordinator's store
    barriers: int  # barrier ids the service holds afterwards
    wall_s: float
    errors: dict[int, str] = dataclasses.field(default_factory=dict)  # process -> the error it raised
    programs_compiled: Optional[int] = None  # per process, where the operation compiles anything
    note: str = ""

    def json(self) -> str:
        d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "errors"}
        d["errors"] = len(self.errors)
        return json.dumps(d)


def simulate(operation: str, process_count: int, body: Callable[[int, Any], Any], *,
             absent: tuple[int, ...] = (), service: Optional[FakeCoordinationService] = None,
             note: str = "") -> tuple[Measurement, dict[int, Any]]:
    """Run `body(process_index, client)` in one thread per simulated process (`absent` ones never
    start: dead hosts); returns the counts and every process's result."""
    service = service or FakeCoordinationService(process_count)
    service.reset_counts()
    keys_before, barriers_before = len(service.store), len(service.barriers)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}

    gate = threading.Event()  # every thread starts its process at once: starting 1,000 threads takes a while

    def run(pid: int) -> None:
        _me.index, _me.count = pid, process_count
        gate.wait()
        kv = service.client(pid)
        try:
            with multihost.use_client(kv):
                results[pid] = body(pid, kv)
        except BaseException as e:  # noqa: BLE001 -- reported per process
            errors[pid] = f"{type(e).__name__}: {e}"

    with _simulated_jax():
        threads = [threading.Thread(target=run, args=(p,), daemon=True)
                   for p in range(process_count) if p not in absent]
        for t in threads:
            t.start()
        started = time.perf_counter()
        gate.set()
        for t in threads:
            t.join()
    wall = time.perf_counter() - started
    m = Measurement(operation, process_count, sum(service.rpcs), max(service.rpcs), sum(service.bytes),
                    max(service.bytes), len(service.store) - keys_before, len(service.barriers) - barriers_before,
                    round(wall, 3), errors, note=note)
    return m, results


# -- the operations ------------------------------------------------------------------------------

TIMEOUT_S = 60.0  # generous: 1,000 threads on 2 cores must not time out by accident


def _checkpointer_stub(pid: int, directory: str, calls: Iterator[int]) -> Any:
    """A Checkpointer of process `pid` without Orbax behind it: its coordination methods are real."""
    from jaxtrain.checkpoint import checkpointer as ck_mod
    from jaxtrain.storage.paths import to_path

    ck = object.__new__(ck_mod.Checkpointer)
    ck.directory, ck.timeout_s, ck._on_event, ck._primary = to_path(directory), TIMEOUT_S, None, pid == 0
    ck._uid, ck._calls, ck._generation = 0, calls, 0
    ck._events, ck._lock, ck._thread, ck._inflight = [], threading.Lock(), None, None
    ck._damaged_reported, ck._deleter = set(), ck_mod._Deleter(lambda step, e: None)
    return ck


def measure_all(process_count: int, *, barrier_timeout_s: Optional[float] = None) -> list[Measurement]:
    """Every mechanism at `process_count` simulated processes, each measured on its own.
    `barrier_timeout_s`: of the absent-process barrier (default: long enough for P threads on 2 cores)."""
    if barrier_timeout_s is None:
        barrier_timeout_s = max(0.5, process_count / 400)
    from jaxtrain.runtime.multihost import barrier
    from jaxtrain.config import FaultConfig
    from jaxtrain.fault import preflight
    from jaxtrain.fault.preflight_plan import plan_rounds
    from jaxtrain.fault.preemption import agree_on_startup_stop
    from jaxtrain.fault.stragglers import job_hosts
    from jaxtrain.fault.watchdog import Watchdog

    P = process_count
    out: list[Measurement] = []

    def add(name: str, body: Callable[[int, Any], Any], **kw: Any) -> tuple[Measurement, dict[int, Any]]:
        m, results = simulate(name, P, body, **kw)
        out.append(m)
        return m, results

    add("barrier", lambda p, kv: barrier("sim/1", TIMEOUT_S, process_index=p, process_count=P, kv=kv))
    add("barrier, one process absent", lambda p, kv: barrier(
        "sim/absent", barrier_timeout_s, process_index=p, process_count=P, kv=kv), absent=(P - 1,),
        note=f"times out after {barrier_timeout_s:g} s; the directory read names process {P - 1}")
    add("job_hosts", lambda p, kv: job_hosts(p, P, TIMEOUT_S, kv=kv, host=f"host{p}"))
    add("startup stop agreement", lambda p, kv: agree_on_startup_stop(
        None, p, P, name=f"sim{P}", timeout_s=TIMEOUT_S))

    with tempfile.TemporaryDirectory() as directory:
        stubs = {p: _checkpointer_stub(p, directory, itertools.count()) for p in range(P)}
        add("checkpoint agreement", lambda p, kv: stubs[p].agree("sim", lambda: "yes"))
        add("checkpoint discovery (latest_step)", lambda p, kv: stubs[p].latest_step())

        def save(p: int, kv: Any) -> None:  # a save's coordination, as Checkpointer.save makes it
            ck = stubs[p]
            ck._generation = 1
            ck._agree("prepare 5", lambda: "new")
            ck._barrier("save 5")
            ck._forget_previous_generation()
            ck._orbax_barrier(key="write", timeout_ms=int(TIMEOUT_S * 1000))
            ck._orbax_barrier(key="commit", timeout_ms=int(TIMEOUT_S * 1000))
        add("checkpoint save (1 agreement, 3 barriers)", save)
        add("restart (job_hosts, latest_step, restore barrier)", lambda p, kv: (
            job_hosts(p, P, TIMEOUT_S, kv=kv, host=f"host{p}"), stubs[p].latest_step(),
            stubs[p]._barrier("restore 5")))

    with tempfile.TemporaryDirectory() as output_dir:
        dogs = {p: Watchdog(FaultConfig(), output_dir=output_dir, process_index=p, process_count=P)
                for p in range(P)}
        add("watchdog progress (one publish round)", lambda p, kv: dogs[p]._publish(),
            note="every few seconds per process: its heartbeat key, the hang counter")
        hung = FakeCoordinationService(P)  # a job whose processes all published, then hung
        simulate("(heartbeats)", P, lambda p, kv: dogs[p]._publish(), service=hung)
        add("watchdog hang verdict", lambda p, kv: (dogs[p]._job_view(), dogs[p]._declare_and_linger(P)),
            service=hung, note="process 0 reads every heartbeat and writes the event; the others read process "
                               "0's heartbeat only; every process declares and polls one counter")

    add("preflight turns (CPU)", lambda p, kv: preflight.take_turns(lambda: float(p), TIMEOUT_S,
                                                                    process_index=p, process_count=P, kv=kv))
    # 8 processes per host (one per GPU of an H100/H200 node), so both intra- and inter-node rounds show.
    hosts = [f"host{p // 8}" for p in range(P)]
    rounds = plan_rounds(hosts)
    out.append(Measurement("preflight planning (pair exchanges)", P, 0, 0, 0, 0, 0, 0, 0.0,
                           programs_compiled=len(rounds),
                           note=f"8 processes per host: {sum(map(len, rounds))} pairs in {len(rounds)} rounds of "
                                "disjoint pairs, one program each (a device exchange, no coordinator call)"))
    out.append(Measurement("straggler gather", P, 0, 0, 0, 0, 0, 0, 0.0,
                           note=f"a device all-gather, no coordinator call: each process receives a {16 * P}-byte "
                                "table (16 bytes per process and local device)"))
    return out
