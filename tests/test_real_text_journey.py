"""The new user's journey on real text, through the CLI only, with the flags `jaxtrain train` sets:
docstrings of the Python standard library (real prose, documents of every length) -> a BPE
tokenizer trained here -> `jaxtrain prepare-data` -> `jaxtrain train` on configs/tiny.yaml with only
data, vocabulary, length, steps, evaluation and a checkpoint every 10 steps set -> `jaxtrain goodput`
(data wait under 1% of the wall time) -> `jaxtrain export-hf`
-> transformers loads tokenizer and model and greedy generation stops at end-of-text.

Every default that touches a healthy run is in play: the spike guard and rollback (a checkpoint every
10 steps makes a false spike cost a rollback, as it did in the trial), evaluation over the whole
held-out set, the export's tokenizer and special ids.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY, read_jsonl
from real_text import EOT, stdlib_sources, train_tokenizer

VOCAB = 1024


def docstrings(files: list[Path]) -> list[str]:
    """Every module, class and function docstring of `files` with at least 40 characters."""
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
                    out.append(doc)
    return out


def jaxtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The `jaxtrain` command as a user runs it (its own XLA flags, one process, the CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=900)


@pytest.mark.slow
def test_real_text_from_tokenizer_to_a_model_that_stops_at_end_of_text(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    docs = docstrings(stdlib_sources(3_000_000))
    held = docs[::10]
    kept = [d for i, d in enumerate(docs) if i % 10]
    for name, part in (("train", kept), ("eval", held)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for d in part:
                f.write(json.dumps({"text": d}) + "\n")
    (tmp_path / "train.txt").write_text("\n\n".join(kept))
    train_tokenizer([tmp_path / "train.txt"], tmp_path / "tokenizer.json", VOCAB)
    for name in ("train", "eval"):
        done = jaxtrain("prepare-data", "--input", f"{name}.jsonl", "--output", f"data/{name}",
                        "--tokenizer", "tokenizer.json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr

    run = jaxtrain("train", "--config", TINY, "run.output_dir=run", "data.source=tokens", "data.path=data/train",
                   "data.eval=data/eval", f"model.vocab_size={VOCAB}", "data.seq_len=128", "model.max_seq_len=128",
                   "train.steps=400", "train.eval_every=100", "checkpoint.every_steps=10", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    events = read_jsonl(tmp_path / "run/events.jsonl")
    kinds = [e["kind"] for e in events]
    assert not {"spike", "rollback", "rollback_unavailable", "nonfinite_skipped"} & set(kinds), \
        [e for e in events if e["kind"] in ("spike", "rollback", "rollback_unavailable")]
    evals = [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in read_jsonl(tmp_path / "run/metrics.jsonl")
             if "eval_loss" in r]
    assert [s for s, _, _ in evals] == [100, 200, 300, 400]
    meta = json.loads((tmp_path / "data/eval/meta.json").read_text())
    # The whole set: every token is a target once, except each document's first (nothing precedes it).
    assert all(tokens == meta["num_tokens"] - meta["num_documents"] for _, _, tokens in evals), (evals, meta)
    losses = [loss for _, loss, _ in evals]
    # Falls by over half a nat; four passes over a small set may flatten it but never push it back up.
    assert losses[-1] < losses[0] - 0.5 and all(b < a + 0.05 for a, b in zip(losses, losses[1:])), losses
    # Data loading is never what a step waits on (issue #40): under 1% of the run's wall time waits for a batch.
    report = jaxtrain("goodput", "run", "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    report = json.loads(report.stdout)
    assert report["parts"]["data_wait_s"] < 0.01 * report["wall_s"], (report["parts"], report["wall_s"])

    exported = jaxtrain("export-hf", "run", "--output", "hf", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    eot = tokenizer.convert_tokens_to_ids(EOT)
    assert model.generation_config.eos_token_id == eot == meta["eod_id"]

    # Prompts: short training docstrings without their last 3 tokens (after 400 steps, ~4 passes over
    # the set, the model has seen them end). The free greedy continuation (a plain loop over the
    # model's logits, no stopping rule) must reach end-of-text for some of them; `generate` must then
    # stop exactly there, with the same tokens before it.
    budget, tried = 40, 0
    for doc in kept:
        ids = tokenizer(doc, return_tensors="pt").input_ids
        if not 8 <= ids.shape[1] <= 100:
            continue
        ids, tried = ids[:, :-3], tried + 1
        free = ids
        with torch.no_grad():
            for _ in range(budget):
                nxt = model(free).logits[:, -1].argmax(-1, keepdim=True)
                free = torch.cat([free, nxt], dim=1)
        continuation = free[0, ids.shape[1]:].tolist()
        if eot in continuation:
            break
        assert tried < 40, "greedy decoding reached end-of-text for none of 40 training docstrings"
    end = continuation.index(eot)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=budget, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == continuation[:end + 1]
    assert out.shape[1] < ids.shape[1] + budget  # it stopped, not ran out
