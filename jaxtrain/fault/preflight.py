"""Preflight health check: before training, measure every process's devices and links, name the bad ones.

Three measurements, each the best of a few timed repetitions after a warm-up:
1. matmul rate of every local device (a jitted square matmul; the process reports its slowest
   device), the number a slow or throttled accelerator shows. CPU devices of processes on one
   machine share its cores, so on the CPU the processes take turns (a host barrier between turns):
   timed together, each would measure its neighbours' load, not its own devices;
2. collective bandwidth over each mesh axis of size > 1: an all-reduce and an all-gather, timed
   on the whole job, so a slow network shows as a slow axis;
3. pairwise bandwidth between processes: a two-way exchange between the first devices of each pair
   of processes (every pair up to 16 processes, ring neighbours beyond), so one bad link is named
   rather than a slow job. Only the two ends of a pair time it (the slower end's figure counts), and
   a pair is slow against the median of all pairs, so naming a link needs 3 or more processes.
The per-process numbers are gathered (`hostcomm.LateAllGather`) and compared with the median: a
process whose matmul rate, or a pair whose bandwidth, is below `fault.preflight_factor` x the
median is named in the `preflight` event, with every number. `fault.preflight_action: exit` makes
a named process stop the job with exit 75, so the scheduler replaces the node.

Runs before training on multi-process jobs (`fault.preflight`), and on its own as
`jaxtrain preflight --config ...` (any process count).
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.checkpoint.multihost import barrier
from jaxtrain.config import Config
from jaxtrain.fault.hostcomm import LateAllGather

MAX_ALL_PAIRS = 16  # beyond this many processes, only ring neighbours are paired (P*(P-1)/2 grows fast)


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


def matmul_tflops(device: jax.Device, n: int, repeats: int, slow_s: float = 0.0) -> float:
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    f = jax.jit(lambda x: x @ x)
    return 2.0 * n ** 3 / _best_time(lambda: f(a), repeats, slow_s, MATMUL_MIN_S) / 1e12


def _local_matmul_tflops(mesh: Mesh, n: int, repeats: int, slow_s: float, *, in_turns: bool,
                         timeout_s: float) -> float:
    """This process's slowest local device; with `in_turns`, one process at a time. Collective."""
    def measure() -> float:
        return min(matmul_tflops(d, n, repeats, slow_s) for d in mesh.local_devices)

    if not in_turns:
        return measure()
    mine = float("nan")
    for turn in range(jax.process_count()):
        barrier(f"preflight/matmul/{turn}", timeout_s)
        if turn == jax.process_index():
            mine = measure()
    barrier("preflight/matmul/done", timeout_s)
    return mine


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


def process_pairs(count: int) -> list[tuple[int, int]]:
    """Every pair of processes up to MAX_ALL_PAIRS processes, ring neighbours beyond."""
    if count <= MAX_ALL_PAIRS:
        return list(itertools.combinations(range(count), 2))
    return sorted({tuple(sorted((p, (p + 1) % count))) for p in range(count)})


def pair_bandwidths(mbytes: float, repeats: int, slow_link: tuple[int, int] | None = None,
                    slow_s: float = 0.0) -> np.ndarray:
    """GB/s of a two-way exchange between the first devices of each pair of processes, as this
    process saw it: one entry per `process_pairs`, NaN for pairs it is not an end of (its clock says
    nothing about them). `slow_link`/`slow_s`: the chaos drill of one bad link."""
    count, me = jax.process_count(), jax.process_index()
    firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(count)]
    mesh = Mesh(np.array(firsts), ("process",))
    per_device = max(1, int(mbytes * 2**20 / 4))
    local = [d for d in firsts if d.process_index == me]
    x = jax.make_array_from_single_device_arrays(
        (count, per_device), NamedSharding(mesh, P("process")),
        [jax.device_put(jnp.ones((1, per_device), jnp.float32), d) for d in local])
    out = np.full(len(process_pairs(count)), np.nan)
    for k, (i, j) in enumerate(process_pairs(count)):
        swap = jax.jit(jax.shard_map(lambda b: jax.lax.ppermute(b, "process", [(i, j), (j, i)]), mesh=mesh,
                                     in_specs=P("process"), out_specs=P("process")))
        slow = slow_s if slow_link == (i, j) else 0.0
        seconds = _best_time(lambda: swap(x), repeats, slow)  # every process takes part in every exchange
        if me in (i, j):
            out[k] = 2 * per_device * 4 / seconds / 1e9
    return out


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
    pairs: dict[tuple[int, int], float] = {}
    if count > 1:
        link = tuple(sorted(c.slow_link)) if len(c.slow_link) == 2 else None
        seen = pair_bandwidths(mbytes, repeats, link, c.slow_link_seconds)
        gather = LateAllGather(mesh)
        gather.start(0, np.concatenate([[mine], seen]))
        table = gather.result(1)  # (process, 1 + pairs): the same numbers on every process
        matmul = table[:, 0].tolist()
        # A pair's bandwidth is what the slower of its two ends measured.
        pairs = {pair: float(np.nanmin(table[:, 1 + k])) for k, pair in enumerate(process_pairs(count))}
    else:
        matmul = [mine]
    factor = cfg.fault.preflight_factor
    median_matmul = statistics.median(matmul)
    named = [p for p, v in enumerate(matmul) if v < factor * median_matmul]
    slow_pairs = []
    if pairs:
        median_pair = statistics.median(pairs.values())
        slow_pairs = [list(p) for p, v in pairs.items() if v < factor * median_pair]
        # A process at an end of more than one slow pair is the likely owner of the bad link (its
        # network card): it is named too. One slow pair alone names no process, only the link.
        ends = [p for pair in slow_pairs for p in pair]
        named += sorted({p for p in ends if ends.count(p) > 1 and p not in named})
    report = {"processes": count, "hosts": hosts, "matmul_tflops": [round(v, 4) for v in matmul],
              "median_matmul_tflops": round(median_matmul, 4),
              "axes_gbps": {a: {k: round(v, 3) for k, v in b.items()} for a, b in axes.items()},
              "pairs_gbps": {f"{i}-{j}": round(v, 3) for (i, j), v in pairs.items()},
              "factor": factor, "named": sorted(named), "named_hosts": [hosts[p] for p in sorted(named)],
              "slow_pairs": slow_pairs, "slow_pair_hosts": [[hosts[i], hosts[j]] for i, j in slow_pairs],
              "action": cfg.fault.preflight_action}
    event("preflight", 0, **report)
    return report
