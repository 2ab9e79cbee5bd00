"""Config parsing, validation and the frozen contract of DESIGN §4."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, TINY

from jaxtrain.config import ConfigError, MeshConfig, all_keys, load_config


# DESIGN §4: these names are fixed. Renaming or dropping one breaks users, tests and benchmarks.
FIXED_KEYS = {
    "run.name", "run.output_dir", "run.seed", "train.steps", "train.log_every",
    "mesh.data", "mesh.stage", "mesh.fsdp", "mesh.tensor",
    "model.vocab_size", "model.d_model", "model.num_layers", "model.num_heads", "model.num_kv_heads",
    "model.head_dim", "model.mlp_dim", "model.attention",
    "data.source", "data.path", "data.tokenizer", "data.seq_len", "data.global_batch_size",
    "precision.policy", "checkpoint.every_steps",
    "pipeline.microbatches", "pipeline.repeats",
    "precision.loss_scale_init", "precision.growth_interval", "precision.growth_factor",
    "precision.backoff_factor", "precision.min_loss_scale",
    "stability.max_spikes", "stability.window", "stability.spike_threshold", "stability.skip_spikes",
    "stability.skip_batches", "stability.max_rollbacks", "stability.z_loss",
    "fault.hang_timeout_s", "fault.straggler_factor", "fault.straggler_every", "fault.preflight",
    "fault.preflight_factor", "fault.preflight_action", "train.profile_steps",
    "chaos.nan_at_steps", "chaos.spike_at_steps", "chaos.spike_factor", "chaos.kill_at_step",
    "chaos.kill_process", "chaos.hang_at_step", "chaos.hang_process", "chaos.slow_process",
    "chaos.slow_seconds",
}
FIXED_METRICS = {"step", "loss", "grad_norm", "learning_rate", "loss_scale", "step_time_s", "tokens_per_sec",
                 "tflops_per_device", "mfu", "skipped"}
FIXED_VERBS = {"train", "inspect", "prepare-data", "launch", "checkpoints", "goodput", "profile-summary", "preflight",
               "import-hf", "export-hf"}


def test_fixed_keys_exist():
    assert FIXED_KEYS <= set(all_keys())


def test_cli_verbs_exist():
    from jaxtrain.commands.cli import COMMANDS
    assert FIXED_VERBS <= set(COMMANDS)


def test_every_shipped_config_loads():
    configs = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(configs) >= 5
    for path in configs:
        load_config(path)


def test_overrides_and_types():
    cfg = load_config(TINY, ["train.steps=7", "optim.learning_rate=1e-3", "mesh.rules={batch: data}"])
    assert cfg.train.steps == 7 and cfg.optim.learning_rate == 1e-3
    # A partial rules table overrides its entries and keeps the other defaults.
    assert cfg.mesh.rules == {**MeshConfig().rules, "batch": "data"}
    assert load_config(None, ["mesh.rules={mlp: null}"]).mesh.rules["heads"] == "tensor"
    assert MeshConfig(rules={"batch": "data"}).rules == {**MeshConfig().rules, "batch": "data"}  # Python callers too


@pytest.mark.parametrize("overrides, message", [
    (["model.d_modle=64"], "unknown config key 'model.d_modle'; did you mean 'model.d_model'?"),
    (["modle.d_model=64"], "did you mean 'model.d_model'?"),
    (["train.steps=ten"], "config key 'train.steps' expects int, got 'ten'"),
    (["model.attention=flash"], "config key 'model.attention' must be one of auto, xla, pallas, triton, cudnn"),
    (["model.num_heads=6", "model.num_kv_heads=4"], "model.num_heads=6 is not a multiple of model.num_kv_heads=4"),
    (["train.steps"], "not of the form section.key=value"),
    (["data.seq_len=4096"], "data.seq_len=4096 is larger than model.max_seq_len=256"),
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last must be >= 0, got -1"),
    # An infinite loss scale stays infinite after backoff: every fp16 step would be skipped.
    (["precision.loss_scale_init=inf"], "'precision.loss_scale_init' must be a finite number, got inf"),
    (["precision.loss_scale_init=1e39"], "'precision.loss_scale_init' must be positive and fit in float32"),
    (["stability.z_loss=.inf"], "'stability.z_loss' must be a finite number"),
    (["chaos.slow_link=[1, 1]"], "'chaos.slow_link' must be two different process indices"),
])
def test_phase1_errors_name_the_problem(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert message in str(e.value)


def jaxtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("overrides, message", [
    (["model.d_modle=64"], "did you mean 'model.d_model'"),
    (["train.steps=abc"], "expects int"),
    (["mesh.data=3"], "mesh (data=3, stage=1, fsdp=1, expert=1, context=1, tensor=1) multiplies to 3 but there are 8 devices"),
    (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.global_batch_size=6"], "not divisible by the 4-way data parallelism"),
    (["mesh.data=1", "mesh.tensor=8"], "model.num_heads=4 is not divisible by mesh.tensor=8"),
    (["data.source=tokens", "data.path=/nonexistent/corpus.bin"], "/nonexistent/corpus.bin"),
    (["chaos.kill_at_step=3", "chaos.kill_process=1"], "chaos.kill_process=1 names no process of this job"),
    (["chaos.slow_seconds=0.1", "chaos.slow_process=2"], "chaos.slow_process=2 names no process"),
    (["chaos.slow_link=[0, 3]", "chaos.slow_link_seconds=0.1"], "chaos.slow_link[1]=3 names no process"),
    (["chaos.hang_at_step=3", "chaos.hang_process=1"], "chaos.hang_process=1 names no process"),
    (["chaos.crash_process=1"], "chaos.crash_process=1 names no process"),
    (["mesh.rules={lenght: data}"], "unknown logical axis 'lenght'; did you mean 'length'?"),
    (["model.attention=pallas", "mesh.data=2", "mesh.fsdp=4", "mesh.rules={length: fsdp}"],
     "each shard would attend only within its chunk"),
    (["model.sliding_window=4", "mesh.context=2", "mesh.data=4"], "model.sliding_window=4 with mesh.context=2"),
    (["model.num_experts=4", "model.moe_router=sigmoid", "model.moe_norm_topk_prob=false"],
     "model.moe_norm_topk_prob=false is for model.moe_router=softmax"),
    (["model.sliding_window=4", "model.sliding_window_pattern=3", "model.num_layers=6", "mesh.stage=2",
      "pipeline.microbatches=2"], "model.sliding_window_pattern=3 with mesh.stage=2"),
])
def test_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path, overrides, message):
    out = tmp_path / "run"
    result = jaxtrain("train", "--config", TINY, f"run.output_dir={out}", *overrides,
                      "--cpu-devices", "8", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


def test_missing_config_file_exits_2(tmp_path):
    result = jaxtrain("train", "--config", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_overrides_may_stand_before_and_after_flags(tmp_path):
    out = tmp_path / "run"
    result = jaxtrain("train", "--config", TINY, "train.steps=2", "--cpu-devices", "2",
                      f"run.output_dir={out}", "mesh.data=2", "train.log_every=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert load_config(out / "config.yaml").mesh.data == 2
    # stdout is a pipe here, not a terminal: one plain line per logged step, no carriage returns.
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/2", "2/2"] and "\r" not in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--cpu-devices", "0"], "--cpu-devices must be at least 1, got 0"),
    (["--cpu-devices", "two"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, args, message):
    result = jaxtrain("train", "--config", TINY, f"run.output_dir={tmp_path / 'r'}",
                      *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_output_dir_naming_a_file_exits_2_and_leaves_it_alone(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("precious")
    result = jaxtrain("train", "--config", TINY, f"run.output_dir={path}",
                      "--cpu-devices", "1", cwd=tmp_path)
    assert result.returncode == 2 and "is an existing file, not a directory" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and path.read_text() == "precious"


def test_inspect_works_from_shapes_alone_without_data(tmp_path):
    """The README's inspect line: llama3-8b's data path does not exist here, and nothing is allocated
    (its 2-layer, 1.49-billion-parameter state is 18 GB in fp32 with Adam's moments)."""
    result = jaxtrain("inspect", "--config", str(REPO / "configs/llama3-8b.yaml"), "--json", "model.num_layers=2",
                      "--cpu-devices", "8", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["params"] > 1.4e9 and report["flops_per_step"] > 0 and report["mesh"]["fsdp"] == 8
    # fp32 parameters and both Adam moments, each split 8 ways: the arguments are an eighth of the state.
    state_bytes = 4 * report["params"] * 3
    assert state_bytes / 8 <= report["memory_bytes_per_device"]["arguments"] <= 1.01 * state_bytes / 8


def test_cpu_runs_get_the_fast_xla_cpu_flags_unless_the_user_set_them(monkeypatch):
    from jaxtrain.commands import startup
    from jaxtrain.runtime.xla_cpu import YNN_FUSIONS, cpu_xla_flags
    assert YNN_FUSIONS in cpu_xla_flags()  # this machine's jaxlib is one the flags were checked with
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=dot")
    startup.set_cpu_flags(cpu_devices=2)
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_cpu_experimental_ynn_fusion_type=dot" and YNN_FUSIONS not in flags  # the user's wins
    monkeypatch.setenv("XLA_FLAGS", "")
    startup.set_cpu_flags(cpu_devices=2)
    assert YNN_FUSIONS in os.environ["XLA_FLAGS"].split()


@pytest.mark.parametrize("overrides, message", [
    # The markov source evaluates on its own held-out stream: a data.eval path would be ignored.
    (["data.eval=/data/held_out.bin"], "data.eval='/data/held_out.bin' is for the tokens and text sources"),
    # Retention never deletes the newest good checkpoint: 0 would silently keep one.
    (["checkpoint.keep_last=0"], "checkpoint.keep_last=0 is not supported"),
    (["chaos.raise_process=-1"], "config key 'chaos.raise_process' must be >= 0, got -1"),
])
def test_settings_that_would_be_silently_ignored_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_refused_setting_is_one_line_exit_2_and_nothing_written(tmp_path):
    run = tmp_path / "run"
    r = jaxtrain("train", "--config", TINY, "checkpoint.keep_last=0",
                 f"run.output_dir={run}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "checkpoint.keep_last=0" in r.stderr and not run.exists()


def test_chaos_raise_process_must_name_a_process_of_the_job():
    from jaxtrain.parallel.mesh import validate_against_devices
    cfg = load_config(TINY, ["chaos.raise_at_step=3", "chaos.raise_process=1"])
    with pytest.raises(ConfigError, match="chaos.raise_process=1 names no process of this job"):
        validate_against_devices(cfg, 1, 1)


# ----------------------------------------------------------------------------- mesh axes: one list (issue #37)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.context=0"], "config key 'mesh.context' must be a positive size or -1 (fill), got 0"),
    (["mesh.data=-1", "mesh.context=-1"], "only one mesh axis may be -1 (fill with the remaining devices), "
                                          "got mesh.data and mesh.context"),
    (["mesh.dcn_context=-5"], "config key 'mesh.dcn_context' must be a positive size (1 = no DCN split), got -5"),
])
def test_bad_context_sizes_are_one_clear_line_exit_2(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:  # phase 1 already: no devices needed to see these
        load_config(TINY, overrides)
    assert message in str(e.value)
    out = tmp_path / "run"
    r = jaxtrain("train", "--config", TINY, f"run.output_dir={out}", *overrides,
                 "--cpu-devices", "2", cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and not out.exists(), r.stderr


def test_every_mesh_axis_has_its_fields_and_is_validated():
    from jaxtrain.config import DCN_MESH_AXES, MESH_AXES
    from jaxtrain.parallel import mesh, mesh_shape
    assert mesh_shape.AXES == MESH_AXES and mesh.DCN_AXES == DCN_MESH_AXES  # derived, not copied
    fields = {f.name for f in dataclasses.fields(MeshConfig)}
    assert set(MESH_AXES) <= fields and {f"dcn_{a}" for a in DCN_MESH_AXES} <= fields
    # ... and no size field outside the list (every MeshConfig field is an axis, its dcn_*, or the rules)
    assert fields == set(MESH_AXES) | {f"dcn_{a}" for a in DCN_MESH_AXES} | {"rules"}, (
        "a new MeshConfig field: a mesh axis belongs in jaxtrain.config.MESH_AXES, anything else here")
    for axis in MESH_AXES:
        for bad in (0, -2):
            with pytest.raises(ConfigError, match=f"'mesh.{axis}' must be a positive size or -1"):
                load_config(None, [f"mesh.{axis}={bad}"])
        other = next(a for a in MESH_AXES if a != axis)
        with pytest.raises(ConfigError, match="only one mesh axis may be -1"):
            load_config(None, [f"mesh.{axis}=-1", f"mesh.{other}=-1"])
    for axis in DCN_MESH_AXES:
        with pytest.raises(ConfigError, match=f"'mesh.dcn_{axis}' must be a positive size"):
            load_config(None, [f"mesh.dcn_{axis}=0"])


def test_a_mesh_config_built_in_python_gets_a_config_error_not_a_crash():
    from jaxtrain.parallel.mesh_shape import resolve_mesh_shape
    with pytest.raises(ConfigError, match="'mesh.context' must be a positive size or -1"):
        resolve_mesh_shape(MeshConfig(context=0), 8)


# ----------------------------------------------------------------------------- unknown-key suggestions


@pytest.mark.parametrize("typed, meant", [
    ("optim.lr", "optim.learning_rate"),  # an abbreviation, not the nearest spelling (optim.b2)
    ("train.lr", "optim.learning_rate"),  # an alias in the wrong section
    ("train.batch_size", "data.global_batch_size"),
    ("data.bs", "data.global_batch_size"),
    ("optim.wd", "optim.weight_decay"),
    ("train.eval_evry", "train.eval_every"),  # the spelling suggestions that were already good stay
    ("trian.steps", "train.steps"),
    ("model.num_layer", "model.num_layers"),
    ("model.d_modle", "model.d_model"),
    ("modle.d_model", "model.d_model"),
])
def test_unknown_key_suggests_what_was_meant(typed, meant):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"{typed}=1"])
    assert f"unknown config key '{typed}'; did you mean '{meant}'?" in str(e.value)


def test_every_key_alias_names_a_real_key():
    from jaxtrain.config import KEY_ALIASES
    assert set(KEY_ALIASES.values()) <= set(all_keys())
