"""cpu-tiny (or moe-tiny) beside MaxText (DESIGN §6, §7): tokens/s and MFU of both, measured side by side.

    python bench/vs_maxtext.py [--maxtext-python ../maxtext-venv/bin/python] [--rounds 3] [--model cpu-tiny|moe-tiny]
    python bench/vs_maxtext.py --markdown vs_maxtext.json      (the README table of a saved run)

`--model moe-tiny` (issue #21) runs configs/moe-tiny.yaml with capacity dispatch (factor 1.25, no
router z-loss, which MaxText lacks) against MaxText's Mixtral decoder on the same shapes with its
CPU path: `sparse_matmul=False` (the dense GShard-style dispatch by einsum over a capacity
buffer), `megablox=False`, the same capacity factor and load-balancing loss weight.

Both sides run their real training entry point as a subprocess, on one CPU device, on the same
model (configs/bench/cpu-tiny.yaml; MaxText's overrides below):
  A. jaxtrain: `python -m jaxtrain train --config configs/bench/cpu-tiny.yaml --cpu-devices 1 ...`
     (logs every step; its own timer is metrics.jsonl's step_time_s);
  B. MaxText 0.2.5: `python -m maxtext.trainers.pre_train.train <base.yml> <overrides>` (its own
     timer is the "completed step: k, seconds: s" line).
After one untimed warm-up run of each side, each round runs A short, B short, A long, B long
(which side goes first, and whether short or long runs come first, alternate from round to
round) and measures:
  - own timer: each program's median step time over the long run's steps after `--skip`;
  - outside wall clock: (T(long run) - T(short run)) / (long - short steps), T = the subprocess's
    wall time, which cancels start-up and compilation and counts everything else;
  - CPU seconds per step (all threads of the process, sampled at each step line), a figure that
    moves less than wall time when other jobs share the cores;
  - the load average before each run. Speed claims need a quiet machine (load ~1 before a run,
    nothing else running); under load the ratio swings 0.7-2x (DESIGN §6).
Model FLOPs for BOTH sides come from `jaxtrain.observe.throughput.flops_per_step` on cpu-tiny;
MFU = model FLOP/s / the best plain jitted fp32 1024^2 matmul measured in the run (jaxtrain
measures its own at start-up, logged in events.jsonl; MaxText's is measured with its venv's jax
right before each of its runs).

XLA flags: by default both sides get the CPU flags of jaxtrain/runtime/xla_cpu.py (`--peer-flags
same`); `--peer-flags none` runs MaxText with its defaults, `--no-flags` runs both without.
glibc malloc: `jaxtrain train` keeps freed memory on the CPU (jaxtrain/runtime/host_malloc.py); MaxText
gets the same settings as environment variables (`--peer-malloc same`, the default) or glibc's
defaults (`--peer-malloc default`).

MaxText is not a dependency of jaxtrain: it lives in its own Python 3.12 venv, made by
`bench/maxtext_peer_setup.sh` (pip install "maxtext[tpu]==0.2.5", ~2.8 GB). Variant `noremat`
(default) is like for like: MaxText's scanned decoder always wraps the layer in jax.checkpoint
(remat_policy=none still means policy=None = full remat), so no-remat needs scan_layers=false.
Variant `full` is MaxText's default (scan + full remat). If MaxText cannot be run, the script
says exactly why and exits 2.
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
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from jaxtrain.runtime.host_malloc import env_equivalent  # noqa: E402  (no JAX import)
from jaxtrain.runtime.xla_cpu import cpu_xla_flags  # noqa: E402

PEER_MALLOC: dict[str, str] = {}  # MaxText's glibc malloc variables (--peer-malloc), set in main

MAXTEXT_VERSION = "0.2.5"
CPU_TINY = REPO / "configs/bench/cpu-tiny.yaml"
MOE_TINY = REPO / "configs/moe-tiny.yaml"
MOE_CAPACITY_FACTOR = 1.25

# Each model: jaxtrain's config and overrides, and the same model in MaxText's words.
MODELS = {
    "cpu-tiny": {
        "config": CPU_TINY, "overrides": [],
        "maxtext": {
            "base_emb_dim": 256, "base_num_decoder_layers": 4, "base_num_query_heads": 4, "base_num_kv_heads": 4,
            "head_dim": 64, "base_mlp_dim": 1024, "vocab_size": 32000, "max_target_length": 256,
            "per_device_batch_size": 8, "dtype": "float32", "weight_dtype": "float32", "decoder_block": "llama2",
            "logits_via_embedding": "false", "attention": "dot_product",
        },
    },
    "moe-tiny": {  # configs/moe-tiny.yaml: 8 experts of 64, top-2, every layer MoE (Mixtral's layout)
        "config": MOE_TINY, "overrides": [f"model.capacity_factor={MOE_CAPACITY_FACTOR}", "model.router_z_loss=0"],
        "maxtext": {
            "base_emb_dim": 64, "base_num_decoder_layers": 2, "base_num_query_heads": 4, "base_num_kv_heads": 2,
            "head_dim": 16, "base_mlp_dim": 64, "base_moe_mlp_dim": 64, "vocab_size": 64, "max_target_length": 64,
            "per_device_batch_size": 16, "dtype": "float32", "weight_dtype": "float32", "decoder_block": "mixtral",
            "logits_via_embedding": "false", "attention": "dot_product", "num_experts": 8,
            "num_experts_per_tok": 2, "sparse_matmul": "false", "megablox": "false",
            "capacity_factor": MOE_CAPACITY_FACTOR, "load_balance_loss_weight": 0.01,
        },
    },
}
# What both sides share besides the model: AdamW (b2 0.95, wd 0.1), global-norm clip 1.0, no
# dropout, no checkpoints; synthetic data (jaxtrain: its markov source) costs neither side time.
MAXTEXT_RUN = {
    "hardware": "cpu", "skip_jax_distributed_system": "true", "dataset_type": "synthetic",
    "enable_checkpointing": "false", "enable_dropout": "false", "dropout_rate": 0.0,
    "enable_tensorboard": "false", "enable_goodput_recording": "false", "monitor_goodput": "false",
    "gradient_clipping_threshold": 1.0, "opt_type": "adamw", "adam_b1": 0.9, "adam_b2": 0.95,
    "adam_weight_decay": 0.1,
}
VARIANTS = {
    "noremat": {"scan_layers": "false", "remat_policy": "none"},
    "full": {"scan_layers": "true", "remat_policy": "full"},
}
MAXTEXT_STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+)")
JAXTRAIN_STEP = re.compile(r"^step\s+(\d+)\s+loss")
PEAK_SNIPPET = (
    "import json, time, jax, jax.numpy as jnp\n"
    "n = 1024; a = jnp.ones((n, n), jnp.float32); f = jax.jit(lambda x: x @ x); f(a).block_until_ready()\n"
    "best = 1e9\n"
    "for _ in range(5):\n"
    "    t = time.perf_counter(); f(a).block_until_ready(); best = min(best, time.perf_counter() - t)\n"
    "print(json.dumps({'jax': jax.__version__, 'matmul_peak_flops': 2 * n ** 3 / best}))\n"
)


class PeerUnavailable(RuntimeError):
    """MaxText cannot be run here; the message says why."""


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_env(xla_flags: list[str], malloc: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(malloc or {}),
               XLA_FLAGS=" ".join(xla_flags + ["--xla_force_host_platform_device_count=1"]))
    env.pop("PYTHONPATH", None)  # keep the two venvs apart
    return env


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_streaming(cmd: list[str], env: dict, cwd: str, log: Path, step_re: re.Pattern) -> tuple[float, int, list[float]]:
    """Run `cmd`; returns (wall seconds, return code, CPU seconds at each line matching step_re)."""
    t = time.perf_counter()
    cpu_marks: list[float] = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                                bufsize=1)
        for line in proc.stdout:
            f.write(line)
            if step_re.search(line):
                cpu_marks.append(proc_cpu_s(proc.pid))
        rc = proc.wait()
    return time.perf_counter() - t, rc, cpu_marks


def per_step_cpu(marks: list[float], skip: int) -> float | None:
    """Median CPU seconds between consecutive step lines past the first `skip`."""
    deltas = [b - a for a, b in zip(marks[skip:], marks[skip + 1:])]
    return statistics.median(deltas) if deltas else None


def run_jaxtrain(python: str, steps: int, skip: int, flags: list[str], log: Path, model: str = "cpu-tiny") -> dict:
    with tempfile.TemporaryDirectory(prefix="vs_maxtext_") as out:
        cmd = [python, "-m", "jaxtrain", "train", "--config", str(MODELS[model]["config"]), "--cpu-devices", "1",
               f"train.steps={steps}", "train.log_every=1", f"run.output_dir={out}",
               "checkpoint.compilation_cache_dir=null", "checkpoint.save_at_end=false", *MODELS[model]["overrides"]]
        load = loadavg()
        wall, rc, marks = run_streaming(cmd, cpu_env(flags), str(REPO), log, JAXTRAIN_STEP)
        if rc != 0:
            raise RuntimeError(f"jaxtrain exited rc={rc} (log {log}):\n" + "\n".join(log.read_text().splitlines()[-20:]))
        records = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        start = next(json.loads(x) for x in (Path(out) / "events.jsonl").read_text().splitlines()
                     if json.loads(x)["kind"] == "start")
    steady = [r["step_time_s"] for r in records if r["step"] > skip]
    return {"wall_s": wall, "steps": steps, "load": load, "cmd": shlex.join(cmd), "log": str(log),
            "own_step_s": statistics.median(steady) if steady else None,
            "cpu_s_per_step": per_step_cpu(marks, skip), "matmul_peak_flops": start["peak_flops_per_device"],
            "compile_s": start.get("compile_s")}


def check_maxtext(python: str, flags: list[str]) -> dict:
    """Version, jax and base.yml of the MaxText install, or PeerUnavailable with the exact reason."""
    if not Path(python).exists():
        raise PeerUnavailable(f"--maxtext-python {python} does not exist; create it with bench/maxtext_peer_setup.sh "
                              f"(python3.12 -m venv ... && pip install \"maxtext[tpu]=={MAXTEXT_VERSION}\")")
    probe = ("import json, sys, importlib.metadata as md, pathlib, jax, maxtext\n"
             "print(json.dumps({'python': sys.version.split()[0], 'maxtext': md.version('maxtext'), 'jax': jax.__version__,"
             " 'base_yml': str(pathlib.Path(maxtext.__file__).parent / 'configs' / 'base.yml')}))")
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=cpu_env(flags, PEER_MALLOC),
                       timeout=300)
    if r.returncode != 0:
        raise PeerUnavailable(f"`{python} -c 'import maxtext, jax'` failed (rc={r.returncode}): {r.stderr.strip()[-1500:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if not Path(info["base_yml"]).exists():
        raise PeerUnavailable(f"MaxText {info['maxtext']} has no configs/base.yml at {info['base_yml']}")
    if info["maxtext"] != MAXTEXT_VERSION:
        print(f"note: MaxText {info['maxtext']} installed, overrides were written for {MAXTEXT_VERSION}", file=sys.stderr)
    return info


def maxtext_command(python: str, base_yml: str, steps: int, variant: str, run_name: str, out: str,
                    model: str = "cpu-tiny") -> list[str]:
    overrides = {**MODELS[model]["maxtext"], **MAXTEXT_RUN, **VARIANTS[variant], "steps": steps, "run_name": run_name,
                 "base_output_directory": out}
    return [python, "-m", "maxtext.trainers.pre_train.train", base_yml] + [f"{k}={v}" for k, v in overrides.items()]


def run_maxtext(python: str, base_yml: str, steps: int, skip: int, variant: str, flags: list[str], log: Path,
                model: str = "cpu-tiny") -> dict:
    r = subprocess.run([python, "-c", PEAK_SNIPPET], capture_output=True, text=True, env=cpu_env(flags, PEER_MALLOC))
    if r.returncode != 0:
        raise PeerUnavailable(f"matmul peak under the MaxText venv failed: {r.stderr.strip()[-1500:]}")
    peak = json.loads(r.stdout.strip().splitlines()[-1])["matmul_peak_flops"]
    with tempfile.TemporaryDirectory(prefix="vs_maxtext_mt_") as out:
        cmd = maxtext_command(python, base_yml, steps, variant, f"peer_{log.stem}", out, model)
        load = loadavg()
        wall, rc, marks = run_streaming(cmd, cpu_env(flags, PEER_MALLOC), out, log, MAXTEXT_STEP)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise PeerUnavailable(f"MaxText exited rc={rc} (log {log}); last lines:\n{tail}")
    rows = [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in MAXTEXT_STEP.finditer(log.read_text())]
    # MaxText prints step k once its metrics reach the host, with step k+1 queued: the first steps
    # are short (async pipeline fill); they are dropped with --skip.
    steady = [row for row in rows if row[0] >= skip]
    if not steady:
        raise PeerUnavailable(f"MaxText ran (rc=0) but printed no 'completed step' lines past step {skip} (log {log})")
    return {"wall_s": wall, "steps": steps, "load": load, "cmd": shlex.join(cmd), "log": str(log),
            "own_step_s": statistics.median(row[1] for row in steady),
            "own_tflops_per_device": statistics.median(row[2] for row in steady),
            "cpu_s_per_step": per_step_cpu(marks, skip), "matmul_peak_flops": peak}


def summarize(rounds: list[dict], flops: float, tokens: int) -> dict:
    """Both sides' figures over the rounds: medians of own-timer and outside-wall-clock step times."""
    peak = max(r[s][k]["matmul_peak_flops"] for r in rounds for s in ("jaxtrain", "maxtext") for k in ("short", "long"))
    out = {"matmul_peak_tflops": round(peak / 1e12, 4)}
    for side in ("jaxtrain", "maxtext"):
        own = [r[side]["long"]["own_step_s"] for r in rounds]
        outside = [(r[side]["long"]["wall_s"] - r[side]["short"]["wall_s"])
                   / (r[side]["long"]["steps"] - r[side]["short"]["steps"]) for r in rounds]
        cpu = [r[side]["long"]["cpu_s_per_step"] for r in rounds if r[side]["long"]["cpu_s_per_step"] is not None]
        own_s, outside_s = statistics.median(own), statistics.median(outside)
        out[side] = {
            "own_step_s": round(own_s, 4), "outside_step_s": round(outside_s, 4),
            "own_tokens_per_sec": round(tokens / own_s, 1), "outside_tokens_per_sec": round(tokens / outside_s, 1),
            "own_mfu": round(flops / own_s / peak, 4), "outside_mfu": round(flops / outside_s / peak, 4),
            "cpu_s_per_step": round(statistics.median(cpu), 3) if cpu else None,
            "per_round_own_step_s": [round(x, 4) for x in own], "per_round_outside_step_s": [round(x, 4) for x in outside],
        }
    j, m = out["jaxtrain"], out["maxtext"]
    out["ratio_own"] = round(m["own_step_s"] / j["own_step_s"], 3)
    out["ratio_outside"] = round(m["outside_step_s"] / j["outside_step_s"], 3)
    out["per_round_ratio_own"] = [round(b / a, 3) for a, b in zip(j["per_round_own_step_s"], m["per_round_own_step_s"])]
    out["per_round_ratio_outside"] = [round(b / a, 3) for a, b in
                                      zip(j["per_round_outside_step_s"], m["per_round_outside_step_s"])]
    if j["cpu_s_per_step"] and m["cpu_s_per_step"]:
        out["ratio_cpu_s"] = round(m["cpu_s_per_step"] / j["cpu_s_per_step"], 3)
    return out


def markdown(result: dict) -> str:
    """The README table of one run of this script."""
    s = result["summary"]
    loads = [r[side][k]["load"] for r in result["rounds"] for side in ("jaxtrain", "maxtext") for k in ("short", "long")]
    lines = [
        f"{result.get('model', 'cpu-tiny')}, {result['date']}, {result['machine']}; {result['rounds_run']} alternating rounds "
        f"({result['short_steps']} and {result['long_steps']} steps); load average before runs "
        f"{min(loads):.2f}-{max(loads):.2f}; XLA flags: jaxtrain `{' '.join(result['xla_flags']['jaxtrain']) or 'none'}`, "
        f"MaxText `{' '.join(result['xla_flags']['maxtext']) or 'none'}`; matmul peak {s['matmul_peak_tflops'] * 1e3:.0f} GFLOP/s.",
        "",
        "| | step s (own timer) | step s (outside wall clock) | tokens/s (own) | tokens/s (outside) | MFU (own) | CPU s/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"jaxtrain": f"jaxtrain (jax {result['jax']['jaxtrain']})",
             "maxtext": f"MaxText {result['maxtext_version']} {result['variant']} (jax {result['jax']['maxtext']})"}
    for side in ("jaxtrain", "maxtext"):
        x = s[side]
        cpu = f"{x['cpu_s_per_step']:.2f}" if x["cpu_s_per_step"] is not None else ""
        lines.append(f"| {names[side]} | {x['own_step_s']:.3f} | {x['outside_step_s']:.3f} | {x['own_tokens_per_sec']:.0f} "
                     f"| {x['outside_tokens_per_sec']:.0f} | {x['own_mfu']:.1%} | {cpu} |")
    lines += ["", f"jaxtrain / MaxText tokens/s: **{s['ratio_own']:.2f}x** by the programs' own timers (per round "
                  f"{s['per_round_ratio_own']}), **{s['ratio_outside']:.2f}x** by the outside wall clock (per round "
                  f"{s['per_round_ratio_outside']})" + (f", {s['ratio_cpu_s']:.2f}x in CPU seconds per step" if "ratio_cpu_s" in s else "")
              + ". MFU = model FLOPs (jaxtrain's count, both sides) / step time / the best fp32 1024² matmul of the run."]
    return "\n".join(lines)


def portable(text: str, names: dict[str, str]) -> str:
    """`text` with each absolute path prefix in `names` replaced by its placeholder, longest first."""
    for prefix in sorted(names, key=len, reverse=True):
        text = text.replace(prefix, names[prefix])
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxtext-python", default=os.environ.get("MAXTEXT_PYTHON", "../maxtext-venv/bin/python"),
                        help="the Python of the MaxText venv (bench/maxtext_peer_setup.sh; env MAXTEXT_PYTHON)")
    parser.add_argument("--jaxtrain-python", default=sys.executable, help="the Python (venv) that runs jaxtrain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", type=int, default=4, help="steps of the short run")
    parser.add_argument("--long", type=int, default=24, help="steps of the long run")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the own-timer medians")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="noremat")
    parser.add_argument("--model", choices=sorted(MODELS), default="cpu-tiny")
    parser.add_argument("--no-flags", action="store_true", help="no XLA CPU flags on either side")
    parser.add_argument("--peer-flags", choices=("same", "none"), default="same",
                        help="MaxText gets the same XLA flags as jaxtrain (default) or none")
    parser.add_argument("--peer-malloc", choices=("same", "default"), default="same",
                        help="MaxText gets jaxtrain's glibc malloc settings (default) or glibc's defaults")
    parser.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "vs_maxtext"),
                        help="the runs' logs (default: vs_maxtext in the system's temporary directory)")
    parser.add_argument("--out", default="vs_maxtext.json", help="where the result JSON is written")
    parser.add_argument("--markdown", metavar="RESULT_JSON", help="print the README table of a saved result and exit")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    if args.long <= args.short or args.short <= args.skip:
        parser.error("need --skip < --short < --long")
    args.maxtext_python = os.path.abspath(args.maxtext_python)  # MaxText runs in its own working directory

    from jaxtrain.config import load_config
    from jaxtrain.observe.throughput import flops_per_step

    cfg = load_config(MODELS[args.model]["config"], MODELS[args.model]["overrides"])
    flops = flops_per_step(cfg)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    flags = [] if args.no_flags else cpu_xla_flags()
    peer_flags = {"same": flags, "none": []}[args.peer_flags]
    PEER_MALLOC.update(env_equivalent() if args.peer_malloc == "same" else {})
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    jax_version = subprocess.run([args.jaxtrain_python, "-c", "import jax; print(jax.__version__)"], capture_output=True,
                                 text=True, env=cpu_env([])).stdout.strip()
    try:
        info = check_maxtext(args.maxtext_python, peer_flags)
    except (PeerUnavailable, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        print(f"MaxText peer unavailable: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"jaxtrain (jax {jax_version}) vs MaxText {info['maxtext']} (jax {info['jax']}), variant {args.variant}; "
          f"XLA flags {flags or 'none'} / MaxText {peer_flags or 'none'}; load {loadavg()}", file=sys.stderr)

    rounds = []
    try:
        # One untimed run of each side first: the first start of a program pays for cold caches
        # (imports, page cache), which would land in round 0's short run.
        run_jaxtrain(args.jaxtrain_python, args.short, args.skip, flags, log_dir / "jaxtrain_warmup.log", args.model)
        run_maxtext(args.maxtext_python, info["base_yml"], args.short, args.skip, args.variant, peer_flags,
                    log_dir / "maxtext_warmup.log", args.model)
        for i in range(args.rounds):
            # Alternate which side goes first, and whether the short or the long runs come first.
            order = ("jaxtrain", "maxtext") if i % 2 == 0 else ("maxtext", "jaxtrain")
            lengths = (("short", args.short), ("long", args.long))
            result: dict = {"jaxtrain": {}, "maxtext": {}}
            for length, steps in (lengths if i % 2 == 0 else lengths[::-1]):
                for side in order:
                    log = log_dir / f"{side}_{args.model}_{args.variant}_r{i}_{length}.log"
                    if side == "jaxtrain":
                        r = run_jaxtrain(args.jaxtrain_python, steps, args.skip, flags, log, args.model)
                    else:
                        r = run_maxtext(args.maxtext_python, info["base_yml"], steps, args.skip, args.variant,
                                        peer_flags, log, args.model)
                    result[side][length] = r
                    own = f", own {r['own_step_s']:.3f} s/step" if length == "long" else ""
                    print(f"round {i} {side:8} {length:5} {steps:3d} steps: {r['wall_s']:6.1f} s wall{own} "
                          f"(load before {r['load']})", file=sys.stderr)
            rounds.append(result)
    except PeerUnavailable as e:
        print(f"MaxText peer unavailable: {e}", file=sys.stderr)
        sys.exit(2)

    out = {
        "bench": f"{args.model}-vs-maxtext", "model": args.model, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores", "variant": args.variant,
        "rounds_run": args.rounds, "short_steps": args.short, "long_steps": args.long, "skip": args.skip,
        "jax": {"jaxtrain": jax_version, "maxtext": info["jax"]}, "maxtext_version": info["maxtext"],
        "xla_flags": {"jaxtrain": flags, "maxtext": peer_flags}, "maxtext_malloc_env": dict(PEER_MALLOC),
        "model_flops_per_step": flops, "tokens_per_step": tokens, "load_avg_end": loadavg(),
        "summary": summarize(rounds, flops, tokens), "rounds": rounds,
    }
    # Results get committed: no path of this machine in them (the repository is the working directory).
    text = portable(json.dumps(out, indent=1), {
        str(Path(args.maxtext_python).absolute().parents[1]): "<maxtext-venv>", str(log_dir.absolute()): "<log-dir>",
        str(Path(args.jaxtrain_python).absolute().parents[1]): "<jaxtrain-venv>",
        str(REPO) + "/": "", tempfile.gettempdir(): "<tmp>"})
    Path(args.out).write_text(text)
    print("\n" + markdown(out) + "\n")
    print(f"(result JSON: {args.out}; table again: python bench/vs_maxtext.py --markdown {args.out})")
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
