"""End to end through the CLI: prepare-data on real text (Python's standard library), then
`jaxtrain train` on the token files; the loss falls and eval runs. Bad data exits 2 cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TINY = ["--cpu-devices", "1", "train.steps=30", "train.log_every=5", "train.eval_every=15", "train.eval_batches=2",
        "optim.learning_rate=3e-3", "optim.warmup_steps=5", "optim.weight_decay=0.0", "model.vocab_size=260",
        "model.d_model=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=16",
        "model.mlp_dim=256", "model.max_seq_len=128", "model.attention=xla", "data.source=tokens",
        "data.seq_len=64", "data.global_batch_size=8", "checkpoint.save_at_end=false",
        "checkpoint.compilation_cache_dir=null"]


def jaxtrain(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def stdlib_tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib")
    train = jaxtrain("prepare-data", "--input", f"{STDLIB}/json/*.py", f"{STDLIB}/email/*.py",
                     "--output", str(root / "train"))
    assert train.returncode == 0, train.stderr
    assert "wrote" in train.stdout and "tokens" in train.stdout
    held = jaxtrain("prepare-data", "--input", str(STDLIB / "textwrap.py"), "--output", str(root / "eval"))
    assert held.returncode == 0, held.stderr
    return root


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("run:\n  name: data-e2e\n")
    return path


@pytest.mark.slow
def test_loss_falls_on_prepared_stdlib_text(stdlib_tokens, config, tmp_path):
    run = tmp_path / "run"
    r = jaxtrain("train", "--config", str(config), *TINY, f"data.path={stdlib_tokens / 'train'}",
                 f"data.eval={stdlib_tokens / 'eval'}", f"run.output_dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [rec["loss"] for rec in records if "loss" in rec]
    # Bytes of Python source: ln(260) = 5.6 nats at init; 30 steps of a tiny model get well below.
    assert losses[-1] < losses[0] - 1.0, losses
    evals = [rec["eval_loss"] for rec in records if rec.get("eval_loss") is not None]
    assert evals and all(0 < e < losses[0] for e in evals), records


@pytest.mark.slow
@pytest.mark.parametrize("bad, key", [
    ("data.path={tmp}/missing", "data.path"),
    ("data.eval={tmp}/missing", "data.eval"),
    ("model.vocab_size=200", "model.vocab_size"),
])
def test_bad_data_exits_2_with_one_line_and_writes_nothing(stdlib_tokens, config, tmp_path, bad, key):
    run = tmp_path / "run"
    r = jaxtrain("train", "--config", str(config), *TINY, f"data.path={stdlib_tokens / 'train'}",
                 f"run.output_dir={run}", bad.format(tmp=tmp_path))
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error")]
    assert len(errors) == 1 and key in errors[0] and "Traceback" not in r.stderr, r.stderr
    assert not run.exists()
