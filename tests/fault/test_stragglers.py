"""Straggler verdicts: who is named, from the per-process busy times of one window, and on real 2- and
4-process jobs (gloo) where one process is slowed and where nothing is slow but saves and a resume
make processes wait on each other."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import read_jsonl
from test_fault import launch

from jaxtrain.fault.stragglers import slow_processes


def named(busy, factor=1.5, wall=None) -> list[int]:
    wall = np.full(len(busy), 1.0) if wall is None else wall
    return [p for p, _ in slow_processes(np.array(busy), wall, factor)]


def test_two_processes_the_slow_one_is_compared_with_the_other():
    # With both in the median (their mean), no process can be twice the median: factor 2 named nobody.
    assert named([0.05, 0.55], factor=2.0) == [1]
    assert named([0.55, 0.05], factor=2.0) == [0]
    assert named([0.30, 0.32], factor=1.5) == []


@pytest.mark.parametrize("slow", [0, 1, 2, 3])
def test_four_processes_exactly_the_slow_one_is_named(slow):
    busy = [0.10, 0.11, 0.12, 0.10]
    busy[slow] = 0.40
    assert named(busy) == [slow]
    reference = dict(slow_processes(np.array(busy), np.ones(4), 1.5))[slow]
    assert reference == pytest.approx(float(np.median(np.delete(busy, slow))))


def test_three_processes_one_slow_and_a_healthy_spread():
    assert named([0.1, 0.5, 0.12]) == [1]
    assert named([0.1, 0.13, 0.12]) == []


def test_milliseconds_are_not_a_straggler_whatever_the_ratio():
    # 10x the others, but a hundredth of a step: not what makes the job wait.
    assert named([0.001, 0.01, 0.001, 0.001], wall=np.full(4, 1.0)) == []
    assert named([0.001, 0.2, 0.001, 0.001], wall=np.full(4, 1.0)) == [1]


def stragglers(out) -> list[dict]:
    return [e for e in read_jsonl(out / "events.jsonl", missing_ok=True) if e["kind"] == "straggler"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_a_slowed_process_is_named_at_factor_two(tmp_path, child_env, processes):
    slow = processes - 1
    r = launch(child_env, tmp_path / "run", "train.steps=13", "fault.straggler_every=4", "fault.straggler_factor=2",
               f"chaos.slow_process={slow}", "chaos.slow_seconds=0.3", processes=processes)
    assert r.returncode == 0, r.stderr[-3000:]
    reports = stragglers(tmp_path / "run")
    assert len(reports) >= 2 and {e["process"] for e in reports} == {slow}, reports
    assert all(e["busy_s"] >= 0.3 and e["factor"] > 2 for e in reports)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_saves_and_a_resume_name_nobody(tmp_path, child_env, processes=2):
    """Saves every step (barriers, all-finite) and a resume: processes wait on each other, none is slow."""
    out = tmp_path / "run"
    common = ["fault.straggler_every=2", "checkpoint.every_steps=1"]
    first = launch(child_env, out, "train.steps=5", *common, processes=processes)
    assert first.returncode == 0, first.stderr[-3000:]
    second = launch(child_env, out, "train.steps=11", *common, processes=processes)
    assert second.returncode == 0, second.stderr[-3000:]
    assert any(e["kind"] == "resume" for e in read_jsonl(out / "events.jsonl", missing_ok=True))
    assert stragglers(out) == []


def test_one_slow_window_is_a_blip_two_running_are_a_straggler():
    """A process is reported once it is slow in PERSIST_WINDOWS windows running, then in every window it
    stays slow; a fast window in between starts the count again."""
    import jax
    from jax.sharding import Mesh

    from jaxtrain.config import FaultConfig
    from jaxtrain.fault.stragglers import PERSIST_WINDOWS, Stragglers

    assert PERSIST_WINDOWS == 2
    events = []
    s = Stragglers(FaultConfig(straggler_every=4), Mesh(np.array(jax.devices()[:1]), ("data",)), 0, 3,
                   ["a", "b", "c"], lambda kind, step, **kw: events.append((step, kw["process"], kw["windows"])))
    fast, slow = [0.1, 0.1, 0.1], [0.1, 0.5, 0.1]
    for step, busy in enumerate([slow, fast, slow, slow, slow, fast, slow], start=1):
        s._judge(step, np.array([[b, 0.0, 4, 1.0] for b in busy]))
    assert events == [(4, 1, 2), (5, 1, 3)], events
    assert s.reports[1] == 2 and s.slow_windows[1] == 1
