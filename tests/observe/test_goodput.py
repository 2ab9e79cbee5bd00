"""`jaxtrain goodput`: the breakdown of a run's wall time, from synthetic run files with known answers.

The run below has two attempts: attempt 0 trains steps 1-4 (step 2 skipped, a checkpoint at step 2),
hangs after step 4 until the watchdog fires, and is restarted by the launcher; attempt 1 restores
step 2, re-does steps 3-4, trains to step 6 (an evaluation at step 6) and finishes. Every number is
chosen so that each part can be computed by hand (the comments give the arithmetic). Real runs:
one with a hang (the watchdog) and a restart, here; one with a killed process and a restart in
tests/launch/test_launch.py (the killed-process test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from goodput_run import EVENTS, METRICS, line, write_run
from helpers import TINY

from jaxtrain.config import ConfigError
from jaxtrain.commands.goodput import main
from jaxtrain.observe.goodput import PARTS, goodput


# Attempt 0: window 100..126 = 26 s: start-up 10, steps 4 x 1 s (0.5 s of it checkpoint blocking),
# the rest 12 s: hang 10 (the longest report), restart downtime 2. The steps' 3.5 s are shared out
# by factor 3.5 / 4 = 0.875: step 1 productive (0.9 s + 0.1 s wait), step 2 skipped, steps 3-4 re-done.
# Attempt 1: window 126..134.5 = 8.5 s: start-up 4, steps 4 x 1 s (0.2 s checkpoint), evaluation
# 0.3 s, the tail 0.2 s (other); factor 3.8 / 4 = 0.95, all four steps productive.
WANT = {"startup_s": 10 + 4, "checkpoint_s": 0.5 + 0.2, "hang_s": 10.0, "restart_downtime_s": 2.0,
        "redone_steps_s": 2 * 0.875, "skipped_steps_s": 0.875, "data_wait_s": 0.1 * 0.875 + 4 * 0.1 * 0.95,
        "productive_s": 0.9 * 0.875 + 4 * 0.9 * 0.95, "eval_s": 0.3, "other_s": 0.2}


@pytest.mark.parametrize("timed", [False, True])
def test_parts_of_a_run_with_a_hang_and_a_restart(tmp_path, timed):
    # With `time` on the lines (the trainer writes it) they are placed by time; without, by step order.
    times = [111, 112, 113, 114, 131, 132, 133, 134]
    metrics = [{**m, "time": float(t)} for m, t in zip(METRICS, times)] if timed else METRICS
    report = goodput(write_run(tmp_path / "run", EVENTS, metrics))
    assert report["wall_s"] == pytest.approx(34.5)
    assert set(report["parts"]) == set(PARTS)
    for key, want in WANT.items():
        assert report["parts"][key] == pytest.approx(want, abs=1e-9), key
    assert sum(report["parts"].values()) == pytest.approx(report["wall_s"], abs=1e-9)
    assert report["goodput"] == pytest.approx(WANT["productive_s"] / 34.5)
    assert report["attempts"] == 2 and report["restarts"] == 1 and report["compile_s"] == 9.0
    assert report["steps"] == {"final": 6, "computed": 8, "redone": 2, "skipped": 1.0}
    assert report["stragglers"] == {
        "1": {"host": "b", "reports": 2, "max_ratio": 3.0, "first_step": 2, "last_step": 3},
        "0": {"host": "a", "reports": 1, "max_ratio": 1.6, "first_step": 3, "last_step": 3}}
    assert [(h["process"], h["stalled_s"]) for h in report["hangs"]] == [(1, 10.0), (0, 9.5)]
    assert any("attempt 0: process start estimated" in n for n in report["notes"])


def test_process_start_from_started_at_when_the_trainer_writes_it(tmp_path):
    events = [dict(e) for e in EVENTS]
    events[1]["started_at"] = 95.0  # 5 s of JAX and distributed init before the preflight event
    report = goodput(write_run(tmp_path / "run", events, METRICS))
    assert report["wall_s"] == pytest.approx(39.5) and report["parts"]["startup_s"] == pytest.approx(19.0)
    assert not any("estimated" in n for n in report["notes"])


def test_requeued_attempts_without_launcher_events(tmp_path):
    """SLURM requeue: no `restart` event; the second `preflight` begins an attempt whose process
    start comes from the resume event (131 - 5 = 126), so the numbers are those of the launcher run."""
    events = [e for e in EVENTS if e["kind"] != "restart"]
    report = goodput(write_run(tmp_path / "run", events, METRICS))
    assert report["attempts"] == 2 and report["wall_s"] == pytest.approx(34.5)
    for key, want in WANT.items():
        assert report["parts"][key] == pytest.approx(want, abs=1e-9), key


def test_a_log_interval_covers_several_steps(tmp_path):
    """log_every=2: each line's step time is the mean over the two steps since the last line; a
    restore to step 2 makes the re-logged interval (3, 4] re-done. Skips come from the running count."""
    events = [{"time": 0.0, "step": 0, "kind": "start", "compile_s": 0.0},
              {"time": 4.0, "step": 4, "kind": "restart", "attempt": 1},
              {"time": 5.0, "step": 2, "kind": "start", "compile_s": 0.0},
              {"time": 6.0, "step": 2, "kind": "resume", "restored_step": 2, "restart_to_first_step_s": 1.0},
              {"time": 9.0, "step": 6, "kind": "done"}]
    metrics = [line(2, skipped_steps=1), line(4, skipped_steps=1), line(4, skipped_steps=1), line(6, skipped_steps=2)]
    report = goodput(write_run(tmp_path / "run", events, metrics))
    # Attempt 0 (0..4): steps 1-4, 4 s, nothing else; steps 3-4 are re-done by attempt 1 (4..9):
    # start-up 1 s, steps 3-6, 4 s, of which one of steps 5-6 skipped (the running count 1 -> 2).
    assert report["steps"] == {"final": 6, "computed": 8, "redone": 2, "skipped": 1.0}
    parts = report["parts"]
    assert parts["redone_steps_s"] == pytest.approx(2.0) and parts["skipped_steps_s"] == pytest.approx(1.0)
    assert parts["startup_s"] == pytest.approx(1.0) and parts["restart_downtime_s"] == pytest.approx(0.0)
    assert parts["productive_s"] == pytest.approx(4.5) and parts["data_wait_s"] == pytest.approx(0.5)
    assert sum(parts.values()) == pytest.approx(report["wall_s"]) == 9.0


def test_lines_with_time_are_placed_in_their_attempt_when_step_order_cannot_tell(tmp_path):
    """log_every=2, a checkpoint at step 5, a crash after it: the new attempt's first line (step 6)
    is above the old attempt's last (4), so step order alone would take it for attempt 0 covering
    steps 5-6. Its time puts it in attempt 1, covering step 6 only (restored from 5)."""
    events = [{"time": 0.0, "step": 0, "kind": "start", "compile_s": 0.0},
              {"time": 10.0, "step": 4, "kind": "restart", "attempt": 1},
              {"time": 11.0, "step": 5, "kind": "start", "compile_s": 0.0},
              {"time": 12.0, "step": 5, "kind": "resume", "restored_step": 5, "restart_to_first_step_s": 2.0},
              {"time": 13.0, "step": 6, "kind": "done"}]
    metrics = [line(2, time=2.0), line(4, time=4.0), line(6, time=12.5)]
    report = goodput(write_run(tmp_path / "run", events, metrics))
    parts = report["parts"]
    # attempt 0 (0..10): steps 1-4, 4 s, then 6 s down; attempt 1 (10..13): start-up 1, step 6, tail 1
    assert report["steps"]["computed"] == 5 and parts["restart_downtime_s"] == pytest.approx(6.0)
    assert parts["startup_s"] == pytest.approx(1.0) and parts["other_s"] == pytest.approx(1.0)
    assert parts["productive_s"] == pytest.approx(4.5) and parts["data_wait_s"] == pytest.approx(0.5)
    untimed = goodput(write_run(tmp_path / "untimed", events, [line(2), line(4), line(6)]))
    assert untimed["steps"]["computed"] == 6  # the guess: steps 5-6 in attempt 0


def test_data_wait_summed_over_the_interval_when_the_line_has_it(tmp_path):
    events = [{"time": 0.0, "step": 0, "kind": "start", "compile_s": 0.0}, {"time": 2.0, "step": 2, "kind": "done"}]
    plain = goodput(write_run(tmp_path / "a", events, [line(2)]))["parts"]
    summed = goodput(write_run(tmp_path / "b", events, [line(2, data_wait_interval_s=0.5)]))["parts"]
    assert plain["data_wait_s"] == pytest.approx(0.2)  # the logged step's 0.1 s, taken for both steps
    assert summed["data_wait_s"] == pytest.approx(0.5) and summed["productive_s"] == pytest.approx(1.5)


def test_cli_text_and_json(tmp_path, capsys):
    run = write_run(tmp_path / "run", EVENTS, METRICS)
    assert main([str(run)]) == 0
    text = capsys.readouterr().out
    assert "wall time" in text and "restart downtime" in text and "goodput" in text
    assert "straggler: process 1 (b): 2 report(s), steps 2-3, up to 3.00x the median" in text
    assert "hang: process 1 (b) stood still 10.0 s in phase step after step 4" in text
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "goodput", str(run), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)) == {"run_dir", "wall_s", "goodput", "parts", "compile_s", "attempts", "restarts",
                                         "isolations", "steps", "stragglers", "hangs", "notes"}


def test_not_a_run_directory_is_a_user_error(tmp_path):
    with pytest.raises(ConfigError, match="no events.jsonl"):
        goodput(tmp_path)
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "goodput", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no events.jsonl" in r.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_real_run_with_a_hang_and_a_restart(tmp_path):
    """2 processes: process 1 hangs after step 4 (chaos.hang_at_step), the watchdogs fire after 3 s,
    the launcher restarts the job, which resumes from the step-3 checkpoint and finishes. The hang
    shows as hang_s (at least the timeout), the restart as one restart; the parts add up."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXTRAIN_RESTART_ATTEMPT")}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "2", "--cpu-devices", "1",
                        "--max-restarts", "1", "--grace-period-s", "2", "--", "train", "--config", TINY,
                        "train.steps=8", "train.log_every=1", "data.global_batch_size=8", "checkpoint.every_steps=3",
                        "checkpoint.async_save=false", "fault.hang_timeout_s=3", "chaos.hang_at_step=4",
                        "chaos.hang_process=1", f"run.output_dir={out}",
                        f"checkpoint.compilation_cache_dir={tmp_path / 'xla_cache'}"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = goodput(out)
    parts = report["parts"]
    assert report["restarts"] == 1 and report["hangs"] and report["steps"]["final"] == 8
    assert 3.0 <= parts["hang_s"] <= max(h["stalled_s"] for h in report["hangs"])
    assert sum(parts.values()) == pytest.approx(report["wall_s"], abs=1e-6)
    assert parts["productive_s"] > 0 and parts["startup_s"] > 0 and parts["other_s"] < 0.2 * report["wall_s"]
