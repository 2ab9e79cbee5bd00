"""cpu-tiny beside MaxText (DESIGN §6, §7): tokens/s and MFU of both, measured in one run.

    python bench/bench_maxtext_peer.py --maxtext-python /work/maxtext-venv/bin/python [--rounds 2]

MaxText is not a dependency of jaxtrain: it lives in its own Python 3.12 venv, made by
`bench/maxtext_peer_setup.sh` (pip install "maxtext[tpu]==0.2.5" from PyPI, ~2.8 GB). This script
runs, one process at a time and alternating (A B A B ...) so machine noise hits both alike:
  A. jaxtrain: `bench/bench_cpu_tiny.py --steps N` (its own JSON line: median step time and a
     plain fp32 matmul peak measured in the same process);
  B. MaxText 0.2.5: `python -m maxtext.trainers.pre_train.train <base.yml> <overrides>` on the same
     model (overrides below), a matmul peak measured first with the MaxText venv's jax, then
     skip+N steps, of which the first `--skip` (compile / async pipeline fill) are dropped.
Each side's step time is the median over steps within a round, then the median over rounds; the
best (least contended) step and the median process CPU seconds per step (all threads) are shown too,
as they move less than wall time when other jobs share the 2 cores.
Model FLOPs for BOTH sides come from `jaxtrain.metrics.flops_per_step` on configs/bench/cpu-tiny.yaml
(apples to apples); MFU = model FLOP/s / the best matmul peak measured anywhere in this run.
MaxText's own TFLOP/s/device (its own FLOP count) is shown beside it.

Variant `noremat` (default) is the like-for-like one: MaxText's scanned decoder always wraps the
layer in jax.checkpoint (remat_policy=none still means policy=None = full remat there), so
no-remat needs scan_layers=false. Variant `full` is MaxText's default (scan + full remat).
If MaxText cannot be run, the script says exactly why and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MAXTEXT_VERSION = "0.2.5"
CPU_TINY = REPO / "configs/bench/cpu-tiny.yaml"

# The cpu-tiny model (configs/bench/cpu-tiny.yaml) in MaxText's words.
MAXTEXT_MODEL = {
    "base_emb_dim": 256, "base_num_decoder_layers": 4, "base_num_query_heads": 4, "base_num_kv_heads": 4,
    "head_dim": 64, "base_mlp_dim": 1024, "vocab_size": 32000, "max_target_length": 256,
    "per_device_batch_size": 8, "dtype": "float32", "weight_dtype": "float32", "decoder_block": "llama2",
    "logits_via_embedding": "false", "attention": "dot_product",
}
MAXTEXT_RUN = {
    "hardware": "cpu", "skip_jax_distributed_system": "true", "dataset_type": "synthetic",
    "enable_checkpointing": "false", "enable_dropout": "false", "dropout_rate": 0.0,
    "enable_tensorboard": "false", "enable_goodput_recording": "false", "monitor_goodput": "false",
    "gradient_clipping_threshold": 1.0, "opt_type": "adamw", "adam_b1": 0.9, "adam_b2": 0.95,
    "adam_weight_decay": 0.1, "base_output_directory": "/tmp/maxtext_peer/out",
}
VARIANTS = {
    "noremat": {"scan_layers": "false", "remat_policy": "none"},
    "full": {"scan_layers": "true", "remat_policy": "full"},
}
STEP_RE = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), Tokens/s/device: ([\d.]+)")
TOTAL_TFLOPS_RE = re.compile(r"Total TFLOPs: ([\d.]+)")
PEAK_SNIPPET = (
    "import json, os, time, jax, jax.numpy as jnp\n"
    "n = 1024; a = jnp.ones((n, n), jnp.float32); f = jax.jit(lambda x: x @ x); f(a).block_until_ready()\n"
    "best = 1e9\n"
    "for _ in range(5):\n"
    "    t = time.perf_counter(); f(a).block_until_ready(); best = min(best, time.perf_counter() - t)\n"
    "print(json.dumps({'jax': jax.__version__, 'matmul_peak_tflops': 2 * n ** 3 / best / 1e12}))\n"
)


class PeerUnavailable(RuntimeError):
    """MaxText cannot be run here; the message says why."""


def cpu_env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.pop("PYTHONPATH", None)  # keep the two venvs apart
    return env


def maxtext_command(python: str, base_yml: str, steps: int, variant: str, run_name: str) -> list[str]:
    overrides = {**MAXTEXT_MODEL, **MAXTEXT_RUN, **VARIANTS[variant], "steps": steps, "run_name": run_name}
    return [python, "-m", "maxtext.trainers.pre_train.train", base_yml] + [f"{k}={v}" for k, v in overrides.items()]


def check_maxtext(python: str) -> dict:
    """Version, jax and base.yml of the MaxText install, or PeerUnavailable with the exact reason."""
    if not Path(python).exists():
        raise PeerUnavailable(f"--maxtext-python {python} does not exist; create it with bench/maxtext_peer_setup.sh "
                              f"(python3.12 -m venv ... && pip install \"maxtext[tpu]=={MAXTEXT_VERSION}\")")
    probe = ("import json, sys, importlib.metadata as md, pathlib, jax, maxtext\n"
             "print(json.dumps({'python': sys.version.split()[0], 'maxtext': md.version('maxtext'), 'jax': jax.__version__,"
             " 'base_yml': str(pathlib.Path(maxtext.__file__).parent / 'configs' / 'base.yml')}))")
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=cpu_env(), timeout=300)
    if r.returncode != 0:
        raise PeerUnavailable(f"`{python} -c 'import maxtext, jax'` failed (rc={r.returncode}): {r.stderr.strip()[-1500:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if not Path(info["base_yml"]).exists():
        raise PeerUnavailable(f"MaxText {info['maxtext']} has no configs/base.yml at {info['base_yml']}")
    if info["maxtext"] != MAXTEXT_VERSION:
        print(f"note: MaxText {info['maxtext']} installed, overrides were written for {MAXTEXT_VERSION}", file=sys.stderr)
    return info


# Runs bench/bench_cpu_tiny.py unchanged, with Trainer.step wrapped to also record each step's
# wall and process CPU seconds (all threads), so both sides get the same per-step statistics.
JAXTRAIN_WRAPPER = (
    "import json, runpy, sys, time\n"
    "sys.path.insert(0, sys.argv[1]); path = sys.argv[2]; sys.argv = sys.argv[2:]\n"
    "from jaxtrain.trainer import Trainer\n"
    "orig, per_step = Trainer.step, []\n"
    "def step(self, *a, **k):\n"
    "    w, c = time.perf_counter(), time.process_time()\n"
    "    out = orig(self, *a, **k)\n"
    "    per_step.append((time.perf_counter() - w, time.process_time() - c))\n"
    "    return out\n"
    "Trainer.step = step\n"
    "runpy.run_path(path, run_name='__main__')\n"
    "print(json.dumps({'per_step': per_step[1:]}))\n"  # [0] is compile + first step, as the bench does
)


def step_stats(wall: list[float], cpu: list[float]) -> dict:
    return {"step_time_s": statistics.median(wall), "best_step_s": min(wall),
            "cpu_s_per_step": statistics.median(cpu), "steps_timed": len(wall)}


def run_jaxtrain(steps: int) -> dict:
    bench = [str(REPO / "bench/bench_cpu_tiny.py"), "--steps", str(steps), "--repeats", "2"]
    cmd = [sys.executable, "-c", JAXTRAIN_WRAPPER, str(REPO)] + bench
    r = subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(), cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(bench)} failed (rc={r.returncode}):\n{r.stderr[-3000:]}")
    lines = [json.loads(x) for x in r.stdout.strip().splitlines() if x.startswith("{")]
    out, per_step = lines[-2], lines[-1]["per_step"]
    stats = step_stats([w for w, _ in per_step], [c for _, c in per_step])
    out["bench_median_step_s"] = out.pop("step_time_s")  # bench_cpu_tiny's own figure, same steps
    return {**out, **stats, "cmd": shlex.join([sys.executable] + bench)}


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run_maxtext(python: str, base_yml: str, steps: int, skip: int, variant: str, log: Path) -> dict:
    r = subprocess.run([python, "-c", PEAK_SNIPPET], capture_output=True, text=True, env=cpu_env())
    if r.returncode != 0:
        raise PeerUnavailable(f"matmul peak under the MaxText venv failed: {r.stderr.strip()[-1500:]}")
    peak = json.loads(r.stdout.strip().splitlines()[-1])
    cmd = maxtext_command(python, base_yml, skip + steps, variant, f"peer_{log.stem}")
    t = time.perf_counter()
    rows, total, last_cpu = [], None, None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cpu_env(),
                                cwd="/tmp", bufsize=1)
        for line in proc.stdout:
            f.write(line)
            if m := STEP_RE.search(line):
                # MaxText prints step k's line once step k's metrics are on the host, while step k+1 is
                # queued: the CPU seconds between two lines are one step's worth in steady state.
                cpu = proc_cpu_s(proc.pid)
                rows.append((int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4)),
                             cpu - last_cpu if last_cpu is not None else float("nan")))
                last_cpu = cpu
            elif m := TOTAL_TFLOPS_RE.search(line):
                total = float(m.group(1))
        rc = proc.wait()
    wall = time.perf_counter() - t
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise PeerUnavailable(f"MaxText exited rc={rc} (log {log}); last lines:\n{tail}")
    steady = [row for row in rows if row[0] >= skip]
    if not steady:
        raise PeerUnavailable(f"MaxText ran (rc=0) but printed no 'completed step' lines past step {skip} (log {log})")
    return {
        "cmd": shlex.join(cmd), "log": str(log), "wall_s": round(wall, 1),
        **step_stats([row[1] for row in steady], [row[4] for row in steady]),
        "own_tflops_per_device": statistics.median(row[2] for row in steady),
        "own_tokens_per_sec": statistics.median(row[3] for row in steady),
        "own_tflops_per_step": total,
        "matmul_peak_tflops": peak["matmul_peak_tflops"], "peak_jax": peak["jax"],
    }


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxtext-python", default="/work/maxtext-venv/bin/python")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds (each side runs this many times)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--skip", type=int, default=3, help="MaxText steps dropped at the start (compile, async fill)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="noremat")
    parser.add_argument("--log-dir", default="/tmp/maxtext_peer")
    args = parser.parse_args()

    from jaxtrain.config import load_config
    from jaxtrain.throughput import flops_per_step

    cfg = load_config(CPU_TINY, [])
    flops = flops_per_step(cfg)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    try:
        info = check_maxtext(args.maxtext_python)
    except (PeerUnavailable, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        print(f"MaxText peer unavailable: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"MaxText {info['maxtext']} (jax {info['jax']}, Python {info['python']}); variant {args.variant}; "
          f"load {loadavg()}", file=sys.stderr)

    jt, mt, loads = [], [], [loadavg()]
    try:
        for i in range(args.rounds):
            jt.append(run_jaxtrain(args.steps))
            print(f"round {i}: jaxtrain {jt[-1]['step_time_s']:.3f} s/step (load {loadavg()})", file=sys.stderr)
            mt.append(run_maxtext(args.maxtext_python, info["base_yml"], args.steps, args.skip, args.variant,
                                  log_dir / f"maxtext_{args.variant}_r{i}.log"))
            print(f"round {i}: maxtext  {mt[-1]['step_time_s']:.3f} s/step (load {loadavg()})", file=sys.stderr)
            loads.append(loadavg())
    except PeerUnavailable as e:
        print(f"MaxText peer unavailable: {e}", file=sys.stderr)
        sys.exit(2)

    peak = max([r["matmul_peak_tflops"] for r in jt] + [r["matmul_peak_tflops"] for r in mt]) * 1e12

    def side(runs: list[dict]) -> dict:
        step = statistics.median(r["step_time_s"] for r in runs)
        return {"step_time_s": round(step, 4), "tokens_per_sec": round(tokens / step, 1),
                "model_tflops_per_sec": round(flops / step / 1e12, 4), "mfu_vs_matmul_peak": round(flops / step / peak, 4),
                "best_step_s": round(min(r["best_step_s"] for r in runs), 4),
                "cpu_s_per_step": round(statistics.median(r["cpu_s_per_step"] for r in runs), 3),
                "per_round_step_s": [round(r["step_time_s"], 4) for r in runs]}

    j, m = side(jt), side(mt)
    m["own_tflops_per_device"] = statistics.median(r["own_tflops_per_device"] for r in mt)
    m["own_tflops_per_step"] = mt[0]["own_tflops_per_step"]
    ratios = [b["step_time_s"] / a["step_time_s"] for a, b in zip(jt, mt)]
    result = {
        "bench": "cpu-tiny-vs-maxtext", "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores", "load_avg": loads, "variant": args.variant,
        "rounds": args.rounds, "steps": args.steps,
        "jax_jaxtrain": jt[0]["jax"], "jax_maxtext": info["jax"], "maxtext_version": info["maxtext"],
        "model_flops_per_step": flops, "tokens_per_step": tokens, "matmul_peak_tflops": round(peak / 1e12, 4),
        "jaxtrain": j, "maxtext": m,
        "tokens_per_sec_ratio_jaxtrain_over_maxtext": round(m["step_time_s"] / j["step_time_s"], 3),
        "per_round_ratio": [round(x, 3) for x in ratios],
        "best_step_ratio": round(m["best_step_s"] / j["best_step_s"], 3),
        "cpu_s_ratio": round(m["cpu_s_per_step"] / j["cpu_s_per_step"], 3),
        "commands": {"jaxtrain": jt[0]["cmd"], "maxtext": mt[0]["cmd"]},
    }

    print(f"\ncpu-tiny, {result['date']}, {result['machine']}, load {' -> '.join(loads)}, "
          f"{args.rounds} alternating rounds, {args.steps} timed steps each")
    print(f"model FLOPs/step (jaxtrain formula, both sides): {flops / 1e9:.1f} GFLOP; "
          f"matmul peak (best in run): {peak / 1e9:.1f} GFLOP/s\n")
    print(f"| {'':24} | {'median step s':>13} | {'tokens/s':>8} | {'model TFLOP/s':>13} | {'MFU vs matmul':>13} "
          f"| {'own TFLOP/s':>11} | {'best step s':>11} | {'CPU s/step':>10} |")
    print("|" + "|".join("-" * (w + 2) for w in (24, 13, 8, 13, 13, 11, 11, 10)) + "|")
    for name, x, own in ((f"jaxtrain (jax {result['jax_jaxtrain']})", j, ""),
                         (f"MaxText {info['maxtext']} {args.variant}", m, f"{m['own_tflops_per_device']:.4f}")):
        print(f"| {name:24} | {x['step_time_s']:13.3f} | {x['tokens_per_sec']:8.1f} | {x['model_tflops_per_sec']:13.4f} "
              f"| {x['mfu_vs_matmul_peak']:13.1%} | {own:>11} | {x['best_step_s']:11.3f} | {x['cpu_s_per_step']:10.2f} |")
    print(f"\njaxtrain/MaxText tokens/s: {result['tokens_per_sec_ratio_jaxtrain_over_maxtext']:.2f} (median steps; "
          f"per round {result['per_round_ratio']}), {result['best_step_ratio']:.2f} (best steps), "
          f"{result['cpu_s_ratio']:.2f} (CPU seconds per step)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
