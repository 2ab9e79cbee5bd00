"""The evaluator (evaluation.py) and the throughput accounting (throughput.py), each alone."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.data import build_eval_data
from jaxtrain.observe import throughput
from jaxtrain.observe.throughput import Throughput
from jaxtrain.train.evaluation import Evaluator
from jaxtrain.trainer import Trainer

TINY = str(Path(__file__).resolve().parents[2] / "configs/tiny.yaml")


def test_eval_loss_is_the_mean_cross_entropy_of_the_model_on_the_eval_batches(tmp_path):
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "checkpoint.compilation_cache_dir=null",
                             "model.num_layers=1", "data.global_batch_size=4", "data.seq_len=16",
                             "train.eval_every=3", "train.eval_batches=2"])
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    trainer.step()
    evaluator = Evaluator(cfg, trainer.layout, 0, 1)
    assert [s for s in range(1, 10) if evaluator.due(s)] == [3, 6, 9]
    got = evaluator.evaluate(trainer.state["params"])

    # Independently: the model's logits, a log-softmax in float64, the loss mask.
    model, data = trainer.model(), build_eval_data(cfg, 0, 1)
    total, count = 0.0, 0.0
    for _ in range(2):
        b = next(data)
        logits = np.asarray(model(b["tokens"], b["positions"], b["segment_ids"]), np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, np.asarray(b["targets"])[..., None], -1)[..., 0]
        total += float((nll * b["loss_mask"]).sum())
        count += float(np.sum(b["loss_mask"]))
    if hasattr(data, "close"):
        data.close()
    assert count > 0 and got == pytest.approx(total / count, rel=1e-5)
    assert evaluator.evaluate(trainer.state["params"], num_batches=1) != got  # the batch count is honoured


def test_throughput_divides_the_time_between_log_points_by_the_steps(monkeypatch):
    clock = iter([100.0, 106.0, 106.5, 110.5])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    t = Throughput(flops_per_step=4e12, peak_flops_per_device=1e12, num_devices=2, step=10)  # mark at 100 s
    r = t.record(13, tokens=300.0)  # 3 steps in 6 s
    assert r["step_time_s"] == 2.0 and r["tokens_per_sec"] == 150.0
    assert r["tflops_per_device"] == 1.0 and r["mfu"] == 1.0
    t.exclude(13)  # 0.5 s of evaluation is not step time
    assert t.record(14, tokens=100.0)["step_time_s"] == 4.0
