"""Data pipeline throughput: tokens/s the iterator produces, next to what a training step consumes.

  python bench/bench_data.py [--tokens 16000000] [--batches 200]

Measures, on one process:
  1. the packed-batch iterator alone (no prefetch: the pure production rate) at the cpu-tiny
     shape (seq 256, batch 8, vocab 32000) and at a GPU-sized shape (seq 4096, batch 16),
     and this process's share when 4 processes split the batch;
  2. how long `next()` waits (last_wait_s) with prefetch=2 behind a simulated 50 ms step;
  3. `prepare-data` with the bytes tokenizer on Python's standard library (MB/s of text).
The token files are freshly written, so they sit in the page cache: this is the warm-cache rate.
Prints a markdown table for docs/data.md.
"""

from __future__ import annotations

import argparse
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxtrain.config import load_config
from jaxtrain.data import build_train_data
from jaxtrain.data.prepare import prepare
from jaxtrain.data.sources import write_meta

VOCAB = 32000


def make_corpus(path: Path, num_tokens: int) -> None:
    """Random ids < VOCAB with an eod every ~800 tokens (geometric document lengths)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB - 1, num_tokens, dtype=np.uint16)
    eod = VOCAB - 1
    tokens[rng.random(num_tokens) < 1 / 800] = eod
    path.mkdir(parents=True)
    tokens.astype("<u2").tofile(path / "tokens-00000.bin")
    write_meta(path / "meta.json", dtype="uint16", eod_id=eod, vocab_size=VOCAB, max_id=int(tokens.max()),
               tokenizer="synthetic", files={"tokens-00000.bin": num_tokens},
               num_documents=int((tokens == eod).sum()))


def iterator_rate(corpus: Path, seq_len: int, batch: int, batches: int, process_count: int = 1) -> float:
    """Tokens/s of this process's rows, produced synchronously (prefetch 0)."""
    cfg = load_config(None, ["data.source=tokens", f"data.path={corpus}", f"model.vocab_size={VOCAB}",
                             f"model.max_seq_len={seq_len}", f"data.seq_len={seq_len}",
                             f"data.global_batch_size={batch}", "data.prefetch=0"])
    it = build_train_data(cfg, 0, process_count)
    next(it)  # warm up (Grain graph, first pages)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    dt = time.perf_counter() - t0
    it.close()
    return batches * (batch // process_count) * seq_len / dt


def wait_behind_step(corpus: Path, step_s: float, steps: int) -> tuple[float, float]:
    """Mean and max last_wait_s with prefetch=2 when each step takes `step_s`."""
    cfg = load_config(None, ["data.source=tokens", f"data.path={corpus}", f"model.vocab_size={VOCAB}",
                             "model.max_seq_len=256", "data.seq_len=256", "data.global_batch_size=8",
                             "data.prefetch=2"])
    it = build_train_data(cfg)
    next(it)
    waits = []
    for _ in range(steps):
        time.sleep(step_s)  # the "training step"; the prefetch thread works meanwhile
        next(it)
        waits.append(it.last_wait_s)
    it.close()
    return float(np.mean(waits)), float(np.max(waits))


def prepare_rate(tmp: Path) -> tuple[float, float, int]:
    """MB/s and tokens/s of prepare-data (bytes tokenizer) on the stdlib's top-level .py files."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(Path(stdlib).glob("*.py"))
    size = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    s = prepare([f"{stdlib}/*.py"], str(tmp / "stdlib"), progress=open("/dev/null", "w"))
    dt = time.perf_counter() - t0
    return size / dt / 1e6, s["num_tokens"] / dt, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16_000_000, help="size of the synthetic token corpus")
    ap.add_argument("--batches", type=int, default=200, help="batches timed per measurement")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        corpus = tmp / "tok"
        make_corpus(corpus, args.tokens)
        rows = [
            ("iterator, cpu-tiny shape (seq 256 x batch 8), prefetch 0",
             f"{iterator_rate(corpus, 256, 8, args.batches):,.0f} tokens/s"),
            ("iterator, seq 4096 x batch 16, prefetch 0",
             f"{iterator_rate(corpus, 4096, 16, max(args.batches // 10, 5)):,.0f} tokens/s"),
            ("iterator, seq 4096 x batch 16, this process's 1/4 share",
             f"{iterator_rate(corpus, 4096, 16, max(args.batches // 10, 5), process_count=4):,.0f} tokens/s"),
        ]
        mean_w, max_w = wait_behind_step(corpus, 0.05, 40)
        rows.append(("next() wait behind a 50 ms step, prefetch 2 (mean / max)",
                     f"{mean_w * 1e3:.2f} ms / {max_w * 1e3:.2f} ms"))
        mb_s, tok_s, size = prepare_rate(tmp)
        rows.append((f"prepare-data, bytes tokenizer, stdlib *.py ({size / 1e6:.1f} MB)",
                     f"{mb_s:.1f} MB/s ({tok_s:,.0f} tokens/s)"))
        print("| measurement | result |\n|---|---|")
        for name, value in rows:
            print(f"| {name} | {value} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
