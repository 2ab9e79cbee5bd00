"""Learning-rate schedules (jaxtrain/train/schedules.py): each schedule's rate at every update count
equals a hand-written float64 formula, cosine is bitwise what optim.py computed before, and a WSD run
extended in its stable phase keeps everything already trained (config_changes.py's rerun rules)."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import TINY, read_jsonl

from jaxtrain.config import ConfigError, load_config
from jaxtrain.train.config_changes import check_changes
from jaxtrain.train.schedules import learning_rate_schedule, schedule_steps, wsd_decay_steps

PEAK, RATIO, WARMUP, STEPS = 3e-3, 0.1, 3, 13


def cfg_of(*extra: str):
    return load_config(TINY, [f"train.steps={STEPS}", f"optim.warmup_steps={WARMUP}", f"optim.learning_rate={PEAK}",
                              f"optim.min_lr_ratio={RATIO}", "checkpoint.compilation_cache_dir=null", *extra])


def reference(schedule: str, t: int, *, warmup: int = WARMUP, total: int = STEPS, decay: int = 0,
              shape: str = "linear") -> float:
    """The rate at update count t, in float64, from the formulas of docs/optim.md."""
    peak, end = PEAK, PEAK * RATIO
    if t < warmup:
        return peak * t / warmup
    p = min(t - warmup, total - warmup) / (total - warmup)
    if schedule == "cosine":
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * p))
    if schedule == "linear":
        return peak + (end - peak) * p
    if schedule == "constant":
        return peak
    start = total - decay
    if t < start:
        return peak
    q = min(t - start, decay) / decay
    f = {"linear": 1 - q, "cosine": 0.5 * (1 + math.cos(math.pi * q)), "sqrt": 1 - math.sqrt(q)}[shape]
    return end + (peak - end) * f


def assert_matches(schedule, want) -> None:
    """Every count of the schedule and 4 past its end, eager and jitted, against `want(t)`, within fp32
    rounding (a few ulps of the peak)."""
    counts = range(STEPS + 5)
    got = np.array([float(schedule(t)) for t in counts])
    jitted = jax.jit(schedule)
    assert [float(jitted(np.int32(t))) for t in counts] == pytest.approx(list(got), abs=4e-7 * PEAK)
    np.testing.assert_allclose(got, [want(t) for t in counts], rtol=0, atol=4e-7 * PEAK)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_follows_its_formula(schedule):
    assert_matches(learning_rate_schedule(cfg_of(f"optim.schedule={schedule}")), lambda t: reference(schedule, t))


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
@pytest.mark.parametrize("decay", [5, 10, 0])
def test_wsd_follows_its_formula(shape, decay):
    cfg = cfg_of("optim.schedule=wsd", f"optim.wsd_decay_steps={decay}", f"optim.wsd_decay_shape={shape}")
    d = decay or STEPS // 5  # 0: a fifth of the schedule
    assert wsd_decay_steps(cfg) == d
    schedule = learning_rate_schedule(cfg)
    assert_matches(schedule, lambda t: reference("wsd", t, decay=d, shape=shape))
    # the stable phase is the peak exactly, the end the final rate exactly (float32)
    assert {float(schedule(t)) for t in range(WARMUP, STEPS - d + 1)} == {float(np.float32(PEAK))}  # start incl.
    assert float(schedule(STEPS + 100)) == float(np.float32(PEAK * RATIO))


def test_schedules_without_warmup_and_with_decay_steps():
    cfg = cfg_of("optim.warmup_steps=0", "optim.schedule=wsd", "optim.wsd_decay_steps=4", "optim.decay_steps=10",
                 "train.steps=20")
    assert schedule_steps(cfg) == (0, 10)
    schedule = learning_rate_schedule(cfg)
    assert [float(schedule(t)) for t in range(12)] == pytest.approx(
        [reference("wsd", t, warmup=0, total=10, decay=4) for t in range(12)], abs=4e-7 * PEAK)
    linear = learning_rate_schedule(cfg_of("optim.warmup_steps=0", "optim.schedule=linear"))
    assert float(linear(0)) == pytest.approx(PEAK) and float(linear(STEPS)) == pytest.approx(PEAK * RATIO)


def test_cosine_is_bitwise_the_schedule_runs_used_before():
    """optim.py's schedule before optim.schedule existed, on tiny.yaml's own settings and a short one."""
    for cfg in (load_config(TINY), cfg_of()):
        o = cfg.optim
        total = o.decay_steps if o.decay_steps is not None else cfg.train.steps
        warmup = min(o.warmup_steps, total)
        before = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=o.learning_rate, warmup_steps=warmup,
                                                    decay_steps=max(total, warmup + 1),
                                                    end_value=o.learning_rate * o.min_lr_ratio)
        now = jax.jit(learning_rate_schedule(cfg))
        counts = np.arange(total + 10, dtype=np.int32)
        assert np.array_equal(np.array([now(c) for c in counts[:40]]), np.array([jax.jit(before)(c) for c in counts[:40]]))
        assert np.array_equal(np.asarray(learning_rate_schedule(cfg)(counts)), np.asarray(before(counts)))


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("overrides, message", [
    (["optim.schedule=wsd", "optim.wsd_decay_steps=-1"], "'optim.wsd_decay_steps' must be >= 0"),
    (["optim.schedule=wsd", "optim.wsd_decay_steps=11"],
     "optim.wsd_decay_steps=11 after optim.warmup_steps=3 is longer than the schedule's 13 steps"),
    (["optim.schedule=wsd", "optim.wsd_decay_steps=4", "optim.decay_steps=6"], "longer than the schedule's 6 steps"),
    (["optim.wsd_decay_steps=4"], "'optim.wsd_decay_steps' is a WSD key: it needs optim.schedule=wsd, not cosine"),
    (["optim.schedule=linear", "optim.wsd_decay_shape=sqrt"], "needs optim.schedule=wsd, not linear"),
    (["optim.schedule=wsd", "optim.wsd_decay_shape=exp"], "optim.wsd_decay_shape"),
    (["optim.schedule=step"], "optim.schedule"),
])
def test_bad_schedule_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        cfg_of(*overrides)
    assert message in str(e.value) and "\n" not in str(e.value)
    cfg_of("optim.schedule=wsd", "optim.wsd_decay_steps=10")  # warmup + decay = the length: fits


def test_wsd_decay_longer_than_the_run_exits_2_with_one_line(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
                        "train.steps=12", "optim.schedule=wsd", "optim.wsd_decay_steps=40", "--cpu-devices", "1"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "optim.wsd_decay_steps=40" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------- rerun rules, unit level

WSD = ["optim.schedule=wsd", "optim.wsd_decay_steps=4", "train.steps=12", "optim.warmup_steps=2"]


@pytest.mark.parametrize("step, extra, refused", [
    (6, ["train.steps=20"], []),  # stable phase (decay at counts 8..12): extended freely
    (9, ["train.steps=20"], []),  # counts 0..8 all at the peak still (8: the decay's start, f(0) = 1)
    (10, ["train.steps=20"], ["train.steps"]),  # count 9 decayed already under the old schedule
    (12, ["train.steps=20"], ["train.steps"]),  # after the decay
    (6, ["train.steps=10"], []),  # an earlier cool-down, decided in the stable phase
    (6, ["optim.wsd_decay_steps=6"], []),  # a longer decay, not started yet
    (1, ["train.steps=20"], []),  # in the warmup
    (6, ["optim.wsd_decay_shape=sqrt"], ["optim.wsd_decay_shape"]),  # any other optim key: consent
    # the schedule itself always needs consent (the decay's length here changes no rate used yet)
    (6, ["optim.schedule=constant", "optim.wsd_decay_steps=0"], ["optim.schedule"]),
    (6, ["optim.decay_steps=20"], []),
])
def test_wsd_rerun_rules(step, extra, refused):
    changes, why = check_changes(cfg_of(*WSD).to_dict(), cfg_of(*WSD, *extra), step=step)
    assert changes and [c.key for c, _ in why] == refused


def test_cosine_and_linear_length_changes_after_warmup_stay_refused():
    for schedule in ("cosine", "linear"):
        old = cfg_of(f"optim.schedule={schedule}", "train.steps=12", "optim.warmup_steps=2")
        new = cfg_of(f"optim.schedule={schedule}", "train.steps=20", "optim.warmup_steps=2")
        _, why = check_changes(old.to_dict(), new, step=6)
        (change, reason), = why
        assert change.key == "train.steps" and "re-stretched from 12 to 20 steps" in reason
    constant = [cfg_of("optim.schedule=constant", f"train.steps={n}") for n in (12, 20)]
    assert check_changes(constant[0].to_dict(), constant[1], step=10)[1] == []


# ---------------------------------------------------------------------------- whole runs (CLI)

RUN = [*WSD, "train.log_every=1", "checkpoint.every_steps=4", "checkpoint.keep_last=10",
       "checkpoint.async_save=false", "model.num_layers=1",  # synchronous: checkpoint 4 is there at the kill
       "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8", "data.seq_len=32"]


def train_cli(out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
           f"checkpoint.compilation_cache_dir={cache}", *RUN, *extra, "--cpu-devices", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def metrics(out: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_jsonl(out / "metrics.jsonl")}  # later lines win


@pytest.mark.slow
def test_extending_a_wsd_run_in_its_stable_phase_keeps_what_was_trained(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "xla_cache"
    # 12 steps (decay over the updates of steps 9..12), killed after step 6: checkpoint 4 is in the stable phase.
    killed = train_cli(out, cache, "chaos.kill_at_step=6")
    assert killed.returncode == -9, killed.stderr[-3000:]
    first = metrics(out)
    assert max(first) >= 5  # the metrics of step 6 may not have been written before the kill
    checkpoint_4 = hashes(out / "checkpoints" / "4")
    lines_before = (out / "metrics.jsonl").read_text().splitlines()

    # The same run resumed with train.steps=16: no consent needed.
    resumed = train_cli(out, cache, "train.steps=16")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert hashes(out / "checkpoints" / "4") == checkpoint_4  # the checkpoint trained before, bitwise
    assert (out / "metrics.jsonl").read_text().splitlines()[:len(lines_before)] == lines_before
    now = metrics(out)
    assert sorted(now) == list(range(1, 17))
    for step in range(5, max(first) + 1):  # redone from checkpoint 4 under the new config: the same steps
        assert now[step]["loss"] == first[step]["loss"] and now[step]["learning_rate"] == first[step]["learning_rate"]
    lrs = [now[s]["learning_rate"] for s in range(1, 17)]
    assert lrs[2:13] == [pytest.approx(PEAK)] * 11  # stable until the update of step 13 (count 12)
    assert lrs[13:] == pytest.approx([reference("wsd", t, warmup=2, total=16, decay=4) for t in (13, 14, 15)])
    changed = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "config_changed"]
    assert len(changed) == 1 and changed[0]["consented"] == [] and changed[0]["step"] == 4
    assert {c["key"] for c in changed[0]["changes"]} == {"train.steps", "chaos.kill_at_step"}

    # After the decay: extending, or changing the schedule, needs consent (one line, exit 2, nothing written).
    before = hashes(out)
    for extra in (["train.steps=20"], ["optim.schedule=cosine", "optim.wsd_decay_steps=0", "train.steps=16"]):
        r = train_cli(out, cache, *extra)
        assert r.returncode == 2, r.stderr[-3000:]
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "run.allow_changes" in r.stderr and extra[0].split("=")[0] in r.stderr
        assert hashes(out) == before
    r = train_cli(out, cache, "optim.schedule=cosine", "optim.wsd_decay_steps=0", "train.steps=17",
                  "run.allow_changes=[optim.schedule,optim.wsd_decay_steps,train.steps]")
    assert r.returncode == 0, r.stderr[-3000:]
    assert max(metrics(out)) == 17
