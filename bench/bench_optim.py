"""Optimizer benchmark: the train step's time under each optim.name on cpu-tiny, side by side.

    python bench/bench_optim.py [--rounds 3] [--steps 5] [--no-flags] [overrides ...]

One process, one CPU device, configs/bench/cpu-tiny.yaml (docs/bench_cpu_tiny.md). Every optimizer
make_optimizer builds gets a Trainer, compiled first; then `--rounds` rounds each time `--steps`
steps of every optimizer in turn, the order rotated per round (alternating sides, so drift in
machine load hits each alike). Two timers per optimizer: the program's own (median of per-step
`perf_counter` around `trainer.step()`, which reads the metrics so the device work is inside) and
the outside wall clock of all its timed steps together. Muon's overhead over AdamW is reported as
(muon - adamw) / adamw of the median step (target <= 10%). An optimizer not built (ConfigError) is
skipped with a note. Prints one JSON line (last line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxtrain.runtime.xla_cpu import cpu_xla_flags, with_flags  # noqa: E402  (no JAX import)

OPTIMIZERS = ("adamw", "muon", "adafactor", "lion", "sgd", "schedule_free")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per optimizer per round")
    ap.add_argument("--no-flags", action="store_true", help="without the recommended XLA CPU flags")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    flags = [] if args.no_flags else cpu_xla_flags()
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""),
                                         flags + ["--xla_force_host_platform_device_count=1"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from jaxtrain.config import ConfigError, load_config
    from jaxtrain.trainer import Trainer

    wall_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    trainers, notes, compile_s = {}, {}, {}
    for name in OPTIMIZERS:
        try:
            cfg = load_config(REPO / "configs/bench/cpu-tiny.yaml",
                              ["checkpoint.compilation_cache_dir=null", f"optim.name={name}", *args.overrides])
            t = time.perf_counter()
            trainer = Trainer(cfg, write_files=False)
            trainer.step()  # compile + first step
            compile_s[name] = round(time.perf_counter() - t, 2)
            trainers[name] = trainer
        except ConfigError as e:  # not built (yet)
            notes[name] = f"skipped: {e}"
    step_times: dict[str, list[float]] = {n: [] for n in trainers}
    wall: dict[str, float] = {n: 0.0 for n in trainers}
    names = list(trainers)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated order per round
            trainer = trainers[name]
            w = time.perf_counter()
            for _ in range(args.steps):
                t = time.perf_counter()
                trainer.step()
                step_times[name].append(time.perf_counter() - t)
            wall[name] += time.perf_counter() - w
    results = {n: {"median_step_s": round(statistics.median(step_times[n]), 4),
                   "best_step_s": round(min(step_times[n]), 4),
                   "wall_per_step_s": round(wall[n] / len(step_times[n]), 4),
                   "compile_and_first_step_s": compile_s[n]} for n in names}
    out = {"bench": "optim", "config": "configs/bench/cpu-tiny.yaml", "rounds": args.rounds, "steps": args.steps,
           "xla_flags": flags, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2),
           "results": results, "notes": notes, "total_wall_s": round(time.perf_counter() - wall_start, 1)}
    if "muon" in results and "adamw" in results:
        a, m = results["adamw"]["median_step_s"], results["muon"]["median_step_s"]
        out["muon_overhead_vs_adamw"] = round((m - a) / a, 4)
    for n, r in results.items():
        print(f"{n:14s} step {r['median_step_s'] * 1e3:8.1f} ms (median)  wall/step {r['wall_per_step_s'] * 1e3:8.1f} ms")
    for n, note in notes.items():
        print(f"{n:14s} {note}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
