"""The evaluator (evaluation.py) and the throughput accounting (throughput.py), each alone."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY

from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import build_eval_data
from jaxtrain.observe import throughput
from jaxtrain.observe.throughput import Throughput
from jaxtrain.train.evaluation import Evaluator, eval_batch_plan
from jaxtrain.trainer import Trainer



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


# A held-out set of two raw token files (no eod: a row is a plain window of the stream, cut only where
# the second file starts). 345 tokens -> 344 targets in rows of 16 -> 22 rows: 5 full global batches
# of 4 rows and a sixth with 2 rows (the last one 8 targets long) and 2 padding rows.
EVAL_FILES = (200, 145)
SEQ, BATCH = 16, 4
EVAL_TOKENS = sum(EVAL_FILES) - len(EVAL_FILES)  # every target once, none across the file boundary


def eval_run_cfg(tmp_path: Path, *extra: str):
    """A tokens-source config (1 layer) whose data.eval is the set above."""
    rng = np.random.default_rng(7)
    (tmp_path / "held").mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(EVAL_FILES):
        rng.integers(0, 64, n).astype("<u2").tofile(tmp_path / "held" / f"part-{i}.bin")
    rng.integers(0, 64, 4000).astype("<u2").tofile(tmp_path / "train.bin")
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "checkpoint.compilation_cache_dir=null",
                              "model.num_layers=1", "data.source=tokens", f"data.path={tmp_path / 'train.bin'}",
                              f"data.eval={tmp_path / 'held'}", "data.token_dtype=uint16", "data.eod_id=null",
                              f"data.global_batch_size={BATCH}", f"data.seq_len={SEQ}", *extra])


def reference_eval(model, tmp_path: Path, rows: list[int]) -> tuple[float, int]:
    """(loss sum, tokens) over packed rows `rows` of the held-out set, computed without the data
    pipeline: each row's window of the raw stream, split where a file starts, each piece run through
    the model alone (a causal model needs no padding), a log-softmax in float64."""
    files = [np.fromfile(tmp_path / "held" / f"part-{i}.bin", "<u2").astype(np.int32) for i in range(len(EVAL_FILES))]
    stream, starts = np.concatenate(files), np.cumsum([0, *EVAL_FILES])
    total, count = 0.0, 0
    for r in rows:
        lo, hi = r * SEQ, min(r * SEQ + SEQ + 1, len(stream))
        cuts = [lo] + [int(s) for s in starts[1:-1] if lo < s < hi] + [hi]
        for a, b in zip(cuts[:-1], cuts[1:]):
            piece = stream[a:b]
            if len(piece) < 2:
                continue
            logits = np.asarray(model(piece[None, :-1]), np.float64)[0]
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            total -= float(np.take_along_axis(logp, piece[1:, None], -1).sum())
            count += len(piece) - 1
    return total, count


def test_eval_covers_the_whole_held_out_set_by_default_with_the_partial_batch_exact(tmp_path):
    cfg = eval_run_cfg(tmp_path)
    assert cfg.train.eval_batches == 0  # the default: the whole set
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    trainer.step()
    got = trainer.eval_result()
    total, count = reference_eval(trainer.model(), tmp_path, list(range(22)))
    assert count == EVAL_TOKENS == 343
    assert got.tokens == EVAL_TOKENS
    assert got.loss == pytest.approx(total / count, rel=1e-5)
    assert trainer.evaluate() == got.loss and trainer.evaluate(0) == got.loss  # None and 0: the whole set
    assert trainer.eval_result(50) == got  # a cap above the set's 6 batches is the whole set
    trainer.close()


def test_eval_cap_takes_batches_spread_over_the_set_and_reports_their_tokens(tmp_path):
    assert eval_batch_plan(6, 2) == [1, 4] and eval_batch_plan(6, 3) == [1, 3, 5]
    assert eval_batch_plan(6, 0) == eval_batch_plan(6, 6) == list(range(6))
    assert eval_batch_plan(None, 0) == [0, 1, 2, 3] and eval_batch_plan(None, 2) == [0, 1]  # Markov stream
    cfg = eval_run_cfg(tmp_path, "train.eval_batches=2")
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    trainer.step()
    got = trainer.eval_result()
    rows = [r for b in (1, 4) for r in range(b * BATCH, (b + 1) * BATCH)]
    total, count = reference_eval(trainer.model(), tmp_path, rows)
    assert got.tokens == count == 2 * BATCH * SEQ
    assert got.loss == pytest.approx(total / count, rel=1e-5)
    # The cap that covers the partial batch (batches 1, 3, 5) counts its real targets only.
    third = trainer.eval_result(3)
    rows = [r for b in (1, 3, 5) for r in range(b * BATCH, min((b + 1) * BATCH, 22))]
    total, count = reference_eval(trainer.model(), tmp_path, rows)
    assert third.tokens == count == 64 + 63 + 24  # batch 3 holds the file boundary; batch 5 is rows 20, 21
    assert third.loss == pytest.approx(total / count, rel=1e-5)
    trainer.close()
    with pytest.raises(ConfigError, match="train.eval_batches"):
        eval_run_cfg(tmp_path, "train.eval_batches=-1")


@pytest.mark.parametrize("cap, batches, tokens", [(0, range(6), EVAL_TOKENS), (3, (1, 3, 5), 64 + 63 + 24)])
def test_eval_plan_gives_every_process_the_same_batches_and_every_row_once(tmp_path, cap, batches, tokens):
    """The eval data is sharded per process: each process must run the same batches (else the
    global eval step would not line up) and the processes' rows together cover them once."""
    cfg = eval_run_cfg(tmp_path)
    seen, counted = [], 0.0
    for p in range(2):
        data = build_eval_data(cfg, p, 2, prefetch=0)  # what the Evaluator asks for a spread cap
        assert data.num_batches == 6 and data.local_batch == BATCH // 2
        assert eval_batch_plan(data.num_batches, cap) == list(batches)
        for index in eval_batch_plan(data.num_batches, cap):
            data.skip_batches(index - data.position)  # as Evaluator.dispatch jumps to the next planned batch
            b = next(data)
            counted += float(b["loss_mask"].sum())
            seen += [index * BATCH + int(r) for r, row in zip(data.rows, b["segment_ids"]) if row.any()]
        data.close()
    rows = [r for i in batches for r in range(i * BATCH, min((i + 1) * BATCH, 22))]
    assert sorted(seen) == rows and counted == tokens


def test_data_eval_without_eval_every_is_evaluated_after_the_last_step(tmp_path):
    cfg = eval_run_cfg(tmp_path, "train.steps=2", "train.log_every=1", "train.eval_every=0")
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    assert trainer.fit()["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records}
    assert "eval_loss" not in by_step[1] and "eval_tokens" not in by_step[1]
    assert by_step[2]["eval_tokens"] == EVAL_TOKENS
    assert by_step[2]["eval_loss"] == pytest.approx(trainer.evaluate(), rel=1e-6)  # of the final parameters
    trainer.close()


def test_throughput_divides_the_time_between_log_points_by_the_steps(monkeypatch):
    clock = iter([100.0, 106.0, 106.5, 110.5])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    t = Throughput(flops_per_step=4e12, peak_flops_per_device=1e12, num_devices=2, step=10)  # mark at 100 s
    r = t.record(13, tokens=300.0)  # 3 steps in 6 s
    assert r["step_time_s"] == 2.0 and r["tokens_per_sec"] == 150.0
    assert r["tflops_per_device"] == 1.0 and r["mfu"] == 1.0
    t.exclude(13)  # 0.5 s of evaluation is not step time
    assert t.record(14, tokens=100.0)["step_time_s"] == 4.0


def test_a_whole_set_evaluation_tells_the_watchdog_as_each_batch_is_read(tmp_path):
    """A whole-set evaluation runs between two steps and may outlast fault.hang_timeout_s on a large
    set: it is progress, not a hang. The loop wires the evaluator to the watchdog's `progress`, which
    restarts the current phase's deadline; every batch read back calls it (6 batches x 2 evaluations)."""
    cfg = eval_run_cfg(tmp_path, "train.steps=2", "train.log_every=1", "train.eval_every=1")
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    try:
        assert trainer.evaluator.on_progress == trainer.watchdog.progress
        calls: list[float] = []

        def progress() -> None:
            before = trainer.watchdog._since
            trainer.watchdog.progress()
            calls.append(trainer.watchdog._since - before)

        trainer.evaluator.on_progress = progress
        trainer.fit()
    finally:
        trainer.close()
    assert len(calls) == 2 * 6 and all(d > 0 for d in calls), calls
