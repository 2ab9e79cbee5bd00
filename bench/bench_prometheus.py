"""What the live-metrics endpoint costs (issue #24's target: <= 1% of the step on cpu-tiny).

    python bench/bench_prometheus.py [--steps 10] [--rounds 3] [--scrape-every 1.0]

Three variants of `jaxtrain train --config configs/bench/cpu-tiny.yaml --cpu-devices 1`, each a
fresh process:
  off     no endpoint (observe.prometheus_port=0), no health check (the default)
  on      observe.prometheus_port on loopback, scraped by this script every --scrape-every seconds
          while it runs: the endpoint's cost, which the target is about
  health  `on` plus fault.health_every_steps=10 (its own option, off by default; it feeds the
          endpoint too): what the run-time health check adds on top
Rounds rotate the variants' order, and run each at N and 3N steps, so machine noise hits all alike. Per variant two figures:
  own timer   the median of metrics.jsonl's step_time_s (the loop's own clock, logged every step)
  wall clock  (T(3N steps) - T(N steps)) / 2N of the whole process, from outside: start-up and
              compilation cancel (both runs share a warm compilation cache)
and the overhead of `on` and of `health` over `off` by each. Prints one JSON line; run it on a quiet machine (load ~1).

    python bench/bench_prometheus.py --interleaved [--steps 64] [--rounds 2]

The same question inside one process, where machine and process-to-process noise (about +-3% between
two runs of the same variant here) cancel: the endpoint is on, and the scraper scrapes every
--scrape-every seconds only in every other window of WINDOW steps (it follows the run's
metrics.jsonl); the median step time of the scraped windows against the others (each window's first
and last step left out: the log lags the loop by a step), the unscraped half first in one round and
second in the next. Beside it, the loop-side cost the endpoint adds to every step (its on_step,
on_record and on_iteration calls, timed on a real Exporter), which both halves carry.
"""

from __future__ import annotations

import argparse
import http.client
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
        except (OSError, http.client.HTTPException):
            pass  # not serving yet (start-up) or already closed
        time.sleep(max(0.0, every_s - (time.perf_counter() - t)))
    return took


def run(variant: str, steps: int, out: Path, cache: Path, scrape_every: float) -> dict:
    """One `jaxtrain train` process: its wall seconds, its own median step time, the scrapes."""
    port = free_port()
    extra = [] if variant == "off" else [f"observe.prometheus_port={port}", "observe.prometheus_addr=127.0.0.1"]
    if variant == "health":
        extra.append("fault.health_every_steps=10")
    cmd = [sys.executable, "-m", "jaxtrain", "train", "--config", str(CONFIG), "--cpu-devices", "1",
           f"run.output_dir={out}", f"train.steps={steps}", "train.log_every=1",
           f"checkpoint.compilation_cache_dir={cache}", *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    scrapes: list[float] = []
    scraper = None
    if variant != "off":
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


WINDOW = 8  # steps per scraped / unscraped window (--interleaved)


def interleaved_round(steps: int, out: Path, cache: Path, scrape_every: float, scraped_parity: int) -> dict:
    """One process, the endpoint on, scraped only in windows whose index has `scraped_parity`."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxtrain", "train", "--config", str(CONFIG), "--cpu-devices", "1",
           f"run.output_dir={out}", f"train.steps={steps}", "train.log_every=1",
           f"checkpoint.compilation_cache_dir={cache}", f"observe.prometheus_port={port}",
           "observe.prometheus_addr=127.0.0.1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, scrapes = out / "metrics.jsonl", []
    while proc.poll() is None:
        try:
            logged = metrics.read_text().count("\n")
        except FileNotFoundError:
            logged = 0
        if (logged // WINDOW) % 2 == scraped_parity:
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    r.read()
                scrapes.append(time.perf_counter() - t)
            except (OSError, http.client.HTTPException):  # not serving yet, or closing at the end
                pass
            time.sleep(max(0.0, scrape_every - (time.perf_counter() - t)))
        else:
            time.sleep(0.05)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"bench_prometheus: interleaved run failed ({proc.returncode}): {err[-2000:]}")
    times = {r["step"]: r["step_time_s"] for r in map(json.loads, metrics.read_text().splitlines())
             if "step_time_s" in r}
    halves: dict[str, list[float]] = {"scraped": [], "unscraped": []}
    for step, t in times.items():
        window, at = divmod(step - 1, WINDOW)  # steps count from 1
        if window == 0 or at in (0, WINDOW - 1):  # compilation; the window edges (the log lags a step)
            continue
        halves["scraped" if window % 2 == scraped_parity else "unscraped"].append(t)
    return {k: statistics.median(v) for k, v in halves.items()} | {
        "scrapes": len(scrapes), "scrape_s": statistics.median(scrapes) if scrapes else None,
        "steps_per_half": [len(halves["scraped"]), len(halves["unscraped"])]}


def loop_side_cost_s(calls: int = 20000) -> float:
    """Seconds per step of the Exporter's loop-thread hooks (a real Exporter, serving on loopback)."""
    from jaxtrain.observe.prometheus import Exporter
    exporter = Exporter(port=free_port(), addr="127.0.0.1", run="bench").start()
    values = {"loss": 2.5, "grad_norm": 1.0, "loss_scale": 1.0, "skipped": 0.0}
    record = {"tokens_per_sec": 1e4, "mfu": 0.3, "tflops_per_device": 0.1, "step_time_s": 1.8}
    try:
        t = time.perf_counter()
        for step in range(calls):
            exporter.on_step(step, values)
            exporter.on_record(record)
            exporter.on_iteration(1.8, 0.001)
        return (time.perf_counter() - t) / calls
    finally:
        exporter.close()


def interleaved(args: argparse.Namespace) -> None:
    load_start = os.getloadavg()[0]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run("off", 2, tmp / "warm", tmp / "cache", args.scrape_every)  # fills the compilation cache
        for r in range(args.rounds):
            rounds.append(interleaved_round(args.steps, tmp / f"run{r}", tmp / "cache", args.scrape_every, r % 2))
            print(json.dumps({"round": r, **rounds[-1]}), file=sys.stderr)
    loop_s = loop_side_cost_s()
    scraped = statistics.median(x["scraped"] for x in rounds)
    unscraped = statistics.median(x["unscraped"] for x in rounds)
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores", "mode": "interleaved", "steps": args.steps, "window": WINDOW,
        "rounds": args.rounds, "scrape_every_s": args.scrape_every,
        "load": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "scraped_step_s": round(scraped, 5), "unscraped_step_s": round(unscraped, 5),
        "scrape_overhead": round(scraped / unscraped - 1, 4),
        "per_round_overhead": [round(x["scraped"] / x["unscraped"] - 1, 4) for x in rounds],
        "scrape_s": round(statistics.median(x["scrape_s"] for x in rounds if x["scrape_s"]), 5),
        "loop_side_s_per_step": round(loop_s, 8), "loop_side_fraction": round(loop_s / unscraped, 7)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="N: the short run's steps (the long one: 3N)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes")
    parser.add_argument("--interleaved", action="store_true", help="scraped vs unscraped windows of one process")
    args = parser.parse_args()
    if args.interleaved:
        return interleaved(args)
    load_start = os.getloadavg()[0]
    variants = ("off", "on", "health")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run("off", 2, tmp / "warm", tmp / "cache", args.scrape_every)  # fills the compilation cache
        for r in range(args.rounds):
            order = list(variants[r % 3:] + variants[:r % 3])
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
        **{f"{v}_{k}": round(med(v, k), 5) for v in variants for k in ("wall_step_s", "own_step_s")},
        "scrapes": sum(x["scrapes"] for x in results["on"]),
        "scrape_s": round(statistics.median(x["scrape_s"] for x in results["on"] if x["scrape_s"]), 5),
    }
    for v in ("on", "health"):
        for k in ("wall_step_s", "own_step_s"):
            summary[f"overhead_{v}_{k.split('_')[0]}"] = round(summary[f"{v}_{k}"] / summary[f"off_{k}"] - 1, 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
