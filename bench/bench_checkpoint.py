"""Checkpoint benchmark: how long training is blocked by an async save vs a synchronous one.

    python bench/bench_checkpoint.py                      # 200 MB state, 1 CPU device
    python bench/bench_checkpoint.py --write-docs docs/checkpoint.md

Measured on one state of >= 200 MB (float32 arrays, random values, FSDP-sharded over the devices):
  - blocked:   seconds `Checkpointer.save()` holds the training loop, async vs synchronous
               (synchronous = the same Checkpointer with checkpoint.async_save=false);
  - commit:    seconds from save() to the commit marker (the write itself);
  - slowdown:  time of a jitted matmul-loop "step" while a write is in flight / without one;
  - restore:   seconds to restore the checkpoint into the same shardings.
Ratios measured side by side in one run are what to quote (DESIGN §7): machines are shared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=200.0, help="state size in MB (10^6 bytes)")
    p.add_argument("--devices", type=int, default=1, help="simulated CPU devices (sets XLA's host device count)")
    p.add_argument("--repeats", type=int, default=3, help="saves per mode; medians are reported")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--write-docs", default=None, help="replace the results section of this markdown file")
    return p.parse_args(argv)


def machine() -> str:
    cores = os.cpu_count()
    mem_gib = None
    model = ""
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) / 2**20
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except (OSError, StopIteration):
        pass
    mem = f", {mem_gib:.0f} GiB" if mem_gib else ""
    return f"{cores}-core CPU{mem}" + (f" ({model})" if model else "")


def timed_restores(ck, abstract, state, repeats: int) -> list[float]:
    """Seconds of each of `repeats` restores of the latest checkpoint, checked equal to `state`."""
    import jax
    import numpy as np

    restore = []
    for _ in range(repeats):
        t = time.perf_counter()
        restored, _ = ck.restore(ck.latest_step(), abstract)
        jax.block_until_ready(restored)
        restore.append(time.perf_counter() - t)
    assert all(np.array_equal(np.asarray(restored["params"][k]), np.asarray(state["params"][k]))
               for k in state["params"])
    return restore


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # Device count must be set before JAX starts.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxtrain.checkpoint.checkpointer import Checkpointer
    from jaxtrain.config import MESH_AXES, CheckpointConfig

    mesh = jax.make_mesh(tuple(args.devices if a == "fsdp" else 1 for a in MESH_AXES), MESH_AXES)
    rows, cols = 1024, 6144  # 25.2 MB per float32 array
    n_arrays = max(1, round(args.mb * 1e6 / (rows * cols * 4) + 0.499))
    sharded = NamedSharding(mesh, P("fsdp", None))
    replicated = NamedSharding(mesh, P())
    make = jax.jit(lambda k: jax.random.normal(k, (rows, cols), jnp.float32), out_shardings=sharded)
    state = {"step": jax.device_put(jnp.int32(0), replicated),
             "params": {f"w{i}": make(jax.random.key(i)) for i in range(n_arrays)},
             "rng": jax.device_put(jax.random.key_data(jax.random.key(0)), replicated)}
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

    # The "training step": a jitted loop of 512x512 matmuls, ~tens of ms on 2 cores. It does not
    # touch the checkpointed arrays, so any slowdown is contention with the background write.
    @jax.jit
    def step(x):
        return jax.lax.fori_loop(0, 16, lambda _, y: jnp.tanh(y @ y) * 0.5, x)

    x = jax.random.normal(jax.random.key(1), (512, 512))
    step(x).block_until_ready()

    def step_times(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            step(x).block_until_ready()
            out.append(time.perf_counter() - t)
        return out

    scratch = args.dir or tempfile.mkdtemp(prefix="jaxtrain_bench_ckpt_")
    events: list[tuple[str, int, dict]] = []
    on_event = lambda kind, s, **d: events.append((kind, s, d))
    try:
        # Synchronous: save() returns once the checkpoint is committed.
        sync = Checkpointer(os.path.join(scratch, "sync"), CheckpointConfig(async_save=False, keep_last=1))
        sync.save(1, state, {})  # first save: Orbax/TensorStore start-up, the finite check compiles
        sync_blocked = []
        for s in range(2, 2 + args.repeats):
            t = time.perf_counter()
            sync.save(s, state, {})
            sync_blocked.append(time.perf_counter() - t)
        sync.close()

        # Asynchronous: save() returns after the device->host copy; the write runs meanwhile.
        ck = Checkpointer(os.path.join(scratch, "async"), CheckpointConfig(keep_last=1), on_event=on_event)
        t = time.perf_counter()
        ck.save(1, state, {})
        first_blocked = time.perf_counter() - t
        ck.wait()
        async_blocked, baseline, inflight = [], [], []
        for s in range(2, 2 + args.repeats):
            baseline += step_times(8)
            t = time.perf_counter()
            ck.save(s, state, {"step": s})
            async_blocked.append(time.perf_counter() - t)
            while ck.busy:  # train while the write is in flight
                inflight += step_times(1)
            ck.wait()
        commit = [d["commit_s"] for k, s, d in events if k == "checkpoint_saved" and s >= 2]

        restore = timed_restores(ck, abstract, state, args.repeats)
        ck.close()
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    med = statistics.median
    res = {
        "state_mb": nbytes / 1e6, "devices": args.devices, "repeats": args.repeats,
        "sync_blocked_s": med(sync_blocked), "async_blocked_s": med(async_blocked),
        "first_async_blocked_s": first_blocked, "async_commit_s": med(commit),
        "blocked_ratio": med(async_blocked) / med(sync_blocked),
        "step_s": statistics.mean(baseline), "step_inflight_s": statistics.mean(inflight) if inflight else float("nan"),
        "steps_inflight": len(inflight), "restore_s": med(restore),
    }
    res["step_slowdown"] = res["step_inflight_s"] / res["step_s"]
    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    table = f"""Measured {date} on {machine()}; {res['state_mb']:.0f} MB state (float32, FSDP over \
{res['devices']} CPU device(s)), median of {res['repeats']} saves, `python bench/bench_checkpoint.py`.

| measure | value |
|---|---|
| training blocked by a synchronous save (`async_save=false`) | {res['sync_blocked_s']:.3f} s |
| training blocked by an async save | {res['async_blocked_s']:.3f} s |
| **async blocked / sync blocked** (target <= 10%) | **{100 * res['blocked_ratio']:.1f}%** |
| first save of a fresh async Checkpointer | {res['first_async_blocked_s']:.3f} s |
| async save, call to commit marker (background) | {res['async_commit_s']:.3f} s |
| matmul-loop step, no write in flight | {1000 * res['step_s']:.1f} ms |
| same step while a write is in flight ({res['steps_inflight']} steps) | {1000 * res['step_inflight_s']:.1f} ms \
(x{res['step_slowdown']:.2f}) |
| restore into the same shardings (verify + read) | {res['restore_s']:.3f} s |
"""
    print(table)
    if args.write_docs:
        begin, end = "<!-- bench-results:begin -->", "<!-- bench-results:end -->"
        text = open(args.write_docs).read()
        if begin not in text or end not in text:
            print(f"{args.write_docs} has no {begin} ... {end} section", file=sys.stderr)
            return 2
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + table + end + rest.split(end, 1)[1]
        with open(args.write_docs, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
