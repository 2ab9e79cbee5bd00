"""Checkpoint benchmark across storage: local disk vs a GCS emulator vs an S3 server, one run.

    python bench/bench_object_storage.py                    # ~200 MB state, 1 CPU device, 2 saves each
    python bench/bench_object_storage.py --write-docs docs/checkpoint.md

Starts gcp-storage-emulator and moto_server on free ports (the `dev` extra; see
tests/storage_servers.py), then, for each of local / gs:// / s3://, on the same state:
  - blocked:  seconds `Checkpointer.save()` holds training (asynchronous save);
  - commit:   seconds from save() to the commit marker (the background write, listing, marker);
  - restore:  seconds to verify the checkpoint and read it back into the same shardings.
Medians over `--repeats` saves after one warm-up save. The servers are single-process Python
(Flask / http.server) on the same 2 cores as the writer, so the remote columns measure the
client path and a slow local server, not a cloud; quote the ratios, measured side by side.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=200.0, help="state size in MB (10^6 bytes)")
    p.add_argument("--repeats", type=int, default=2, help="measured saves per backend (after one warm-up)")
    p.add_argument("--backends", default="local,gs,s3", help="comma-separated subset of local,gs,s3")
    p.add_argument("--write-docs", default=None, help="replace the object-storage results section of this file")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # before JAX starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bench_checkpoint import machine, timed_restores
    from jaxtrain.checkpoint.checkpointer import Checkpointer
    from jaxtrain.config import MESH_AXES, CheckpointConfig
    from storage_servers import storage_servers

    mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES)
    rows, cols = 1024, 6144  # 25.2 MB per float32 array, as bench_checkpoint.py
    n_arrays = max(1, round(args.mb * 1e6 / (rows * cols * 4) + 0.499))
    sharded, replicated = NamedSharding(mesh, P("fsdp", None)), NamedSharding(mesh, P())
    make = jax.jit(lambda k: jax.random.normal(k, (rows, cols), jnp.float32), out_shardings=sharded)
    state = {"step": jax.device_put(jnp.int32(0), replicated),
             "params": {f"w{i}": make(jax.random.key(i)) for i in range(n_arrays)}}
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

    def measure(directory: str) -> dict:
        events: list = []
        ck = Checkpointer(directory, CheckpointConfig(keep_last=1),
                          on_event=lambda kind, s, **d: events.append((kind, s, d)))
        ck.save(0, state, {})  # warm-up: client start-up, the finite check compiles
        ck.wait()
        blocked = []
        for s in range(1, 1 + args.repeats):
            t = time.perf_counter()
            ck.save(s, state, {"step": s})
            blocked.append(time.perf_counter() - t)
            ck.wait()
        ck.should_save(0)  # delivers the last checkpoint_saved event
        commit = [d["commit_s"] for k, s, d in events if k == "checkpoint_saved" and s >= 1]
        restore = timed_restores(ck, abstract, state, args.repeats)
        ck.close()
        med = statistics.median
        return {"blocked_s": med(blocked), "commit_s": med(commit), "restore_s": med(restore)}

    backends = args.backends.split(",")
    results = {}
    scratch = tempfile.mkdtemp(prefix="jaxtrain_bench_os_")
    try:
        with storage_servers(os.path.join(scratch, "servers"), ["bench"]):
            urls = {"local": os.path.join(scratch, "local", "checkpoints"), "gs": "gs://bench/run/checkpoints",
                    "s3": "s3://bench/run/checkpoints"}
            for name in backends:
                results[name] = measure(urls[name])
                print(name, {k: round(v, 3) for k, v in results[name].items()}, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    date = subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"
    labels = {"local": "local disk", "gs": "gs:// (gcp-storage-emulator)", "s3": "s3:// (moto_server)"}
    base = results.get("local")
    lines = [f"Measured {date} on {machine()}, load average {load} (is anything else running? say so); "
             f"{nbytes / 1e6:.0f} MB state (float32, 1 CPU device), median of {args.repeats} async saves "
             f"after a warm-up, `python bench/bench_object_storage.py`.", "",
             "| storage | training blocked by an async save | save to commit marker (background) | restore |",
             "|---|---|---|---|"]
    for name in backends:
        r = results[name]
        rel = lambda k: f" (x{r[k] / base[k]:.1f})" if base and name != "local" else ""  # noqa: E731
        lines.append(f"| {labels[name]} | {r['blocked_s']:.3f} s{rel('blocked_s')} | {r['commit_s']:.2f} s"
                     f"{rel('commit_s')} | {r['restore_s']:.2f} s{rel('restore_s')} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write_docs:
        begin, end = "<!-- bench-object-storage:begin -->", "<!-- bench-object-storage:end -->"
        text = open(args.write_docs).read()
        if begin not in text or end not in text:
            print(f"{args.write_docs} has no {begin} ... {end} section", file=sys.stderr)
            return 2
        head, rest = text.split(begin, 1)
        with open(args.write_docs, "w") as f:
            f.write(head + begin + "\n" + table + end + rest.split(end, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
