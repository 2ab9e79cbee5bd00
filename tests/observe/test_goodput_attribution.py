"""Goodput attribution: a known amount of time spent in one activity lands in its part only.

(The parts always add up to the wall time by construction, since `other_s` is the remainder, so a
sum check cannot catch a misattribution; these tests put a known time into one place and look
for it there and nowhere else.)
"""

from __future__ import annotations

import json
import time

import jax
import pytest
from helpers import TINY
from test_goodput import write_run

from jaxtrain.config import load_config
from jaxtrain.observe.goodput import goodput
from jaxtrain.train.evaluation import Evaluator
from jaxtrain.trainer import Trainer




def line(step: int, step_time_s: float = 1.0, **extra) -> dict:
    return {"step": step, "time": 10.0 + step, "step_time_s": step_time_s, "data_wait_s": 0.0, "skipped": False,
            "skipped_steps": 0, **extra}


def test_evaluation_queued_inside_a_step_interval_is_booked_once(tmp_path):
    """Steps 1-4 take 1 s each; queueing the evaluation of step 2 took 0.6 s, which the trainer's
    clock put into step 1's line (1.6 s), and waiting for its result 0.4 s (outside step time). The
    evaluation is 1.0 s of eval_s, and the steps keep exactly their 4 s."""
    events = [{"time": 0.0, "step": 0, "kind": "start", "started_at": 0.0, "compile_s": 0.0},
              {"time": 5.0, "step": 4, "kind": "done"}]
    metrics = [line(1, 1.6), line(2, eval_loss=2.0, eval_s=1.0, eval_dispatch_s=0.6), line(3), line(4)]
    parts = goodput(write_run(tmp_path / "run", events, metrics))["parts"]
    assert parts["eval_s"] == pytest.approx(1.0)
    assert parts["productive_s"] == pytest.approx(4.0)
    assert parts["other_s"] == pytest.approx(0.0, abs=1e-9)


def test_the_last_attempts_hang_is_a_hang(tmp_path):
    """One attempt, never restarted: steps 1-2 (2 s), then it stood still 20 s until the watchdog
    fired at 22; 1 s more to exit. That is 20 s of hang_s, not other_s."""
    events = [{"time": 0.0, "step": 0, "kind": "start", "started_at": 0.0, "compile_s": 0.0},
              {"time": 22.0, "step": 2, "kind": "hang", "process": 0, "host": "a", "phase": "step", "stalled_s": 20.0},
              {"time": 23.0, "step": 2, "kind": "hang_exit"}]
    parts = goodput(write_run(tmp_path / "run", events, [line(1), line(2)]))["parts"]
    assert parts["hang_s"] == pytest.approx(20.0)
    assert parts["other_s"] == pytest.approx(1.0)
    assert parts["productive_s"] == pytest.approx(2.0)


@pytest.mark.slow
def test_a_known_sleep_in_evaluation_lands_in_eval_s_only(tmp_path, monkeypatch):
    """A real run: every evaluation's dispatch sleeps 0.5 s more (as a first compile would). All of
    it is evaluation; none of it is productive training."""
    sleep, evals = 0.5, 3
    real = Evaluator.dispatch

    def slow(self, params, num_batches=None, router_bias=None):
        time.sleep(sleep)
        return real(self, params, num_batches, router_bias)

    monkeypatch.setattr(Evaluator, "dispatch", slow)
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "model.num_layers=1", "data.global_batch_size=8",
                             "data.seq_len=32", "checkpoint.compilation_cache_dir=null", "train.steps=12",
                             "train.log_every=1", "train.eval_every=4", "train.eval_batches=1",
                             "checkpoint.save_at_end=false"])
    t = Trainer(cfg, write_files=True, devices=jax.devices()[:1])
    try:
        t.fit()
    finally:
        t.close()
    report = goodput(tmp_path)
    parts = report["parts"]
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_loss" in m for m in metrics) == evals
    assert parts["eval_s"] >= evals * sleep
    # The steps alone (no evaluation in them) ran much faster than the sleeps: with the dispatch
    # booked in step time too, productive_s would hold the sleeps and eval_s would be cut short.
    step_only = sum(m["step_time_s"] for m in metrics) - sum(m.get("eval_dispatch_s", 0.0) for m in metrics)
    assert parts["productive_s"] + parts["data_wait_s"] + parts["checkpoint_s"] <= step_only + 1e-6
    assert parts["productive_s"] < report["wall_s"] - parts["startup_s"] - evals * sleep
