"""MoE routing and dispatch overhead: configs/moe-tiny.yaml against the dense model with the same
active parameters (mlp_dim = experts_per_token x moe_mlp_dim, + shared), on the CPU.

  python bench/bench_moe.py [--steps 30] [--rounds 3] [--cpu-devices 1] [--outside 50,1050] [override ...]

Each variant runs in its own process, set up as `jaxtrain train` sets up the CPU: the XLA flags of
jaxtrain/runtime/xla_cpu.py (the same for both) and glibc malloc keeping freed memory
(jaxtrain/runtime/host_malloc.py; without it the MoE step's time depends on how many of its buffers glibc
returns to the kernel at each step).

- own timer: both workers are built and compiled once, then timed in alternating rounds (each
  round: the worker runs `--steps` steps, timed by its wall clock around its `Trainer.step` calls,
  each of which waits for its step; the other worker waits meanwhile); the median round counts.
- outside wall clock (`--outside SHORT,LONG`): `jaxtrain train` runs of SHORT and LONG steps per
  variant, alternated, `--rounds` times, after untimed runs of both lengths that fill the variant's
  compilation cache; (T(LONG) - T(SHORT)) / (LONG - SHORT) from the median T, T = the subprocess's
  wall time (cancels start-up and the cached compile, counts everything else). On the 2-core bench
  machine one process's steady step time differs from another's by up to 15-30%, more for the MoE:
  the raw T are printed.

Prints tokens/s, MFU of active FLOPs (flops_per_step counts active parameters; the peak is a
measured matmul) and the MoE step time over the dense one. The issue's target: overhead <= 40% of
the dense step. MaxText side by side: bench/vs_maxtext.py --model moe-tiny.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # jaxtrain from this checkout; its config and xla_cpu modules import no JAX
CONFIG = "configs/moe-tiny.yaml"
COMMON = ["checkpoint.compilation_cache_dir=null", "checkpoint.save_at_end=false", "train.log_every=100000"]


def variant_overrides(name: str, overrides: list[str]) -> list[str]:
    """The config overrides of variant `name` ('moe' or 'dense': the same active MLP width)."""
    if name == "moe":
        return list(overrides)
    from jaxtrain.config import load_config
    m = load_config(str(REPO / CONFIG), list(overrides)).model
    width = (m.experts_per_token + m.num_shared_experts) * (m.moe_mlp_dim or m.mlp_dim)
    return [*overrides, "model.num_experts=0", f"model.mlp_dim={width}"]


def worker(name: str, steps: int, cpu_devices: int, overrides: list[str]) -> None:
    """One variant's process: compile, warm up, then run `steps` steps per 'run' line on stdin and
    print each round's seconds per step; 'info' prints flops_per_step, tokens and the matmul peak."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxtrain.config import load_config
    from jaxtrain.runtime.xla_cpu import cpu_xla_flags, with_flags  # no JAX import yet
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), cpu_xla_flags()
                                         + [f"--xla_force_host_platform_device_count={cpu_devices}"])
    from jaxtrain.runtime.host_malloc import retain_freed_memory
    retain_freed_memory()
    import jax

    from jaxtrain.observe.throughput import flops_per_step, measure_matmul_peak
    from jaxtrain.trainer import Trainer
    out = tempfile.mkdtemp(prefix=f"bench_moe-{name}-")  # write_files=False: nothing lands here
    cfg = load_config(str(REPO / CONFIG), [f"run.output_dir={out}", *COMMON, "train.steps=100000",
                                           *variant_overrides(name, overrides)])
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:cpu_devices])
    for _ in range(3):
        trainer.step()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "info":
            print(json.dumps({"flops_per_step": flops_per_step(cfg), "peak": measure_matmul_peak(),
                              "tokens": cfg.data.global_batch_size * cfg.data.seq_len,
                              "jax": jax.__version__, "flags": os.environ["XLA_FLAGS"]}), flush=True)
        else:
            wall = time.perf_counter()
            for _ in range(steps):
                trainer.step()
            print((time.perf_counter() - wall) / steps, flush=True)
    trainer.close()


def own_timer(args) -> tuple[dict, dict]:
    """(seconds per step of each round, info) per variant, from worker processes in alternation."""
    procs = {name: subprocess.Popen([sys.executable, __file__, "--worker", name, "--steps", str(args.steps),
                                     "--cpu-devices", str(args.cpu_devices), *args.overrides],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
             for name in ("moe", "dense")}

    def ask(name: str, line: str) -> str:
        p = procs[name]
        p.stdin.write(line + "\n")
        p.stdin.flush()
        return p.stdout.readline().strip()

    for name, p in procs.items():  # compiled one after the other: neither is timed while the other compiles
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {name} worker failed (its error is above)")
    info = {name: json.loads(ask(name, "info")) for name in procs}
    rounds = {name: [] for name in procs}
    for _ in range(args.rounds):
        for name in procs:
            rounds[name].append(float(ask(name, "run")))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    return rounds, info


def outside(args, short: int, long: int) -> dict:
    """Outside wall clock per step of each variant: `jaxtrain train` runs, alternated (module doc).
    Each variant compiles in untimed first runs of both lengths (the schedule's length is compiled
    in) into its own compilation cache, which the timed runs load: a compile's seconds of jitter
    would not cancel between the short and long run."""
    times = {name: {short: [], long: []} for name in ("moe", "dense")}
    out = tempfile.mkdtemp(prefix="bench_moe-outside-")

    def run(name: str, steps: int, tag: str) -> float:
        cmd = [sys.executable, "-c", "import sys; from jaxtrain.commands.cli import main; sys.exit(main())",
               "train", "--config", CONFIG, "--cpu-devices", str(args.cpu_devices),
               f"run.output_dir={out}/{name}-{tag}", f"train.steps={steps}", *COMMON,
               f"checkpoint.compilation_cache_dir={out}/cache-{name}", *variant_overrides(name, args.overrides)]
        t = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - t

    for name in times:  # train.steps is in the compiled step (the schedule's length): one compile per length
        for steps in (short, long):
            run(name, steps, f"warmup-{steps}")
    for r in range(args.rounds):
        for steps in (short, long):
            for name in times:
                times[name][steps].append(run(name, steps, f"{steps}-{r}"))
    for name, t in times.items():
        print(f"outside {name}: T({short}) {' '.join(f'{x:.2f}' for x in t[short])} s; "
              f"T({long}) {' '.join(f'{x:.2f}' for x in t[long])} s")
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {name: (med(t[long]) - med(t[short])) / (long - short) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-devices", type=int, default=1)
    ap.add_argument("--outside", default=None, help="SHORT,LONG: also time `jaxtrain train` runs of these steps")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.cpu_devices, args.overrides)
    rounds, info = own_timer(args)
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, jax {info['moe']['jax']}, "
          f"{args.cpu_devices} device(s), load {os.getloadavg()[0]:.2f}")
    for name in rounds:
        print(f"{name} rounds (s/step): {' '.join(f'{s:.4f}' for s in rounds[name])}; XLA_FLAGS {info[name]['flags']}")
    print("| variant | step s (median of rounds) | tokens/s | MFU (active FLOPs) |")
    print("|---|---:|---:|---:|")
    med = {}
    peak = max(i["peak"] for i in info.values())  # each worker measured it; the better reading of one core count
    for name, label in (("moe", "moe"), ("dense", "dense (same active)")):
        s = sorted(rounds[name])[len(rounds[name]) // 2]
        med[name] = s
        mfu = info[name]["flops_per_step"] / s / (peak * args.cpu_devices)
        print(f"| {label} | {s:.4f} | {info[name]['tokens'] / s:,.0f} | {100 * mfu:.1f}% |")
    ratio = med["moe"] / med["dense"]
    print(f"MoE step / dense step (own timers): {ratio:.2f} (routing + dispatch overhead {100 * (ratio - 1):.0f}%; "
          "target <= 40%)")
    if args.outside:
        short, long = (int(x) for x in args.outside.split(","))
        wall = outside(args, short, long)
        print(f"outside wall clock, (T({long}) - T({short})) / {long - short}: moe {wall['moe']:.4f} s, "
              f"dense {wall['dense']:.4f} s, ratio {wall['moe'] / wall['dense']:.2f}")


if __name__ == "__main__":
    main()
