"""What the numerics guard costs on cpu-tiny: bf16 with the guard vs without, fp16 (scaling) vs bf16.

    python bench/bench_stability.py [--steps 12] [--rounds 3]

One process, one CPU device, three trainers on configs/bench/cpu-tiny.yaml built up front:
  bf16          precision.policy=bf16 (guard on: the default)
  bf16-noguard  precision.policy=bf16 stability.guard=false (no skip selection, no spike statistics)
  fp16          precision.policy=fp16 (guard on, dynamic loss scaling)
  fp16-noguard  the same without the guard (the scale still multiplies the loss; it no longer adapts)
On a CPU, fp16 and bf16 arithmetic are both emulated (converted to fp32 around each op), and
fp16's conversions cost more: fp16 vs bf16 there measures the dtype, the guard rows the guard.
Rounds alternate A B C A B C ..., so machine noise hits all alike. Per variant two figures:
  own timer   median of per-step wall times (each step synchronised, as `Trainer.step()` does);
  wall clock  (T(3N steps) - T(N steps)) / 2N of the asynchronous loop (dispatch without reading
              metrics, one block at the end): what `fit()` pays per step, start-up excluded.
Prints one JSON line per variant and the overheads; run it on a quiet machine (load ~1).
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

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.trainer import Trainer  # noqa: E402

VARIANTS = {
    "bf16": ["precision.policy=bf16"],
    "bf16-noguard": ["precision.policy=bf16", "stability.guard=false"],
    "fp16": ["precision.policy=fp16"],
    "fp16-noguard": ["precision.policy=fp16", "stability.guard=false"],
}


def async_steps(trainer: Trainer, n: int) -> float:
    """Wall seconds for n steps dispatched back to back (no metric reads), then one block."""
    t = time.perf_counter()
    for _ in range(n):
        trainer._dispatch()
    jax.block_until_ready(trainer.state)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="N: steps per timed block")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trainers = {}
    for name, overrides in VARIANTS.items():
        cfg = load_config(REPO / "configs/bench/cpu-tiny.yaml",
                          ["checkpoint.compilation_cache_dir=null", "train.steps=100000", *overrides])
        trainers[name] = Trainer(cfg, write_files=False)
        trainers[name].step()  # compile + first step
    own = {n: [] for n in VARIANTS}
    wall = {n: [] for n in VARIANTS}
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                trainer.step()
                own[name].append(time.perf_counter() - t)
            short, long = async_steps(trainer, args.steps), async_steps(trainer, 3 * args.steps)
            wall[name].append((long - short) / (2 * args.steps))
    load = os.getloadavg()[0]
    result = {n: {"own_step_s": round(statistics.median(own[n]), 4), "wall_step_s": round(statistics.median(wall[n]), 4)}
              for n in VARIANTS}
    for name, r in result.items():
        print(json.dumps({"bench": "stability", "variant": name, **r}))
    base = result["bf16-noguard"]
    print(json.dumps({
        "bench": "stability", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__, "load_avg_1m": round(load, 2),
        "guard_overhead_own": round(result["bf16"]["own_step_s"] / base["own_step_s"] - 1, 4),
        "guard_overhead_wall": round(result["bf16"]["wall_step_s"] / base["wall_step_s"] - 1, 4),
        "fp16_vs_bf16_own": round(result["fp16"]["own_step_s"] / result["bf16"]["own_step_s"] - 1, 4),
        "fp16_vs_bf16_wall": round(result["fp16"]["wall_step_s"] / result["bf16"]["wall_step_s"] - 1, 4),
        "fp16_guard_overhead_own": round(result["fp16"]["own_step_s"] / result["fp16-noguard"]["own_step_s"] - 1, 4),
        "fp16_guard_overhead_wall": round(result["fp16"]["wall_step_s"] / result["fp16-noguard"]["wall_step_s"] - 1, 4),
    }))


if __name__ == "__main__":
    main()
