#!/usr/bin/env python3
"""gpu-1b benchmark (DESIGN §7): the configs/llama3-1b.yaml model on one GPU, bf16, sequence 4096.

For each attention implementation (cudnn, triton, xla; in that order, while the time budget
lasts) it trains a few steps with `jaxtrain.Trainer`, profiles two of them
(train.profile_steps) and reports tokens/s, MFU (against the device table's dense bf16 peak:
989 TFLOP/s on an H200) and the profile split (matmul, attention, elementwise, collectives, host
wait, idle; `jaxtrain profile-summary`). Results go to OUT/gpu_1b.json and OUT/gpu_1b.md, rewritten
after every implementation, so a run cut short still leaves what it measured; each run directory
(OUT/gpu_1b_<implementation>/) keeps metrics.jsonl, events.jsonl and the profile.

    python3 tpu_gpu_setup/gpu/bench_gpu_1b.py [--out DIR] [--budget-s 190] [--batch 8] [--steps 8]
    python3 tpu_gpu_setup/gpu/bench_gpu_1b.py --cpu [--out DIR]     # the same code on a shrunken model, CPU, xla
    python3 tpu_gpu_setup/gpu/bench_gpu_1b.py --dry-run              # print the plan (configs) and exit

--cpu shrinks the model (d_model 128, 2 layers, vocab 512, sequence 256, batch 2) and runs XLA
attention on the CPU: what the tests run to check this script without a GPU.
Exit status: 0 when at least one implementation ran, 1 when none did, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs/llama3-1b.yaml"
GPU_IMPLEMENTATIONS = ("cudnn", "triton", "xla")
# --cpu: the same code path on a model a CPU runs in seconds.
CPU_MODEL = ["model.d_model=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
             "model.head_dim=32", "model.mlp_dim=256", "model.vocab_size=512", "model.max_seq_len=256",
             "data.seq_len=256", "precision.policy=fp32"]


def overrides(implementation: str, out_dir: Path, batch: int, steps: int, cpu: bool) -> list[str]:
    """The llama3-1b config on one device, synthetic data, no checkpoints, two profiled steps."""
    profiled = [steps - 2, steps - 1]  # late enough to be past compilation and warm-up
    return [
        "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", f"model.attention={implementation}",
        "data.source=markov", f"data.global_batch_size={batch}", f"train.steps={steps}", "train.log_every=1",
        "train.eval_every=0", f"train.profile_steps=[{profiled[0]},{profiled[1]}]",
        "checkpoint.every_steps=0", "checkpoint.every_minutes=0", "checkpoint.save_at_end=false",
        f"run.output_dir={out_dir / f'gpu_1b_{implementation}'}", f"run.name=gpu-1b-{implementation}",
    ] + (CPU_MODEL if cpu else [])


def run_one(implementation: str, out_dir: Path, batch: int, steps: int, cpu: bool) -> dict:
    """Train `steps` steps with one attention implementation; tokens/s, MFU and the profile split."""
    from jaxtrain.config import load_config
    from jaxtrain.observe.profiling import summarize
    from jaxtrain.trainer import Trainer

    cfg = load_config(CONFIG, overrides(implementation, out_dir, batch, steps, cpu))
    t = time.perf_counter()
    trainer = Trainer(cfg, console=sys.stdout)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    wall = time.perf_counter() - t
    run_dir = Path(cfg.run.output_dir)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
                 if json.loads(x)["kind"] == "start")
    profiled = set(range(cfg.train.profile_steps[0], cfg.train.profile_steps[1] + 2))  # + the step the trace waits in
    steady = [r for r in records if r["step"] > 2 and r["step"] not in profiled] or records[-1:]
    step_time = statistics.median(r["step_time_s"] for r in steady)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    split = summarize(run_dir, top=8)
    return {
        "implementation": implementation, "status": "ok" if result["exit_code"] == 0 else f"exit {result['exit_code']}",
        "batch": cfg.data.global_batch_size, "seq_len": cfg.data.seq_len, "params": trainer.num_params,
        "step_time_s": step_time, "tokens_per_sec": tokens / step_time,
        "mfu": statistics.median(r["mfu"] for r in steady),
        "tflops_per_device": statistics.median(r["tflops_per_device"] for r in steady),
        "peak_flops_per_device": start["peak_flops_per_device"], "peak_source": start["peak_source"],
        "compile_s": start["compile_s"], "wall_s": wall, "final_loss": records[-1]["loss"],
        "profile": {"step_time_s": split["step_time_s"], "parts_s": split["parts_s"],
                    "compute_s": split["compute_s"], "collectives_s": split["collectives_s"],
                    "top_ops": [{k: o[k] for k in ("op", "category", "time_s", "share")} for o in split["top_ops"]]},
    }


def to_markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# gpu-1b on {meta['device']}", "",
             f"jax {meta['jax']}, Python {meta['python']}; {meta['when']}; configs/llama3-1b.yaml on one device, "
             f"{meta['policy']}, sequence {meta['seq_len']}, batch {meta['batch']}, remat {meta['remat']}; MFU against "
             f"{meta['peak']}.", "",
             "| attention | status | step s | tokens/s | TFLOP/s | MFU | matmul | attention | elementwise | collectives "
             "| host wait | idle | compile s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['implementation']} | {r['status']} |" + " |" * 11)
            continue
        p, step = r["profile"]["parts_s"], r["profile"]["step_time_s"]
        share = lambda *keys: f"{100 * sum(p[k] for k in keys) / step:.0f}%"
        lines.append(f"| {r['implementation']} | ok | {r['step_time_s']:.3f} | {r['tokens_per_sec']:,.0f} "
                     f"| {r['tflops_per_device']:.0f} | {r['mfu']:.1%} | {share('matmul')} | {share('attention')} "
                     f"| {share('elementwise')} | {100 * r['profile']['collectives_s'] / step:.0f}% | {share('host_wait')} "
                     f"| {share('idle')} | {r['compile_s']:.0f} |")
    lines += ["", "Profile shares are of the profiled step's time (`jaxtrain profile-summary` on the run directory)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_results",
                        help="results directory (default $OUT, else gpu_results/)")
    parser.add_argument("--budget-s", type=float, default=190.0, help="start no new implementation after this")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (x 4096 tokens)")
    parser.add_argument("--steps", type=int, default=8, help="steps per implementation (the last two but one are profiled)")
    parser.add_argument("--implementations", default=",".join(GPU_IMPLEMENTATIONS))
    parser.add_argument("--cpu", action="store_true", help="shrunken model on the CPU with xla attention (tests)")
    parser.add_argument("--dry-run", action="store_true", help="print the configs that would run and exit")
    args = parser.parse_args(argv)
    implementations = ["xla"] if args.cpu else [x for x in args.implementations.split(",") if x]
    bad = [x for x in implementations if x not in GPU_IMPLEMENTATIONS]
    if bad or args.steps < 5:
        print(f"bench_gpu_1b: unknown implementation(s) {bad}" if bad else "bench_gpu_1b: --steps must be >= 5",
              file=sys.stderr)
        return 2
    batch = 2 if args.cpu and args.batch == 8 else args.batch
    out_dir = Path(args.out)
    if args.cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.dry_run:
        from jaxtrain.config import load_config
        for impl in implementations:
            cfg = load_config(CONFIG, overrides(impl, out_dir, batch, args.steps, args.cpu))
            m = cfg.model
            print(json.dumps({"implementation": impl, "d_model": m.d_model, "layers": m.num_layers, "vocab": m.vocab_size,
                              "seq_len": cfg.data.seq_len, "batch": cfg.data.global_batch_size,
                              "policy": cfg.precision.policy, "remat": m.remat, "steps": cfg.train.steps,
                              "profile_steps": cfg.train.profile_steps, "output_dir": cfg.run.output_dir}))
        return 0

    import jax
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.cpu:
        print(f"no GPU: jax sees {jax.devices()}; use --cpu to run the shrunken model on the CPU", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    from jaxtrain.config import load_config
    from jaxtrain.observe.throughput import peak_flops_per_device
    cfg = load_config(CONFIG, overrides(implementations[0], out_dir, batch, args.steps, args.cpu))
    peak, source = peak_flops_per_device(device, cfg.precision.policy)
    meta = {"device": device.device_kind, "jax": jax.__version__, "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), "seq_len": cfg.data.seq_len, "batch": batch,
            "policy": cfg.precision.policy, "remat": cfg.model.remat, "peak": f"{peak / 1e12:.3g} TFLOP/s ({source})"}
    print(json.dumps(meta), flush=True)
    deadline = time.monotonic() + args.budget_s
    rows: list[dict] = []

    def write() -> None:
        (out_dir / "gpu_1b.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
        (out_dir / "gpu_1b.md").write_text(to_markdown(meta, rows))

    for impl in implementations:
        if time.monotonic() > deadline:
            rows.append({"implementation": impl, "status": "skipped (time budget)"})
        else:
            try:
                rows.append(run_one(impl, out_dir, batch, args.steps, args.cpu))
            except Exception as exc:  # noqa: BLE001 - one implementation failing must not lose the others
                first = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:200]
                rows.append({"implementation": impl, "status": f"error ({first})"})
                traceback.print_exc(limit=4)
            gc.collect()  # the Trainer's reference cycles hold its device buffers until collected
        r = rows[-1]
        if r["status"] == "ok":
            print(f"[gpu-1b] {impl:6s} {r['step_time_s']:.3f} s/step  {r['tokens_per_sec']:,.0f} tokens/s  "
                  f"MFU {r['mfu']:.1%}  compile {r['compile_s']:.0f} s", flush=True)
        else:
            print(f"[gpu-1b] {impl:6s} {r['status']}", flush=True)
        write()
    print(to_markdown(meta, rows))
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
