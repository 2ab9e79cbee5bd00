"""Config changes on resume (jaxtrain/train/config_changes.py): a rerun on an existing run directory
that changes what was already trained is refused (exit 2, one line, nothing written) unless
`run.allow_changes` names the keys; harmless changes are accepted; every change is a
`config_changed` event. `optim.decay_steps` extends a finished run without re-stretching its schedule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import TINY, read_jsonl

from jaxtrain.config import ConfigError, load_config
from jaxtrain.train import config_changes
from jaxtrain.train.config_changes import Change, check_changes, diff_configs, refusal_message
from jaxtrain.train.optim import learning_rate_schedule
from jaxtrain.trainer import Trainer

# The cheapest run: 4 steps of a one-layer model, warmup of one step so the cosine part is real.
SMALL = ["train.steps=4", "train.log_every=1", "optim.warmup_steps=1", "model.num_layers=1", "model.d_model=32",
         "model.mlp_dim=64", "data.global_batch_size=8", "data.seq_len=32"]


def cfg_of(out: Path | None = None, *extra: str):
    where = [f"run.output_dir={out}"] if out is not None else []
    return load_config(TINY, [*SMALL, "checkpoint.compilation_cache_dir=null", *where, *extra])


def snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of the run directory: its bytes and mtime (nanoseconds)."""
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))
            if p.is_file()}


# ---------------------------------------------------------------------------- the diff, unit tests


def test_diff_lists_changed_dotted_keys_sorted():
    old, new = cfg_of().to_dict(), cfg_of(None, "train.steps=8", "model.d_model=64", "mesh.data=1").to_dict()
    assert diff_configs(old, new) == [Change("mesh.data", -1, 1), Change("model.d_model", 32, 64),
                                      Change("train.steps", 4, 8)]
    assert diff_configs(old, old) == []
    assert str(Change("train.steps", 4, 8)) == "train.steps 4 -> 8"
    assert str(Change("data.path", None, "x.txt")) == "data.path null -> x.txt"


def test_diff_takes_missing_stored_keys_as_defaults_and_ignores_gone_keys_and_consent():
    new = cfg_of(None, "run.allow_changes=all").to_dict()
    old = json.loads(json.dumps(cfg_of().to_dict()))  # as a checkpoint's extra holds it
    del old["optim"]["decay_steps"]  # saved before the key existed: it held its default (null)
    old["optim"]["gone_key"] = 1  # a key this version no longer has
    assert diff_configs(old, new) == []
    del old["model"]["d_model"]  # the default (128) differs from the run's 32: a change
    assert diff_configs(old, new) == [Change("model.d_model", 128, 32)]


@pytest.mark.parametrize("override", ["train.log_every=5", "train.eval_every=2", "checkpoint.every_steps=2",
                                      "checkpoint.keep_last=1", "fault.hang_timeout_s=30", "chaos.kill_at_step=3",
                                      "observe.prometheus_port=9400", "mesh.data=1", "mesh.fsdp=2",
                                      "model.attention=pallas", "data.prefetch=4", "precision.growth_interval=10",
                                      "train.steps=8 optim.decay_steps=4"])
def test_harmless_changes_are_not_refused(override):
    stored = cfg_of().to_dict()
    changes, refused = check_changes(stored, cfg_of(None, *override.split()), step=4)
    assert changes and refused == []


@pytest.mark.parametrize("override", ["model.mlp_dim=96", "model.num_kv_heads=4", "data.seed=1",
                                      "data.global_batch_size=16", "data.seq_len=16", "data.shuffle=false",
                                      "optim.learning_rate=1e-3", "optim.warmup_steps=2", "optim.weight_decay=0.1",
                                      "precision.policy=bf16", "run.seed=1", "train.steps=3",
                                      "optim.decay_steps=8"])
def test_changes_of_what_was_trained_are_refused(override):
    changes, refused = check_changes(cfg_of().to_dict(), cfg_of(None, override), step=4)
    assert [c.key for c, _ in refused] == [override.split("=")[0]]


def test_longer_train_steps_names_the_learning_rate_jump_and_the_ways_on():
    stored, cfg = cfg_of().to_dict(), cfg_of(None, "train.steps=8")
    _, refused = check_changes(stored, cfg, step=4)
    (change, why), = refused
    old_lr = float(learning_rate_schedule(cfg_of())(3))  # the update of step 4 used count 3
    new_lr = float(learning_rate_schedule(cfg)(4))
    assert new_lr > old_lr * 1.5  # re-stretched: the rate climbs back up
    assert why == (f"the learning-rate schedule would be re-stretched from 4 to 8 steps: the learning rate would "
                   f"jump from {old_lr:.2e} at step 4 to {new_lr:.2e} at step 5")
    message = refusal_message(refused, stored, cfg, 4, "checkpoint 4")
    assert "\n" not in message
    assert "train.steps 4 -> 8" in message and why in message
    assert "optim.decay_steps=4" in message and "run.allow_changes=[train.steps]" in message


def test_allowed_keys():
    assert config_changes.allowed_keys(cfg_of()) == set()
    assert config_changes.allowed_keys(cfg_of(None, "run.allow_changes=[train.steps]")) == {"train.steps"}
    assert config_changes.allowed_keys(cfg_of(None, "run.allow_changes=all")) is None
    assert config_changes.allowed_keys(cfg_of(None, "run.allow_changes=[all]")) is None


def test_allow_changes_names_only_known_keys():
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        cfg_of(None, "run.allow_changes=[train.step]")
    with pytest.raises(ConfigError, match="list of dotted keys or `all`"):
        cfg_of(None, "run.allow_changes=everything")
    with pytest.raises(ConfigError, match="optim.decay_steps"):
        cfg_of(None, "optim.decay_steps=0")


def test_decay_steps_holds_the_final_rate_past_its_end():
    pinned = learning_rate_schedule(cfg_of(None, "train.steps=8", "optim.decay_steps=4"))
    plain = learning_rate_schedule(cfg_of())
    assert [float(pinned(i)) for i in range(5)] == [float(plain(i)) for i in range(5)]
    assert float(pinned(7)) == float(plain(4)) == pytest.approx(3e-3 * 0.1)


# ---------------------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoint at step 4), copied by each test that changes it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    trainer = Trainer(cfg_of(out), devices=jax.devices()[:1])
    trainer.fit()
    trainer.close()
    return out


def copy_run(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished), str(out)], check=True)  # -a: mtimes kept
    # config.yaml and the checkpoint's extra name the original directory; only run.output_dir differs
    return out


def train_cli(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}", *SMALL,
           "checkpoint.compilation_cache_dir=null", *extra, "--cpu-devices", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_longer_rerun_of_a_finished_run_is_refused_untouched_then_accepted_with_consent(finished, tmp_path):
    out = copy_run(finished, tmp_path)
    before = snapshot(out)
    r = train_cli(out, "train.steps=8")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "train.steps 4 -> 8" in r.stderr and "re-stretched" in r.stderr and "run.allow_changes" in r.stderr
    assert "optim.decay_steps=4" in r.stderr
    assert snapshot(out) == before  # config.yaml, events, metrics and checkpoints: same bytes, same mtimes

    r = train_cli(out, "train.steps=8", "run.allow_changes=[train.steps]")
    assert r.returncode == 0, r.stderr[-3000:]
    changed = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "config_changed"]
    assert len(changed) == 1 and changed[0]["step"] == 4 and changed[0]["consented"] == ["train.steps"]
    assert {"key": "train.steps", "old": 4, "new": 8} in changed[0]["changes"]
    assert load_config(out / "config.yaml").train.steps == 8  # the new resolved config
    assert max(m["step"] for m in read_jsonl(out / "metrics.jsonl")) == 8


def test_extending_with_decay_steps_keeps_the_final_learning_rate(finished, tmp_path):
    out = copy_run(finished, tmp_path)
    trainer = Trainer(cfg_of(out, "train.steps=6", "optim.decay_steps=4"), devices=jax.devices()[:1])
    trainer.fit()
    trainer.close()
    lrs = {m["step"]: m["learning_rate"] for m in read_jsonl(out / "metrics.jsonl")}
    assert lrs[5] == lrs[6] == pytest.approx(3e-3 * 0.1)  # the schedule's end, held
    changed = next(e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "config_changed")
    assert changed["consented"] == [] and {c["key"] for c in changed["changes"]} == {"train.steps", "optim.decay_steps",
                                                                           "run.output_dir"}  # (a copy)


def test_harmless_change_is_accepted_and_recorded(finished, tmp_path):
    out = copy_run(finished, tmp_path)
    trainer = Trainer(cfg_of(out, "train.log_every=2"), devices=jax.devices()[:1])
    assert trainer.resumed_from == 4
    trainer.close()
    changed = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "config_changed"]
    assert len(changed) == 1 and changed[0]["compared_with"] == "checkpoint 4"
    assert {"key": "train.log_every", "old": 1, "new": 2} in changed[0]["changes"]
    assert load_config(out / "config.yaml").train.log_every == 2


def test_decide_on_a_run_directory_applies_consent(finished):
    """Process 0's verdict, read from the checkpoint's extra (config.yaml when there is no persistent one)."""
    def decide(*extra: str, persistent: int | None = 4) -> dict:
        return config_changes.decide(cfg_of(finished, *extra), str(finished / "checkpoints"), 4, persistent)

    assert decide() == {"changes": [], "consented": [], "source": "checkpoint 4", "refused": ""}
    assert decide(persistent=None)["source"] == "the run's config.yaml"
    both = ("train.steps=8", "model.mlp_dim=96")
    refused = decide(*both)["refused"]
    assert "train.steps 4 -> 8" in refused and "model.mlp_dim 64 -> 96" in refused
    assert "run.allow_changes=[model.mlp_dim,train.steps]" in refused and "optim.decay_steps" not in refused
    assert "model.mlp_dim" in decide(*both, "run.allow_changes=[train.steps]")["refused"]
    verdict = decide(*both, "run.allow_changes=[train.steps,model.mlp_dim]")
    assert verdict["refused"] == "" and verdict["consented"] == ["model.mlp_dim", "train.steps"]
    assert decide(*both, "run.allow_changes=all")["refused"] == ""


def test_model_change_is_refused_before_anything_is_written(finished, tmp_path):
    out = copy_run(finished, tmp_path)
    before = snapshot(out)
    with pytest.raises(ConfigError) as e:
        Trainer(cfg_of(out, "model.mlp_dim=96"), devices=jax.devices()[:1])
    assert "model.mlp_dim 64 -> 96" in str(e.value) and "run.allow_changes=[model.mlp_dim]" in str(e.value)
    assert snapshot(out) == before
