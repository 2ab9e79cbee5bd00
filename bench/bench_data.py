"""Data throughput: tokens/s each source produces on one CPU core, beside what the cpu-tiny step consumes.

    python bench/bench_data.py [--max-bytes 3000000] [--vocab 8192] [--seconds 3] [--short 3 --long 11]
                               [--core N] [--out FILE.json]

Real text made at bench time from files on the machine: the Python standard library's top-level
modules (empty ones left out) and their docstrings, a byte-level BPE trained on them with
`tokenizers`, written as every source: token files (`prepare-data`), .txt files and a .jsonl file
(tokenized at open), ArrayRecord (`prepare-data --output-format arrayrecord`, and JSON text records),
Parquet and a `datasets.Dataset.save_to_disk` folder (a text column and a token column each), and
chat rows (the docstrings as assistant replies, `data.format=chat`, a ChatML template).

Each source is measured in its own child process pinned to one core (`os.sched_setaffinity`, one
thread for Eigen, tokenizers/rayon and OpenMP) with the cpu-tiny batch shape and `data.prefetch=0`,
so the producer itself is timed, not a prefetch thread on another core:
  - open, cold: `build_train_data(cfg)` plus the first batch with an empty token cache (text tokenized in the
    child, `data.tokenize_workers=0`, and written to the cache; token files and token columns only read lengths
    or ids); open, warm: the same with the cache the cold open left (what a restart or resume pays);
  - steady state: `next()` for `--seconds`, tokens/s = batches x batch x seq_len / time (padding
    positions included: they are what the step consumes).
Beside each own timer, the outside wall clock of the child processes (T: the faster of two runs):
open = T(open only) - T(a child that only imports jaxtrain.data), so it also holds the format's library
imports and the exit; rate = batches x tokens / (T(timed run) - T(warm open only)): both open from the warm cache.

The consumer: `jaxtrain train --config configs/bench/cpu-tiny.yaml --cpu-devices 1` on the token files
(real text, all cores, its own XLA flags), run for --short and --long steps: tokens/s = 2048 / the
loop's median `step_time_s` (own), (long - short) x 2048 / (T(long) - T(short)) (outside); and the
goodput report's data-wait share of the long run. The ratio source / consumer has a target of >= 10x.

Prints progress and a markdown table to stderr, one JSON line (everything) last on stdout.
docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
CPU_TINY = REPO / "configs/bench/cpu-tiny.yaml"
EOT = "<|endoftext|>"
TARGET = 10.0
# The child's threads: one core by affinity; these keep thread pools from sizing themselves to the machine.
ONE_THREAD_ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=1",
                  "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1",
                  "OMP_NUM_THREADS": "1"}
# A ChatML template whose replies are `{% generation %}` blocks (the loss mask comes from them).
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
                 "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ---- the corpus ---------------------------------------------------------------------------------------


def stdlib_sources(max_bytes: int) -> list[Path]:
    """Non-empty top-level modules of this interpreter's standard library (sorted, no symlinks), up to max_bytes."""
    lib = Path(os.path.dirname(json.__path__[0]))
    files, total = [], 0
    for f in sorted(lib.glob("*.py")):
        if f.is_symlink() or not f.is_file() or f.stat().st_size == 0 or total + f.stat().st_size > max_bytes:
            continue
        files.append(f)
        total += f.stat().st_size
    return files


def docstrings(files: list[Path]) -> list[tuple[str, str]]:
    """(name, docstring) of every module, class and function of `files` with a docstring of >= 40 characters."""
    out = []
    for f in files:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    out.append((f"{f.stem}.{getattr(node, 'name', '')}".rstrip("."), doc))
    return out


def train_tokenizer(files: list[Path], path: Path, vocab_size: int) -> None:
    """A byte-level BPE (GPT-2 style) with `<|endoftext|>` as id 0, trained on `files`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    tok.save(str(path))


def build_corpus(root: Path, args: argparse.Namespace) -> tuple[dict, list[str]]:
    """Every source's files under `root`: {name: (data.* overrides)}, and notes on what could not be written."""
    from jaxtrain.data import documents
    from jaxtrain.data.prepare import prepare

    files = stdlib_sources(args.max_bytes)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    (root / "txt").mkdir()
    for f, text in zip(files, texts):
        (root / "txt" / f"{f.stem}.txt").write_text(text, encoding="utf-8")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tokenizer = root / "tokenizer.json"
    train_tokenizer(list((root / "txt").glob("*.txt")), tokenizer, args.vocab)
    quiet = open(os.devnull, "w")
    summary = prepare([str(root / "txt")], str(root / "tokens"), tokenizer=str(tokenizer), progress=quiet)
    info = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "tokens": summary["num_tokens"],
            "documents": summary["num_documents"], "vocab": args.vocab}
    from tokenizers import Tokenizer
    ids = [e.ids for e in Tokenizer.from_file(str(tokenizer)).encode_batch(texts, add_special_tokens=False)]

    tok = [f"data.tokenizer={tokenizer}"]
    sources: dict[str, list[str]] = {
        "tokens (prepare-data)": ["data.source=tokens", f"data.path={root / 'tokens'}"],
        "text, .txt files": ["data.source=text", f"data.path={root / 'txt'}", *tok],
        "text, .jsonl": ["data.source=text", f"data.path={root / 'docs.jsonl'}", *tok],
    }
    notes = []
    records = hasattr(documents, "open_documents")
    if not records:
        notes.append("arrayrecord, parquet, hf_datasets: jaxtrain.data.documents has no open_documents yet")
    if records and "output_format" in inspect.signature(prepare).parameters:
        prepare([str(root / "txt")], str(root / "ar-tokens"), tokenizer=str(tokenizer), progress=quiet,
                output_format="arrayrecord")
        sources["arrayrecord (prepare-data --output-format arrayrecord)"] = [
            "data.source=arrayrecord", f"data.path={root / 'ar-tokens'}", *tok]
    elif records:
        notes.append("arrayrecord token records: prepare-data has no --output-format arrayrecord yet")
    if records:
        from array_record.python.array_record_module import ArrayRecordWriter
        (root / "ar-json").mkdir()
        writer = ArrayRecordWriter(str(root / "ar-json/part-00000.arrayrecord"), "group_size:1")
        for t in texts:
            writer.write(json.dumps({"text": t}).encode())
        writer.close()
        sources["arrayrecord, JSON text records"] = ["data.source=arrayrecord", f"data.path={root / 'ar-json'}", *tok]

        import pyarrow as pa
        import pyarrow.parquet as pq
        table = pa.table({"text": texts, "tokens": pa.array(ids, pa.list_(pa.int32()))})
        pq.write_table(table, root / "docs.parquet")
        sources["parquet, text column"] = ["data.source=parquet", f"data.path={root / 'docs.parquet'}", *tok]
        sources["parquet, token column"] = ["data.source=parquet", f"data.path={root / 'docs.parquet'}",
                                            "data.tokens_field=tokens", *tok]

        import datasets
        datasets.disable_progress_bars()
        datasets.Dataset.from_dict({"text": texts, "tokens": ids}).save_to_disk(str(root / "hf"))
        sources["hf_datasets, text column"] = ["data.source=hf_datasets", f"data.path={root / 'hf'}", *tok]
        sources["hf_datasets, token column"] = ["data.source=hf_datasets", f"data.path={root / 'hf'}",
                                                "data.tokens_field=tokens", *tok]

    if importlib.util.find_spec("jaxtrain.data.examples") is not None and hasattr(documents, "iter_rows"):
        chats = docstrings(files)[:args.chat_examples]
        with open(root / "chat.jsonl", "w", encoding="utf-8") as fh:
            for name, doc in chats:
                fh.write(json.dumps({"messages": [{"role": "user", "content": f"What is {name}?"},
                                                  {"role": "assistant", "content": doc}]}) + "\n")
        (root / "chatml.jinja").write_text(CHAT_TEMPLATE)
        sources[f"chat ({len(chats):,} docstrings, .jsonl, first_fit)"] = [
            "data.source=text", "data.format=chat", f"data.path={root / 'chat.jsonl'}",
            f"data.chat_template={root / 'chatml.jinja'}", *tok]
        info["chat_examples"] = len(chats)
    else:
        notes.append("chat: jaxtrain.data.examples does not exist yet")
    return {"info": info, "sources": sources}, notes


# ---- one source, in a child pinned to one core ------------------------------------------------------


def child(spec: dict) -> dict:
    """Runs in the child: open, first batch, then `next()` for spec['seconds'] (0: open only)."""
    from jaxtrain.config import load_config
    from jaxtrain.data import build_train_data

    if spec.get("overrides") is None:
        return {}  # the import-only baseline
    cfg = load_config(None, spec["overrides"])
    t0 = time.perf_counter()
    it = build_train_data(cfg)
    first = next(it)
    open_s = time.perf_counter() - t0
    rows, batches, segments = first["tokens"].shape, 0, []
    t0 = time.perf_counter()
    while spec["seconds"] > 0 and (batches % 16 or time.perf_counter() - t0 < spec["seconds"]):
        segments.append(next(it)["segment_ids"])
        batches += 1
    timed_s = time.perf_counter() - t0
    it.close()
    return {"open_s": open_s, "batches": batches, "timed_s": timed_s, "tokens_per_batch": rows[0] * rows[1],
            "real_fraction": (sum(int((s > 0).sum()) for s in segments) / (batches * rows[0] * rows[1])
                              if batches else None),
            "affinity": sorted(os.sched_getaffinity(0))}


def run_child(spec: dict, core: int, cache: Optional[Path] = None) -> tuple[float, dict]:
    """(outside wall seconds, the child's result) of one pinned child process; `cache`: its token cache folder."""
    env = dict(os.environ, **ONE_THREAD_ENV)
    if cache is not None:
        env["JAXTRAIN_DATA_CACHE"] = str(cache)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec), "--core", str(core)]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc={done.returncode}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def measure_source(overrides: list[str], core: int, seconds: float, baseline_s: float, root: Path) -> dict:
    """One source: a cold open-only twice (each into an empty token cache: text is tokenized; the faster counts), a
    warm open-only (the cache of the last cold one: nothing is tokenized) and a timed run, each a pinned child."""
    colds = []
    for k in range(2):
        cache = Path(tempfile.mkdtemp(prefix=f"cache{k}_", dir=root))
        colds.append(run_child({"overrides": overrides, "seconds": 0}, core, cache))
    (opened_wall, opened), _ = sorted(colds, key=lambda x: x[0])
    warm_wall, warm = run_child({"overrides": overrides, "seconds": 0}, core, cache)
    timed_wall, timed = run_child({"overrides": overrides, "seconds": seconds}, core, cache)
    tokens = timed["batches"] * timed["tokens_per_batch"]
    return {"open_s": round(opened["open_s"], 3), "open_outside_s": round(opened_wall - baseline_s, 3),
            "open_warm_s": round(warm["open_s"], 3), "open_warm_outside_s": round(warm_wall - baseline_s, 3),
            "tokens_per_s": round(tokens / timed["timed_s"]),
            "tokens_per_s_outside": round(tokens / max(timed_wall - warm_wall, 1e-9)),  # both open from the warm cache
            "batches": timed["batches"], "non_padding": round(timed["real_fraction"], 4),
            "affinity": timed["affinity"]}


# ---- the consumer: the cpu-tiny step ----------------------------------------------------------------


def train_run(tokens_dir: Path, steps: int, out: Path) -> float:
    """Outside wall seconds of `jaxtrain train` on cpu-tiny with the token files, `steps` steps."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}  # its own flags
    cmd = [sys.executable, "-m", "jaxtrain", "train", "--config", str(CPU_TINY), "--cpu-devices", "1",
           f"train.steps={steps}", "train.log_every=1", f"run.output_dir={out}",
           "checkpoint.compilation_cache_dir=null", "data.source=tokens", f"data.path={tokens_dir}"]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"jaxtrain train exited {done.returncode}:\n{done.stderr[-3000:]}")
    return wall


def measure_step(tokens_dir: Path, root: Path, short: int, long: int, skip: int) -> dict:
    from jaxtrain.observe.goodput import goodput

    t_short = train_run(tokens_dir, short, root / "run-short")
    t_long = train_run(tokens_dir, long, root / "run-long")
    metrics = [json.loads(x) for x in (root / "run-long/metrics.jsonl").read_text().splitlines()]
    per_step = metrics[0]["tokens_per_step"]
    step_s = statistics.median(m["step_time_s"] for m in metrics if m["step"] > skip)
    report, waited = goodput(root / "run-long"), sum(m["data_wait_interval_s"] for m in metrics)
    return {"tokens_per_step": per_step, "step_time_s": round(step_s, 4), "tokens_per_s": round(per_step / step_s, 1),
            "step_time_outside_s": round((t_long - t_short) / (long - short), 4),
            "tokens_per_s_outside": round((long - short) * per_step / (t_long - t_short), 1),
            "steps": [short, long], "wall_s": [round(t_short, 2), round(t_long, 2)],
            "data_wait_s": round(waited, 4), "data_wait_share_of_steps": waited / sum(m["step_time_s"] for m in metrics),
            "goodput_wall_s": round(report["wall_s"], 2), "goodput_data_wait_s": round(report["parts"]["data_wait_s"], 4),
            "goodput_data_wait_share": report["parts"]["data_wait_s"] / report["wall_s"]}


def table(result: dict) -> str:
    step = result["step"]
    lines = ["| source | open s, cold (own / outside) | open s, warm cache (own / outside) | tokens/s, one core "
             "(own / outside) | × step (own / outside) |", "|---|---:|---:|---:|---:|"]
    for name, r in result["sources"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | |")
            continue
        pad = f" ({r['non_padding']:.0%} non-padding)" if r["non_padding"] < 0.999 else ""
        ratio = f"**{r['ratio']:,.0f}×** / {r['ratio_outside']:,.0f}×" if "ratio" in r else "–"
        lines.append(f"| {name} | {r['open_s']:.3f} / {r['open_outside_s']:.2f} | {r['open_warm_s']:.3f} / "
                     f"{r['open_warm_outside_s']:.2f} | {r['tokens_per_s']:,} / "
                     f"{r['tokens_per_s_outside']:,}{pad} | {ratio} |")
    if step:
        lines.append(f"| cpu-tiny step consumes (all cores) | | | {step['tokens_per_s']:,.0f} / "
                     f"{step['tokens_per_s_outside']:,.0f} | target ≥ {TARGET:.0f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=3_000_000, help="standard-library source bytes in the corpus")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained on it")
    parser.add_argument("--chat-examples", type=int, default=4000, help="docstrings turned into chat rows")
    parser.add_argument("--seconds", type=float, default=3.0, help="steady-state time per source")
    parser.add_argument("--short", type=int, default=3, help="steps of the short cpu-tiny run")
    parser.add_argument("--long", type=int, default=11, help="steps of the long cpu-tiny run")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the step-time median")
    parser.add_argument("--no-train", action="store_true", help="sources only (no cpu-tiny runs)")
    parser.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)), help="the core the sources run on")
    parser.add_argument("--out", help="also write the result JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:  # pin before anything starts a thread
        os.sched_setaffinity(0, {args.core})
        for k, v in ONE_THREAD_ENV.items():
            os.environ.setdefault(k, v)
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.long <= args.short or args.short <= args.skip:
        parser.error("need --skip < --short < --long")

    from jaxtrain.config import load_config
    cpu_tiny = load_config(CPU_TINY, [])
    d = cpu_tiny.data
    shape = [f"data.seq_len={d.seq_len}", f"data.global_batch_size={d.global_batch_size}",
             f"model.max_seq_len={d.seq_len}", f"model.vocab_size={cpu_tiny.model.vocab_size}", "data.prefetch=0",
             "data.tokenize_workers=0"]  # one core: tokenized in the child itself, the rate of that core
    started, load_start = time.perf_counter(), loadavg()
    root = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        print(f"building the corpus ({args.max_bytes:,} bytes of the standard library, BPE {args.vocab}) ...",
              file=sys.stderr)
        built, notes = build_corpus(root, args)
        info = built["info"]
        print(f"  {info['files']} files, {info['bytes']:,} bytes, {info['tokens']:,} tokens "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        for n in notes:
            print(f"  skipped: {n}", file=sys.stderr)
        baseline_s = min(run_child({"overrides": None}, args.core)[0] for _ in range(2))
        sources: dict[str, dict] = {}
        for name, overrides in built["sources"].items():
            try:
                sources[name] = measure_source(overrides + shape, args.core, args.seconds, baseline_s, root)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                sources[name] = {"error": str(e)}
            r = sources[name]
            print(f"  {name}: " + (f"failed: {r['error']}" if "error" in r else
                                   f"open {r['open_s']:.2f} s (outside {r['open_outside_s']:.2f}), "
                                   f"{r['tokens_per_s']:,} tokens/s (outside {r['tokens_per_s_outside']:,})"),
                  file=sys.stderr)
        step = None
        if not args.no_train:
            print(f"cpu-tiny on the token files, {args.short} and {args.long} steps, all cores ...", file=sys.stderr)
            step = measure_step(root / "tokens", root, args.short, args.long, args.skip)
        for r in sources.values():
            if step and "error" not in r:
                r["ratio"] = r["tokens_per_s"] / step["tokens_per_s"]
                r["ratio_outside"] = r["tokens_per_s_outside"] / step["tokens_per_s_outside"]
        measured = [r["ratio"] for r in sources.values() if "ratio" in r]
        result = {"bench": "data", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "machine": f"{cpu_model()}, {os.cpu_count()} cores", "python": platform.python_version(),
                  "corpus": info, "shape": {"seq_len": d.seq_len, "global_batch_size": d.global_batch_size},
                  "core": args.core, "seconds": args.seconds, "sources": sources, "skipped": notes, "step": step,
                  "target": TARGET, "min_ratio": min(measured) if measured else None,
                  "met": bool(measured) and min(measured) >= TARGET and not any("error" in r for r in sources.values()),
                  "load_avg_start": load_start, "load_avg_end": loadavg(),
                  "bench_wall_s": round(time.perf_counter() - started, 1)}
        for r in sources.values():
            for k in ("ratio", "ratio_outside"):
                if k in r:
                    r[k] = round(r[k], 1)
        print(table(result), file=sys.stderr)
        if step:
            print(f"cpu-tiny step {step['step_time_s']:.3f} s own / {step['step_time_outside_s']:.3f} s outside; "
                  f"goodput data wait {step['goodput_data_wait_share']:.3%} of {step['goodput_wall_s']:.1f} s "
                  f"({step['data_wait_share_of_steps']:.3%} of step time)", file=sys.stderr)
        print(f"load {load_start} -> {result['load_avg_end']}, {result['bench_wall_s']:.0f} s in all", file=sys.stderr)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
