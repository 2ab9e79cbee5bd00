"""cpu-tiny benchmark (DESIGN §7): tokens/s and MFU of the train step on one CPU device.

    python bench/bench_cpu_tiny.py [--steps 20] [--repeats 3]

Measures, in one process and interleaved so machine noise hits both alike:
  - the matmul peak: a plain jitted fp32 1024x1024 matmul (best of N), the honest CPU "peak";
  - the cpu-tiny train step (configs/bench/cpu-tiny.yaml): median step time over `--steps` steps
    after compilation, tokens/s, model TFLOP/s and MFU = model FLOP/s / matmul peak.
Prints one JSON line with everything; README.md records the result with date and machine.
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
from jaxtrain.throughput import flops_per_step, measure_matmul_peak  # noqa: E402
from jaxtrain.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = load_config(REPO / "configs/bench/cpu-tiny.yaml", ["checkpoint.compilation_cache_dir=null"])
    trainer = Trainer(cfg, write_files=False)
    trainer.step()  # compile + first step
    peaks, step_times = [], []
    for _ in range(args.repeats):
        peaks.append(measure_matmul_peak())
        for _ in range(args.steps // args.repeats):
            t = time.perf_counter()
            trainer.step()  # synchronous: reads the metrics, so the time covers the device work
            step_times.append(time.perf_counter() - t)
    peak = max(peaks)
    step = statistics.median(step_times)
    flops = flops_per_step(cfg)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    print(json.dumps({
        "bench": "cpu-tiny", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__, "params": trainer.num_params, "tokens_per_step": tokens,
        "step_time_s": round(step, 4), "tokens_per_sec": round(tokens / step, 1),
        "model_tflops_per_sec": round(flops / step / 1e12, 4), "matmul_peak_tflops": round(peak / 1e12, 4),
        "mfu_vs_matmul_peak": round(flops / step / peak, 4), "compile_s": round(trainer.compile_s, 2),
    }))


if __name__ == "__main__":
    main()
