"""Restart-to-first-step: a killed run restarted with a warm vs a cold compilation cache.

    python bench/bench_restart.py [--config configs/bench/cpu-tiny.yaml] [--rounds 2]

Each round: a run is SIGKILLed after step 6 (checkpoints every 5 steps), then the same command
restarts it; the `resume` event reports `restart_to_first_step_s` (process start -> first step
done: imports, restore, compile or cache load, one step). Cold restarts use an empty cache
directory, warm ones the cache the killed run filled. Rounds alternate cold and warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(out: Path, cache: Path, config: str, *, restart: bool) -> dict | None:
    env = {**os.environ, "JAXTRAIN_RESTART_ATTEMPT": "1" if restart else "0"}
    cmd = [sys.executable, "-m", "jaxtrain", "train", "--config", config, f"run.output_dir={out}",
           f"checkpoint.compilation_cache_dir={cache}", "train.steps=8", "train.log_every=1",
           "checkpoint.every_steps=5", "chaos.kill_at_step=6", "--cpu-devices", "1"]
    subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=REPO)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return next((e for e in events if e["kind"] == "resume"), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs/bench/cpu-tiny.yaml"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in ("cold", "warm"):
                base = Path(tmp) / f"{kind}{r}"
                train(base / "run", base / "cache", args.config, restart=False)  # killed after step 6
                cache = base / ("empty_cache" if kind == "cold" else "cache")
                resume = train(base / "run", cache, args.config, restart=True)
                assert resume is not None, f"{kind}: no resume event"
                results[kind].append(resume)
    summary = {kind: {"restart_to_first_step_s": statistics.median(e["restart_to_first_step_s"] for e in rs),
                      "compile_s": statistics.median(e["compile_s"] for e in rs)} for kind, rs in results.items()}
    summary["date"] = time.strftime("%Y-%m-%d")
    summary["config"] = os.path.relpath(args.config, REPO)
    summary["warm_over_cold"] = round(summary["warm"]["restart_to_first_step_s"] / summary["cold"]["restart_to_first_step_s"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
