"""How fast a 2-process CPU job recovers: kill -> first step after restart, and hang -> detection.

    python bench/bench_recovery.py [--hang-timeout 10] [--cache shared|per-process] [--no-hang]

Three runs of `jaxtrain launch --num-processes 2 --cpu-devices 1` on configs/tiny.yaml (tiny shape):
  cold     a fresh run with an empty compilation cache: launch -> first step done (metrics time);
  kill     chaos.kill_at_step on process 0 (which logs the drill before dying), warm cache, one
           restart: the `chaos` event's time -> the `resume` event (written once the first step after
           the restart has finished): detection + restart + restore + compile from the cache + a step;
  hang     chaos.hang_at_step on process 1, fault.hang_timeout_s=T: the last step finished before the
           hang (metrics time) -> the first `hang` event; minus T is the detection slack.
Targets (issue #11): detection within T + 5 s; kill -> first step under 2x the cold start.

--local-tier [--kills 5] instead compares the local checkpoint tier (issue #23): the same job, 100 steps,
persistent checkpoints every 50 steps, with `checkpoint.local_every_steps=2` (one local_dir for the
machine, and one per process, `{process}`: the replicas then go over TCP) and without, each killed
(chaos.kill_at_step, process 0, which logs the drill) at --kills random steps in 52..99 (the same steps for both) and
restarted once: steps re-done per kill (kill step - restored step), kill -> first completed step
after the restart, and the loop thread's time blocked per local save (`local_checkpoint_saved.
blocked_s`, and with the wait for the step to finish, `ready_s`) as a fraction of the median step.
Targets: re-done <= local_every_steps; blocking <= 5% of a step; kill -> first step no slower.

--cache shared (default) gives both processes one cache folder, as `compilation_cache_dir=auto` (in the
run directory) does on a cluster; --cache per-process gives each its own (`{process}`), as a per-host
`~/.cache` does: JAX writes the cache from process 0 only, so process 1 compiles cold on every restart.
Prints one JSON line. Run it on a quiet machine.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs/tiny.yaml")
SMALL = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8", "data.seq_len=16",
         "train.log_every=1", "train.steps=20", "checkpoint.every_steps=5"]


def launch(out: Path, cache: Path, *overrides: str, restarts: int = 0) -> tuple[float, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXTRAIN_RESTART_ATTEMPT")}
    env["JAX_PLATFORMS"] = "cpu"
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "2", "--cpu-devices", "1",
                        "--max-restarts", str(restarts), "--grace-period-s", "5", "--", "train", "--config", TINY,
                        *SMALL, f"run.output_dir={out}", f"checkpoint.compilation_cache_dir={cache}", *overrides],
                       env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"bench_recovery: run failed ({r.returncode}): {r.stderr[-2000:]}")
    return t, r


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def local_tier(kills: int, seed: int) -> dict:
    """The local tier against the persistent tier alone (see the module docstring)."""
    import random
    import statistics
    steps = random.Random(seed).sample(range(52, 100), kills)
    base = ["train.steps=100", "checkpoint.every_steps=50", "chaos.kill_process=0"]  # process 0 logs the drill
    out: dict = {"kill_steps": steps}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        launch(tmp / "warm", cache, "train.steps=3")  # the compilation cache, for every run alike
        # private_disks: a local_dir for each process ({process}), so the replica goes over TCP to the
        # peer's replica server, as between hosts with private local disks
        for name, extra, disk in (("persistent_only", [], ""), ("local_every_2", ["checkpoint.local_every_steps=2"], ""),
                                  ("local_every_2_private_disks", ["checkpoint.local_every_steps=2"], "/host-{process}")):
            redone, kill_to_step, blocked, ready, step_s = [], [], [], [], []
            for i, k in enumerate(steps):
                run = tmp / f"{name}{i}"
                launch(run, cache, *base, *extra, f"checkpoint.local_dir={tmp / 'local' / name / str(i)}{disk}",
                       f"chaos.kill_at_step={k}", restarts=1)
                events = jsonl(run / "events.jsonl")
                killed = next(e["time"] for e in events if e["kind"] == "chaos")
                resume = next((e for e in events if e["kind"] == "resume"), None)
                if resume is None:  # nothing committed to restore (the step-50 commit was still running): from 0
                    first = min(m["time"] for m in jsonl(run / "metrics.jsonl") if m["time"] > killed)
                    resume = {"restored_step": 0, "time": first}
                redone.append(k - resume["restored_step"])
                kill_to_step.append(resume["time"] - killed)
                blocked += [e["blocked_s"] for e in events if e["kind"] == "local_checkpoint_saved"]
                ready += [e["ready_s"] for e in events if e["kind"] == "local_checkpoint_saved"]
                step_s += [m["step_time_s"] for m in jsonl(run / "metrics.jsonl") if m.get("step_time_s")]
            median_step = statistics.median(step_s)
            out[name] = {"redone_steps_mean": round(statistics.mean(redone), 2), "redone_steps": redone,
                         "kill_to_first_step_s_mean": round(statistics.mean(kill_to_step), 2),
                         "kill_to_first_step_s": [round(x, 2) for x in kill_to_step],
                         "median_step_s": round(median_step, 4)}
            if blocked:
                out[name].update({
                    # the mean carries each run's first save, which compiles the device snapshot's copy
                    "local_saves": len(blocked), "blocked_per_save_s_mean": round(statistics.mean(blocked), 5),
                    "blocked_per_save_s_median": round(statistics.median(blocked), 5),
                    "blocked_median_fraction_of_step": round(statistics.median(blocked) / median_step, 4),
                    "median_step_s_persistent_only": out["persistent_only"]["median_step_s"],
                    "blocked_fraction_of_step": round(statistics.mean(blocked) / median_step, 4),
                    "ready_plus_blocked_fraction_of_step": round(
                        (statistics.mean(blocked) + statistics.mean(ready)) / median_step, 4)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--cache", choices=("shared", "per-process"), default="shared")
    parser.add_argument("--no-hang", action="store_true", help="skip the hang run (it does not depend on the cache)")
    parser.add_argument("--local-tier", action="store_true", help="compare the local checkpoint tier (issue #23)")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.local_tier:
        print(json.dumps({"bench": "recovery_local_tier", "date": time.strftime("%Y-%m-%d"),
                          "machine": f"{platform.machine()} {os.cpu_count()} cores",
                          "load_avg_1m": round(os.getloadavg()[0], 2), **local_tier(args.kills, args.seed)}))
        return
    hang: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache" / ("p{process}" if args.cache == "per-process" else "shared")
        started, _ = launch(tmp / "cold", cache)
        cold = jsonl(tmp / "cold" / "metrics.jsonl")[0]["time"] - started
        launch(tmp / "kill", cache, "chaos.kill_at_step=12", "chaos.kill_process=0", restarts=1)
        events = jsonl(tmp / "kill" / "events.jsonl")
        killed = next(e["time"] for e in events if e["kind"] == "chaos")
        kill_to_step = next(e["time"] for e in events if e["kind"] == "resume") - killed
        if not args.no_hang:
            launch(tmp / "hang", cache, "chaos.hang_at_step=12", "chaos.hang_process=1",
                   f"fault.hang_timeout_s={args.hang_timeout}", restarts=1)
            events = jsonl(tmp / "hang" / "events.jsonl")
            # The hang starts when the last step before it finished (process 0 logs it as it finishes).
            first_hang = min(e["time"] for e in events if e["kind"] == "hang")
            last_step_before = max(m["time"] for m in jsonl(tmp / "hang" / "metrics.jsonl") if m["time"] < first_hang)
            detection = first_hang - last_step_before
            hang = {"hang_timeout_s": args.hang_timeout, "hang_detected_after_s": round(detection, 2),
                    "detection_slack_s": round(detection - args.hang_timeout, 2)}
    print(json.dumps({
        "bench": "recovery", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "load_avg_1m": round(os.getloadavg()[0], 2), "cache": args.cache, "cold_start_to_first_step_s": round(cold, 2),
        "kill_to_first_step_s": round(kill_to_step, 2), "kill_vs_cold": round(kill_to_step / cold, 2), **hang,
    }))


if __name__ == "__main__":
    main()
