"""Pipeline benchmark: step time of stage=4 x data=2 against the theoretical bubble, on 8 simulated CPU devices.

    python bench/bench_pipeline.py [--steps 6] [--microbatches 4 8 16] [--repeats 1 2]

For every (M, R) it builds the train step of a small Llama (configs below) with mesh.stage=4,
mesh.data=2, pipeline.microbatches=M, pipeline.repeats=R, and reports one JSON line:
  - bubble: the theoretical idle fraction (S-1)/(R*M+S-1) (`pipeline.describe`);
  - step_time_s: median over --steps steps after compilation;
  - bubble_free_step_s: step_time * (1 - bubble). The batch is fixed, so every configuration does
    the same useful work, in R*M iterations of 1/(R*M) of it each, plus S - 1 iterations of
    bubble. Simulated devices share the host's cores, so the bubble is not idle time here but
    the discarded work that idle stages compute (docs/pipeline.md); either way step time should
    scale as (R*M + S - 1) / (R*M) = 1 / (1 - bubble), and this column stays flat across rows
    when the schedule costs what the theory says (per-iteration overheads make it grow with R*M);
  - bytes per step per device of each collective kind, from the compiled HLO
    (`inspection.collective_bytes`): collective-permute is the stage shift, all-to-all includes
    the circular schedule's per-step weight permutation;
  - temp_bytes: XLA's temporary memory per device (activations kept for the backward pass).
A first line gives the same numbers for data=8 without a pipeline, as a reference. Numbers vary
with machine load: quote ratios from one run (DESIGN §7).
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

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.observe.inspection import collective_bytes  # noqa: E402
from jaxtrain.parallel import pipeline  # noqa: E402
from jaxtrain.trainer import Trainer  # noqa: E402

MODEL = ["model.vocab_size=256", "model.d_model=128", "model.num_layers=8", "model.num_heads=4",
         "model.num_kv_heads=4", "model.head_dim=32", "model.mlp_dim=512", "model.attention=xla",
         "data.seq_len=64", "data.global_batch_size=32", "optim.warmup_steps=0",
         "checkpoint.compilation_cache_dir=null", "train.steps=1000"]


def measure(overrides: list[str], steps: int) -> dict:
    cfg = load_config(None, MODEL + overrides)
    trainer = Trainer(cfg, write_files=False)
    t = time.perf_counter()
    compiled = trainer.layout.lower_train_step().compile()
    compile_s = time.perf_counter() - t
    traffic = collective_bytes(compiled.as_text())
    memory = compiled.memory_analysis()
    trainer.step()  # the trainer's own compile and a first step
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        trainer.step()  # synchronous: reads the metrics, so the time covers the device work
        times.append(time.perf_counter() - t)
    info = pipeline.describe(cfg, trainer.mesh_sizes)
    step = statistics.median(times)
    return {
        "mesh": {k: v for k, v in trainer.mesh_sizes.items() if v > 1}, **info,
        "step_time_s": round(step, 4),
        "bubble_free_step_s": round(step * (1 - info["bubble"]), 4),
        "collective_bytes": {k: int(v["bytes"]) for k, v in traffic.items()},
        "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
        "compile_s": round(compile_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    common = {"bench": "pipeline", "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()} {os.cpu_count()} cores", "jax": jax.__version__}
    print(json.dumps({**common, **measure(["mesh.data=8"], args.steps)}), flush=True)
    for repeats in args.repeats:
        for microbatches in args.microbatches:
            result = measure(["mesh.data=2", "mesh.stage=4", f"pipeline.microbatches={microbatches}",
                              f"pipeline.repeats={repeats}"], args.steps)
            print(json.dumps({**common, "load_avg_1m": round(os.getloadavg()[0], 2), **result}), flush=True)


if __name__ == "__main__":
    main()
