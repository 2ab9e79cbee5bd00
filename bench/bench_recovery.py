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
    r = subprocess.run([sys.executable, "-m", "jaxtrain.cli", "launch", "--num-processes", "2", "--cpu-devices", "1",
                        "--max-restarts", str(restarts), "--grace-period-s", "5", "--", "train", "--config", TINY,
                        *SMALL, f"run.output_dir={out}", f"checkpoint.compilation_cache_dir={cache}", *overrides],
                       env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"bench_recovery: run failed ({r.returncode}): {r.stderr[-2000:]}")
    return t, r


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--cache", choices=("shared", "per-process"), default="shared")
    parser.add_argument("--no-hang", action="store_true", help="skip the hang run (it does not depend on the cache)")
    args = parser.parse_args()
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
