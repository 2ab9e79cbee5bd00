"""What the live-metrics endpoint costs (issue #24's target: <= 1% of the step on cpu-tiny).

    python bench/bench_prometheus.py [--steps 10] [--rounds 3] [--scrape-every 1.0]

Two variants of `jaxtrain train --config configs/bench/cpu-tiny.yaml --cpu-devices 1`, each a fresh
process:
  off   no endpoint (observe.prometheus_port=0)
  on    observe.prometheus_port on loopback, and fault.health_every_steps=10 (the health check
        feeds the endpoint too), scraped by this script every --scrape-every seconds while it runs
Rounds alternate the variants and which of them goes first, and run each at N and 3N steps, so
machine noise hits both alike. Per variant two figures:
  own timer   the median of metrics.jsonl's step_time_s (the loop's own clock, logged every step)
  wall clock  (T(3N steps) - T(N steps)) / 2N of the whole process, from outside: start-up and
              compilation cancel (both runs share a warm compilation cache)
and the overhead of `on` over `off` by each. Prints one JSON line; run it on a quiet machine (load ~1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "bench" / "cpu-tiny.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_while(proc: subprocess.Popen, port: int, every_s: float) -> list[float]:
    """Scrape /metrics every `every_s` until `proc` ends; returns the seconds each scrape took."""
    took: list[float] = []
    while proc.poll() is None:
        t = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                r.read()
            took.append(time.perf_counter() - t)
        except OSError:
            pass  # not serving yet (start-up) or already closed
        time.sleep(max(0.0, every_s - (time.perf_counter() - t)))
    return took


def run(variant: str, steps: int, out: Path, cache: Path, scrape_every: float) -> dict:
    """One `jaxtrain train` process: its wall seconds, its own median step time, the scrapes."""
    port = free_port()
    extra = [f"observe.prometheus_port={port}", "observe.prometheus_addr=127.0.0.1",
             "fault.health_every_steps=10"] if variant == "on" else []
    cmd = [sys.executable, "-m", "jaxtrain.cli", "train", "--config", str(CONFIG), "--cpu-devices", "1",
           f"run.output_dir={out}", f"train.steps={steps}", "train.log_every=1",
           f"checkpoint.compilation_cache_dir={cache}", *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    scrapes: list[float] = []
    scraper = None
    if variant == "on":
        scraper = threading.Thread(target=lambda: scrapes.extend(scrape_while(proc, port, scrape_every)), daemon=True)
        scraper.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t
    if scraper is not None:
        scraper.join()
    if proc.returncode != 0:
        raise SystemExit(f"bench_prometheus: {variant} failed ({proc.returncode}): {err[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_s"] for r in records if "step_time_s" in r]
    step_times = step_times[2:] or step_times  # past the first (compile) steps
    return {"wall_s": wall, "own_step_s": statistics.median(step_times), "scrapes": len(scrapes),
            "scrape_s": statistics.median(scrapes) if scrapes else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="N: the short run's steps (the long one: 3N)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    results: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run("off", 2, tmp / "warm", tmp / "cache", args.scrape_every)  # fills the compilation cache
        for r in range(args.rounds):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            lengths = [args.steps, 3 * args.steps] if r % 2 == 0 else [3 * args.steps, args.steps]
            for variant in order:
                runs = {n: run(variant, n, tmp / f"{variant}-{r}-{n}", tmp / "cache", args.scrape_every)
                        for n in lengths}
                short, long = runs[args.steps], runs[3 * args.steps]
                results[variant].append({
                    "wall_step_s": (long["wall_s"] - short["wall_s"]) / (2 * args.steps),
                    "own_step_s": statistics.median([short["own_step_s"], long["own_step_s"]]),
                    "scrapes": short["scrapes"] + long["scrapes"], "scrape_s": long["scrape_s"]})
                print(json.dumps({"round": r, "variant": variant, **results[variant][-1]}), file=sys.stderr)

    def med(variant: str, key: str) -> float:
        return statistics.median(x[key] for x in results[variant])

    summary = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores", "steps": [args.steps, 3 * args.steps], "rounds": args.rounds,
        "scrape_every_s": args.scrape_every, "load": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        **{f"{v}_{k}": round(med(v, k), 5) for v in ("off", "on") for k in ("wall_step_s", "own_step_s")},
        "scrapes": sum(x["scrapes"] for x in results["on"]),
        "scrape_s": round(statistics.median(x["scrape_s"] for x in results["on"] if x["scrape_s"]), 5),
    }
    for k in ("wall_step_s", "own_step_s"):
        summary[f"overhead_{k.split('_')[0]}"] = round(summary[f"on_{k}"] / summary[f"off_{k}"] - 1, 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
