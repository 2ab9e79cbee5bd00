"""A mixture through `jaxtrain train` on real text: per-component counts in metrics.jsonl, SIGKILL and the same
command resume bitwise, and a changed mixture on resume refused unless consented (then a new order from there).

Two components of different sources: the standard library's prepared token files (`tokens`) and held-out
modules as .txt files tokenized at open (`text`), both with the tokenizer trained on it at test time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY, read_jsonl
from real_text import make_real_text

STEPS = 12


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return make_real_text(tmp_path_factory.mktemp("real"), vocab_size=512, max_bytes=600_000)


def mixture(real, text_weight: float = 1.0) -> str:
    return (f"data.mixture=[{{path: '{real.train}', weight: 3, name: stdlib, source: tokens}}, "
            f"{{path: '{real.eval_files[0].parent}', weight: {text_weight}, name: held, source: text}}]")


def cmd(out: Path, real, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
            "data.source=tokens", f"data.tokenizer={real.tokenizer}", f"model.vocab_size={real.vocab_size}",
            f"train.steps={STEPS}", "train.log_every=1", "checkpoint.every_steps=3", "model.num_layers=1",
            "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8", "data.seq_len=32",
            *extra, "--cpu-devices", "1"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=600, env=env)


def losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}


@pytest.mark.slow
def test_mixture_resumes_bitwise_and_counts_components(real, tmp_path):
    whole = tmp_path / "whole"
    r = run(*cmd(whole, real, mixture(real)))
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_jsonl(whole / "metrics.jsonl")
    assert [m["step"] for m in records] == list(range(1, STEPS + 1))
    for m in records:
        assert sum(m["data_rows"].values()) == 8 and set(m["data_rows"]) == {"stdlib", "held"}
    last = records[-1]["data_tokens"]
    assert sum(last.values()) == STEPS * 8 * 32
    assert 0.5 < last["stdlib"] / sum(last.values()) < 0.95  # weight 3 of 4, over 96 rows

    killed = tmp_path / "killed"
    k = run(*cmd(killed, real, mixture(real), "chaos.kill_at_step=10"))
    assert k.returncode == -signal.SIGKILL
    again = run(*cmd(killed, real, mixture(real), "chaos.kill_at_step=10"),
                env={**os.environ, "JAXTRAIN_RESTART_ATTEMPT": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    resumes = [e for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"]
    assert resumes, ([e["kind"] for e in read_jsonl(killed / "events.jsonl")], again.stderr[-2000:])
    restored = resumes[0]["restored_step"]
    assert restored in (6, 9)  # step 9's write may still be in flight when the kill comes
    got, ref = losses(killed), losses(whole)
    assert all(got[s] == ref[s] for s in range(restored + 1, STEPS + 1)), (got, ref)  # bitwise
    assert read_jsonl(killed / "metrics.jsonl")[-1]["data_tokens"] == last

    # A changed mixture: refused in one line (exit 2) unless consented; then it runs on from the checkpoint.
    longer = [f"train.steps={STEPS + 4}", "run.allow_changes=[train.steps]"]
    refused = run(*cmd(whole, real, mixture(real, text_weight=3.0), *longer))
    assert refused.returncode == 2 and "data.mixture" in refused.stderr and "Traceback" not in refused.stderr
    consented = run(*cmd(whole, real, mixture(real, text_weight=3.0), f"train.steps={STEPS + 4}",
                         "run.allow_changes=[train.steps, data.mixture]"))
    assert consented.returncode == 0, consented.stderr[-3000:]
    assert "data.mixture changed since the checkpoint" in consented.stderr
    assert max(losses(whole)) == STEPS + 4


@pytest.mark.slow
def test_a_mixture_killed_on_one_process_resumes_on_two_with_the_same_batches(real, tmp_path, child_env):
    """Killed on one process (two devices), resumed by `jaxtrain launch` as two processes of one device each: the
    same mesh, so each step after the restored one draws the rows the uninterrupted run drew (the per-component
    counts equal, step by step) and the losses follow it (the reductions cross processes: compared within 1e-5)."""
    def args(out: Path, *extra: str) -> list[str]:
        return cmd(out, real, mixture(real), *extra)[4:-2]  # `train`'s own arguments, without --cpu-devices

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    env = {k: v for k, v in child_env.items() if k != "CACHE"}
    r = run(sys.executable, "-m", "jaxtrain", "train", *args(whole), "--cpu-devices", "2", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    k = run(sys.executable, "-m", "jaxtrain", "train", *args(killed, "chaos.kill_at_step=10"), "--cpu-devices", "2",
            env=env)
    assert k.returncode == -signal.SIGKILL, k.stderr[-3000:]
    two = run(sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "2", "--cpu-devices", "1",
              "--max-restarts", "0", "--", "train", *args(killed), env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    resumes = [e for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"]
    assert resumes and resumes[-1]["restored_step"] in (6, 9), [e["kind"] for e in read_jsonl(killed / "events.jsonl")]
    restored = resumes[-1]["restored_step"]
    got = {m["step"]: m for m in read_jsonl(killed / "metrics.jsonl")}
    ref = {m["step"]: m for m in read_jsonl(whole / "metrics.jsonl")}
    for s in range(restored + 1, STEPS + 1):
        assert got[s]["data_rows"] == ref[s]["data_rows"], (s, got[s]["data_rows"], ref[s]["data_rows"])
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5), (s, got[s]["loss"], ref[s]["loss"])
    assert got[STEPS]["data_tokens"] == ref[STEPS]["data_tokens"]
