"""Context-parallel benchmark: peak memory per device of one sequence split over C devices.

    python bench/bench_context.py [--seq 8192] [--contexts 1 2 4 8] [--schedules ring allgather]
                                  [--time-seq 0] [--steps 3]

For every context size C and schedule it compiles the train step of a narrow Llama (widths below)
on the first C of 8 simulated CPU devices, `mesh.context=C`, one sequence of `--seq` tokens per step,
and prints one JSON line from `jaxtrain inspect`'s report: peak memory per device, the temporaries
(activations, attention blocks and their gradients: the part that should fall ~1/C), and the
ring's collective-permute bytes beside their theory. Compile only: nothing runs unless
`--time-seq N` (N > 0), which also times `--steps` steps at sequence length N (median, after
compilation). Numbers vary with the machine's load; quote ratios from one run (DESIGN §7).
"""

from __future__ import annotations

import argparse
import datetime
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
from jaxtrain.observe.inspection import inspect_report  # noqa: E402

MODEL = ["model.vocab_size=256", "model.d_model=64", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=128", "model.attention=xla",
         "data.global_batch_size=1", "optim.warmup_steps=0", "checkpoint.compilation_cache_dir=null",
         "mesh.data=1"]
MIB = 2 ** 20


def overrides(seq: int, context: int, schedule: str) -> list[str]:
    return MODEL + [f"data.seq_len={seq}", f"model.max_seq_len={max(seq, 2048)}", f"mesh.context={context}",
                    f"context.attention={schedule}"]


def measure(seq: int, context: int, schedule: str) -> dict:
    cfg = load_config(None, overrides(seq, context, schedule))
    report = inspect_report(cfg, jax.devices()[:context])
    ctx = report.get("context") or {}
    return {"seq": seq, "context": context, "schedule": schedule if context > 1 else "none",
            "peak_mib_per_device": round(report["peak_memory_bytes_per_device"] / MIB, 1),
            "temporaries_mib_per_device": round(report["activation_bytes_per_device"] / MIB, 1),
            "ring_permute_bytes": ctx.get("ring_permute_bytes"),
            "ring_permute_bytes_theory": ctx.get("ring_permute_bytes_theory"),
            "compile_s": report["compile_s"]}


def step_time(seq: int, context: int, schedule: str, steps: int) -> float:
    from jaxtrain.trainer import Trainer
    cfg = load_config(None, overrides(seq, context, schedule) + [f"train.steps={steps + 1}"])
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:context])
    trainer.step()  # compile
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(trainer.step()["loss"])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["ring", "allgather"])
    parser.add_argument("--time-seq", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "python": platform.python_version(), "jax": jax.__version__}), flush=True)
    for context in args.contexts:
        for schedule in (args.schedules if context > 1 else ["ring"]):
            row = measure(args.seq, context, schedule)
            if args.time_seq:
                row["time_seq"] = args.time_seq
                row["step_time_s"] = round(step_time(args.time_seq, context, schedule, args.steps), 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
