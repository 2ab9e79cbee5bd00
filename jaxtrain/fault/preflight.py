"""Preflight health check: before training, measure every process's devices and links, name the bad ones.

Three measurements, each the best of a few timed repetitions after a warm-up:
1. matmul rate of every local device (a jitted square matmul; the process reports its slowest
   device), the number a slow or throttled accelerator shows. CPU devices of processes on one
   machine share its cores, so on the CPU the processes take turns (a token passed down the processes):
   timed together, each would measure its neighbours' load, not its own devices;
2. collective bandwidth over each mesh axis of size > 1: an all-reduce and an all-gather, timed
   on the whole job, so a slow network shows as a slow axis;
3. pairwise bandwidth between processes: rounds of two-way exchanges between disjoint pairs of
   processes (`preflight_plan.plan_rounds`: every pair up to 8 processes, a few rings beyond, at
   most 7 rounds whatever P), each round one compiled program in which every matched pair swaps a
   buffer over all its devices at once (device r of one with device r of the other: every NIC
   rail of a GPU node). Only the two ends of a pair time it (the slower end's figure counts).
The per-process numbers are gathered (`hostcomm.LateAllGather`), so every process reaches the
same verdict: a process whose matmul rate is below `fault.preflight_factor` x the median is named;
links are judged by `preflight_plan.verdict` (intra-node pairs against intra-node ones, inter-node
against inter-node; a process by the median of its own pairs against the pairs not touching it;
a pair against the pairs touching no named process). The rounds holding anything flagged are
measured once more and judged on the better of the two figures (`rounds_confirmed`): a bad link is
slow both times, a burst of load is not. The `preflight` event has every number.
`fault.preflight_action: exit` makes a named process stop the job with exit 75, so the scheduler
replaces the node.

Runs before training on multi-process jobs (`fault.preflight`), and on its own as
`jaxtrain preflight --config ...` (any process count).
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxtrain.runtime.multihost import BarrierTimeoutError, barrier, client, next_call, wait_key
from jaxtrain.config import Config
from jaxtrain.runtime.hostcomm import LateAllGather
from jaxtrain.fault.preflight_plan import better_of, plan_rounds, rounds_to_confirm, verdict


def _best_time(fn: Callable[[], Any], repeats: int, slow_s: float = 0.0, min_total_s: float = 0.0) -> float:
    """The fastest of at least `repeats` timed calls, repeated until `min_total_s` have passed.
    Collectives must pass min_total_s=0: every process has to make the same number of calls."""
    jax.block_until_ready(fn())  # compile and warm up
    best, start, done = float("inf"), time.perf_counter(), 0
    while done < repeats or time.perf_counter() - start < min_total_s:
        t = time.perf_counter()
        jax.block_until_ready(fn())
        time.sleep(slow_s)  # chaos.slow_process drill: this process looks slow
        best = min(best, time.perf_counter() - t)
        done += 1
    return best


MATMUL_MIN_S = 0.2  # per device: a best of 3 sub-millisecond matmuls was off by 40% on an idle CPU


_square = jax.jit(lambda x: x @ x)  # one function: compiled once per shape and device, also when the health check re-measures


def matmul_tflops(device: jax.Device, n: int, repeats: int, slow_s: float = 0.0,
                  min_total_s: float = MATMUL_MIN_S) -> float:
    """TFLOP/s of an n x n matmul on `device` (bf16; fp32 on the CPU), the best of the timed calls."""
    a = _ones(device, n)()
    return 2.0 * n ** 3 / _best_time(lambda: _square(a), repeats, slow_s, min_total_s) / 1e12


@functools.lru_cache(maxsize=None)
def _ones(device: jax.Device, n: int) -> Callable[[], jax.Array]:
    """A compiled fill that makes the operand on `device` itself: no host-to-device transfer (the
    health check runs inside the loop, under its transfer guard) and one compile per device."""
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    return jax.jit(lambda: jnp.ones((n, n), dtype), out_shardings=SingleDeviceSharding(device))


HEALTH_MATMUL_N = {"cpu": 256}  # the run-time re-measure (observe/health.py): 4096 elsewhere (32 MiB, ~0.1 TFLOP)


def local_matmul_check(devices: list[jax.Device]) -> Callable[[], float]:
    """The health check's matmul: this process's slowest local device, best of 3 calls each with no
    minimum time (milliseconds on a GPU, between steps)."""
    n = HEALTH_MATMUL_N.get(devices[0].platform, 4096)
    return lambda: min(matmul_tflops(d, n, 3, min_total_s=0.0) for d in devices)


def _local_matmul_tflops(mesh: Mesh, n: int, repeats: int, slow_s: float, *, in_turns: bool,
                         timeout_s: float) -> float:
    """This process's slowest local device; with `in_turns`, one process at a time. Collective."""
    def measure() -> float:
        return min(matmul_tflops(d, n, repeats, slow_s) for d in mesh.local_devices)

    return take_turns(measure, timeout_s) if in_turns else measure()


def take_turns(measure: Callable[[], float], timeout_s: float, *, process_index: int | None = None,
               process_count: int | None = None, kv: Any = None) -> float:
    """Run `measure()` on one process at a time, in process order; every process returns its own.

    A token passes down the chain: process k waits for key `turn/k`, measures, sets `turn/k+1` and
    counts its turn done; the last one's token, `turn/P`, ends the turns for everyone, and a barrier
    lets process 0 delete what is left. O(1) coordinator calls per process (at most 8, plus one per
    `timeout_s` spent waiting) and O(P) for the job, no key left behind (formerly a barrier before
    every turn: P barriers of P^2 reads each, and P^2 keys never deleted). A waiting process gives
    up only when a whole `timeout_s` passes with no turn finished, so P turns may take longer than
    `timeout_s` in all; it then names the process holding the turn.

    Args:
      process_index, process_count, kv: this process, the job's size and the coordination client;
        jax's own by default (given explicitly by the simulated-scale harness).
    Raises:
      BarrierTimeoutError: naming the process whose turn never ended (or the one absent at the end).
    """
    count = jax.process_count() if process_count is None else process_count
    if count == 1:
        return measure()
    me = jax.process_index() if process_index is None else process_index
    kv = client() if kv is None else kv
    run = next_call("take_turns")  # every process takes turns equally often: agreed names
    prefix = f"jaxtrain/preflight/{run}/"
    if me > 0:
        _wait_for_turn(kv, prefix, me, me, timeout_s)
        kv.key_value_delete(f"{prefix}turn/{me}")  # read by this process only, and only once
    mine = measure()
    kv.key_value_set(f"{prefix}turn/{me + 1}", "1")  # the next one's turn; the last one's: the end
    kv.key_value_increment(f"{prefix}done", 1)  # what the waiting processes read to see progress
    _wait_for_turn(kv, prefix, count, me, timeout_s)  # every turn is over: all arrive at the barrier together
    barrier(f"preflight/{run}/matmul/done", timeout_s, process_index=me, process_count=count, kv=kv)
    if me == 0:
        kv.key_value_delete(prefix[:-1])  # the end token and the count: everyone has passed the barrier
    return mine


def _wait_for_turn(kv: Any, prefix: str, turn: int, me: int, timeout_s: float) -> None:
    """Wait for token `turn` (`turn` = P: the end); fail once a whole `timeout_s` passed with no turn
    finished, naming the process that holds the turn."""
    done_before = 0  # turns finished at the start of the current window (0: none needed to start)
    while wait_key(kv, f"{prefix}turn/{turn}", timeout_s) is None:
        done = int(kv.key_value_increment(f"{prefix}done", 0))  # reads the count (an increment by 0)
        if done <= done_before:
            raise BarrierTimeoutError(
                f"preflight turns timed out after {timeout_s:g} s on process {me}: process(es) [{done}] "
                f"never finished its turn (dead, hung or far behind; see checkpoint.barrier_timeout_s)")
        done_before = done


def axis_bandwidth(mesh: Mesh, axis: str, mbytes: float, repeats: int) -> dict[str, float]:
    """GB/s per device of an all-reduce and an all-gather over one mesh axis (ring-algorithm bytes)."""
    n = mesh.shape[axis]
    per_device = max(1, int(mbytes * 2**20 / 4))
    x = jax.device_put(jnp.ones((mesh.size, per_device), jnp.float32), NamedSharding(mesh, P(mesh.axis_names)))
    spec = P(mesh.axis_names)
    reduce = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, axis), mesh=mesh, in_specs=spec, out_specs=spec))
    gather = jax.jit(jax.shard_map(lambda b: jax.lax.all_gather(b, axis, tiled=True), mesh=mesh, in_specs=spec,
                                   out_specs=spec))
    nbytes = per_device * 4
    t_reduce, t_gather = _best_time(lambda: reduce(x), repeats), _best_time(lambda: gather(x), repeats)
    return {"all_reduce_gbps": 2 * nbytes * (n - 1) / n / t_reduce / 1e9,
            "all_gather_gbps": nbytes * (n - 1) / t_gather / 1e9}


CPU_EXCHANGE_REPEATS = 20


def exchange_mesh(devices: list[jax.Device] | None = None) -> Mesh:
    """Every device of the job as a (process, rail) mesh: row p holds process p's devices by id,
    so column r is every process's r-th device (its r-th NIC rail on a GPU node). With unequal
    device counts, each process's first min-count devices."""
    devices = jax.devices() if devices is None else devices
    rows: dict[int, list[jax.Device]] = {}
    for d in sorted(devices, key=lambda d: d.id):
        rows.setdefault(d.process_index, []).append(d)
    rails = min(len(r) for r in rows.values())
    return Mesh(np.array([rows[p][:rails] for p in sorted(rows)]), ("process", "rail"))


def exchange_program(mesh: Mesh, matching: list[tuple[int, int]]) -> Callable[[jax.Array], jax.Array]:
    """One round's program: every matched pair of processes swaps a buffer over every rail at
    once (device (i, r) <-> (j, r)); unmatched processes receive zeros. Rows of `mesh` index
    processes as `matching` does (a process's row in `exchange_mesh`)."""
    perm = [(i, j) for i, j in matching] + [(j, i) for i, j in matching]
    spec = P("process", "rail")
    return jax.jit(jax.shard_map(lambda b: jax.lax.ppermute(b, "process", perm), mesh=mesh, in_specs=spec,
                                 out_specs=spec))


def exchange_buffer(mesh: Mesh, mbytes: float) -> jax.Array:
    """`mbytes` MiB of float32 ones on each device of `mesh`, shaped (process, rail, n)."""
    per_device = max(1, int(mbytes * 2**20 / 4))
    sharding = NamedSharding(mesh, P("process", "rail"))
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return jax.make_array_from_single_device_arrays(
        (*mesh.devices.shape, per_device), sharding,
        [jax.device_put(jnp.ones((1, 1, per_device), jnp.float32), d) for d in local])


def round_bandwidths(rounds: list[list[tuple[int, int]]], mbytes: float, repeats: int,
                     slow_links: set[tuple[int, int]] = frozenset(), slow_s: float = 0.0,
                     mesh: Mesh | None = None, process_index: int | None = None) -> np.ndarray:
    """GB/s per rail of this process's exchange in each round (one compiled program per round, over
    every local device), as this process's clock saw it; NaN for rounds it sits out. Collective:
    every process runs every round. `slow_links`/`slow_s`: the chaos drill of bad links (the two
    ends of a listed pair wait `slow_s` after each exchange of it).

    `mesh`, `process_index`: the (process, rail) mesh (`exchange_mesh()` by default) and whose
    rounds to time (this process; a single-process test passes a row of its own mesh)."""
    mesh = exchange_mesh() if mesh is None else mesh
    me = jax.process_index() if process_index is None else process_index
    x = exchange_buffer(mesh, mbytes)
    nbytes = x.shape[-1] * 4
    out = np.full(len(rounds), np.nan)
    # Every program compiled before any is timed: a process compiling the next round would load the
    # machine while its peers time this one (on the CPU, where they share cores).
    programs = [exchange_program(mesh, matching).lower(x).compile() for matching in rounds]
    for k, (matching, swap) in enumerate(zip(rounds, programs)):
        partner = next((i + j - me for i, j in matching if me in (i, j)), None)
        slow = slow_s if partner is not None and (min(me, partner), max(me, partner)) in slow_links else 0.0
        seconds = _best_time(lambda: swap(x), repeats, slow)  # the same number of calls on every process
        if partner is not None:
            out[k] = 2 * nbytes / seconds / 1e9
    return out


def pair_table(rounds: list[list[tuple[int, int]]], table: np.ndarray) -> dict[tuple[int, int], float]:
    """Per-pair GB/s from the gathered per-process, per-round figures (`table[p, k]`: process p in
    round k): a pair's bandwidth is what the slower of its two ends measured."""
    return {(i, j): float(np.nanmin(table[[i, j], k])) for k, matching in enumerate(rounds) for i, j in matching}


def run_preflight(cfg: Config, mesh: Mesh, hosts: list[str], event: Callable[..., None], *,
                  matmul_n: int | None = None, mbytes: float | None = None, repeats: int = 3) -> dict:
    """Measure, gather, compare; log one `preflight` event. Returns the report (`named`: processes
    below the factor; `slow_pairs`: pairs below it). Collective: call on every process."""
    me, count = jax.process_index(), jax.process_count()
    cpu = jax.devices()[0].platform == "cpu"
    matmul_n = matmul_n or (512 if cpu else 8192)
    mbytes = mbytes if mbytes is not None else (1.0 if cpu else 64.0)
    c = cfg.chaos
    slow_s = c.slow_seconds if (c.slow_seconds > 0 and me == c.slow_process) else 0.0
    mine = _local_matmul_tflops(mesh, matmul_n, repeats, slow_s, in_turns=cpu,
                                timeout_s=cfg.checkpoint.barrier_timeout_s)
    axes = {a: axis_bandwidth(mesh, a, mbytes, repeats) for a in mesh.axis_names if mesh.shape[a] > 1}
    factor = cfg.fault.preflight_factor
    pairs: dict[tuple[int, int], float] = {}
    again: list[int] = []
    rounds = plan_rounds(hosts) if count > 1 else []
    rails = len(mesh.local_devices)
    if count > 1:
        xmesh = exchange_mesh()
        rails = xmesh.shape["rail"]
        slow_links = {(min(i, j), max(i, j)) for i, j in c.slow_link_pairs()}
        # On the CPU the processes of one machine share its cores: the best of more exchanges
        # filters out their load (an exchange takes milliseconds there).
        exchange_repeats = max(repeats, CPU_EXCHANGE_REPEATS) if cpu else repeats
        seen = round_bandwidths(rounds, mbytes, exchange_repeats, slow_links, c.slow_link_seconds, xmesh)
        gather = LateAllGather(mesh)
        gather.start(0, np.concatenate([[mine], seen]))
        table = gather.result(1)  # (process, 1 + rounds): the same numbers on every process
        matmul = table[:, 0].tolist()
        pairs = dict(sorted(pair_table(rounds, table[:, 1:]).items()))
        links = verdict(pairs, hosts, factor)  # per-process and per-pair, intra-node and inter-node apart
        again = rounds_to_confirm(rounds, links)  # the same list on every process, as the table is
        if again:
            # A second look at what was flagged, each figure the better of the two: a bad link is
            # slow both times, a burst of load on a shared machine (CI once flagged a healthy pair
            # of three processes on two cores) is not.
            seen = round_bandwidths([rounds[k] for k in again], mbytes, exchange_repeats, slow_links,
                                    c.slow_link_seconds, xmesh)
            gather.start(2, seen)
            pairs = better_of(pairs, pair_table([rounds[k] for k in again], gather.result(3)))
            links = verdict(pairs, hosts, factor)
    else:
        matmul = [mine]
        links = verdict(pairs, hosts, factor)
    median_matmul = statistics.median(matmul)
    slow_devices = [p for p, v in enumerate(matmul) if v < factor * median_matmul]
    named = sorted(set(slow_devices) | set(links["named"]))
    slow_pairs = links["slow_pairs"]
    report = {"processes": count, "hosts": hosts, "matmul_tflops": [round(v, 4) for v in matmul],
              "median_matmul_tflops": round(median_matmul, 4),
              "axes_gbps": {a: {k: round(v, 3) for k, v in b.items()} for a, b in axes.items()},
              "pairs_gbps": {f"{i}-{j}": round(v, 3) for (i, j), v in pairs.items()},
              "factor": factor, "named": sorted(named), "named_hosts": [hosts[p] for p in sorted(named)],
              "slow_pairs": slow_pairs, "slow_pair_hosts": [[hosts[i], hosts[j]] for i, j in slow_pairs],
              "named_for_links": links["named"],
              "reference_gbps": {k: round(v, 3) for k, v in links["reference_gbps"].items()},
              "rounds": len(rounds), "rounds_confirmed": again, "rails": rails,
              "action": cfg.fault.preflight_action}
    event("preflight", 0, **report)
    return report
