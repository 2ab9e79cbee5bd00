"""MoE routing and dispatch overhead: configs/moe-tiny.yaml against the dense model with the same
active parameters (mlp_dim = experts_per_token x moe_mlp_dim, + shared), on the CPU.

  python bench/bench_moe.py [--steps 30] [--rounds 3] [--cpu-devices 1] [override ...]

Both variants are built once in this process and timed in alternating rounds (each round: every
variant runs `--steps` steps after its compile and 3 warm-up steps), timed by the wall clock
around the round's `Trainer.step` calls (each waits for its step); the median round counts. Prints tokens/s, MFU of active FLOPs (flops_per_step counts active
parameters; the peak is a measured matmul) and the MoE step time over the dense one. The issue's
target: overhead <= 40% of the dense step. MaxText side by side: bench/vs_maxtext.py --model moe-tiny.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-devices", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxtrain.xla_cpu import cpu_xla_flags  # no JAX import: the flags `jaxtrain train` runs with
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *cpu_xla_flags(),
                                        f"--xla_force_host_platform_device_count={args.cpu_devices}"]).strip()
    import jax

    from jaxtrain.config import load_config
    from jaxtrain.observe.throughput import flops_per_step, measure_matmul_peak
    from jaxtrain.trainer import Trainer

    common = ["checkpoint.compilation_cache_dir=null", "checkpoint.save_at_end=false", "train.steps=100000",
              "train.log_every=100000", *args.overrides]
    out = tempfile.mkdtemp(prefix="bench_moe-")  # write_files=False: nothing lands here
    moe_cfg = load_config("configs/moe-tiny.yaml", [f"run.output_dir={out}/moe", *common])
    m = moe_cfg.model
    active = m.experts_per_token * (m.moe_mlp_dim or m.mlp_dim) + m.num_shared_experts * (m.moe_mlp_dim or m.mlp_dim)
    dense_cfg = load_config("configs/moe-tiny.yaml", [f"run.output_dir={out}/dense", *common,
                                                      "model.num_experts=0", f"model.mlp_dim={active}"])
    devices = jax.devices()[:args.cpu_devices]
    variants = {"moe": Trainer(moe_cfg, write_files=False, devices=devices),
                "dense (same active)": Trainer(dense_cfg, write_files=False, devices=devices)}
    for t in variants.values():
        for _ in range(3):
            t.step()
    peak = measure_matmul_peak()
    own = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, t in variants.items():
            wall = time.perf_counter()
            for _ in range(args.steps):
                t.step()
            elapsed = time.perf_counter() - wall
            own[name].append(elapsed / args.steps)
    d = moe_cfg.data
    tokens = d.global_batch_size * d.seq_len
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, jax {jax.__version__}, {args.cpu_devices} device(s)")
    print("| variant | step s (median of rounds) | tokens/s | MFU (active FLOPs) |")
    print("|---|---:|---:|---:|")
    cfgs = {"moe": moe_cfg, "dense (same active)": dense_cfg}
    med = {}
    for name in variants:
        s = sorted(own[name])[len(own[name]) // 2]
        med[name] = s
        mfu = flops_per_step(cfgs[name]) / s / (peak * args.cpu_devices)
        print(f"| {name} | {s:.4f} | {tokens / s:,.0f} | {100 * mfu:.1f}% |")
    print(f"MoE step / dense step: {med['moe'] / med['dense (same active)']:.2f} "
          f"(routing + dispatch overhead {100 * (med['moe'] / med['dense (same active)'] - 1):.0f}%; target <= 40%)")
    for t in variants.values():
        t.close()


if __name__ == "__main__":
    main()
