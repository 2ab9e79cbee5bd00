"""The config as one source of truth (issue #38): each section's dataclass checks its own keys, the
cross-section rules are one named function, a fixed set of strings is a `Literal` whose values are
written once, and every device-time check is one call (`mesh_shape.validate_against_devices`)."""

from __future__ import annotations

import ast
import dataclasses
import typing

import pytest
import yaml
from helpers import REPO, TINY

from jaxtrain import config
from jaxtrain.config import (Config, ConfigError, PrecisionConfig, check_field_values, choices, literal_choices,
                             load_config, validate, validate_cross_section)

# One bad value per section: (section, field, override, the value as the loader makes it, the whole message).
ONE_BAD_VALUE_PER_SECTION = [
    ("run", "allow_changes", "some", "some",
     "config key 'run.allow_changes' must be a list of dotted keys or `all`, got 'some'"),
    ("train", "log_every", "0", 0, "config key 'train.log_every' must be positive, got 0"),
    ("optim", "decay_steps", "0", 0, "config key 'optim.decay_steps' must be >= 1 (null = train.steps), got 0"),
    ("mesh", "dcn_fsdp", "0", 0, "config key 'mesh.dcn_fsdp' must be a positive size (1 = no DCN split), got 0"),
    ("pipeline", "repeats", "0", 0, "config key 'pipeline.repeats' must be positive, got 0"),
    ("context", "order", "spiral", "spiral", "config key 'context.order' must be one of zigzag, plain; got 'spiral'"),
    ("model", "head_dim", "31", 31, "model.head_dim=31 must be even (rotary embeddings rotate pairs)"),
    ("data", "seed", "-1", -1, "data.seed=-1 must be within [0, 2**32) (it seeds Grain's index shuffle)"),
    ("precision", "growth_factor", "1", 1.0, "config key 'precision.growth_factor' must be > 1, got 1.0"),
    ("stability", "window", "0", 0, "config key 'stability.window' must be positive, got 0"),
    ("fault", "preflight_factor", "1.5", 1.5, "config key 'fault.preflight_factor' must be within (0, 1), got 1.5"),
    ("checkpoint", "barrier_timeout_s", "0", 0.0, "checkpoint.barrier_timeout_s must be positive, got 0.0"),
    ("chaos", "crash_process", "-2", -2,
     "config key 'chaos.crash_process' must be a slot number >= 0 or -1 (none), got -2"),
    ("observe", "prometheus_port", "70000", 70000,
     "config key 'observe.prometheus_port' must be a TCP port within [0, 65535] (0 = off), got 70000"),
]


def test_every_section_is_covered_and_validates_itself():
    sections = {f.name for f in dataclasses.fields(Config)}
    assert {case[0] for case in ONE_BAD_VALUE_PER_SECTION} == sections
    for name in sections:
        assert callable(getattr(getattr(Config(), name), "validate")), name


@pytest.mark.parametrize("section, field, raw, value, message", ONE_BAD_VALUE_PER_SECTION,
                         ids=[case[0] for case in ONE_BAD_VALUE_PER_SECTION])
def test_a_bad_value_per_section_is_its_one_line_error(section, field, raw, value, message):
    with pytest.raises(ConfigError) as e:  # through the loader, as `jaxtrain train` reads it
        load_config(TINY, [f"{section}.{field}={raw}"])
    assert str(e.value) == message
    # ... and the same from the section alone, built in Python: the check lives with the section.
    part = dataclasses.replace(getattr(Config(), section), **{field: value})
    with pytest.raises(ConfigError) as e:
        check_field_values(section, part)
        part.validate()
    assert str(e.value) == message


@pytest.mark.parametrize("overrides, message", [
    (["data.seq_len=512"], "data.seq_len=512 is larger than model.max_seq_len=256"),
    (["mesh.expert=2"], "mesh.expert=2 needs a mixture of experts (model.num_experts > 0)"),
    (["chaos.hang_in_step=true", "chaos.hang_at_step=2", "fault.step_markers=never"],
     "config key 'chaos.hang_in_step' blocks inside the step's start mark, a host callback that "
     "fault.step_markers=never leaves out: set fault.step_markers=auto"),
    (["data.global_batch_size=6", "train.grad_accum=4"],
     "data.global_batch_size=6 is not divisible by train.grad_accum=4"),
])
def test_cross_section_rules_are_their_own_function(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert str(e.value) == message
    cfg = config._build(Config, config.apply_overrides(yaml.safe_load(open(TINY)), overrides), "")
    for f in dataclasses.fields(cfg):  # every section on its own is fine ...
        getattr(cfg, f.name).validate()
    with pytest.raises(ConfigError) as e:  # ... the rule that spans them is not
        validate_cross_section(cfg)
    assert str(e.value) == message


# ----------------------------------------------------------------------------- Literal fields


def literal_keys() -> list[tuple[str, tuple]]:
    out = []
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        for f in dataclasses.fields(cls):
            allowed = literal_choices(typing.get_type_hints(cls)[f.name])
            if allowed is not None:
                out.append((f"{section.name}.{f.name}", allowed))
    return out


def test_the_fixed_sets_of_strings_are_literals():
    keys = dict(literal_keys())
    for key in ("precision.policy", "model.attention", "model.remat", "data.source", "context.attention",
                "fault.preflight_action", "fault.step_markers", "checkpoint.local_snapshot",
                "checkpoint.local_transfer"):
        assert key in keys, key
    assert choices(PrecisionConfig, "policy") == ("fp32", "bf16", "fp16")
    assert keys["data.source"] == ("markov", "tokens", "text", "arrayrecord", "parquet", "hf_datasets", None)


@pytest.mark.parametrize("key, allowed", literal_keys(), ids=[k for k, _ in literal_keys()])
def test_a_literal_field_rejects_an_unknown_value_naming_its_allowed_ones(key, allowed):
    named = ", ".join("null" if c is None else str(c) for c in allowed)  # from the annotation, not written here
    message = f"config key '{key}' must be one of {named}; got 'bogus'"
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"{key}=bogus"])
    assert str(e.value) == message
    # A config built in Python (no loader) gets the same line from `validate`.
    section, field = key.split(".")
    cfg = load_config(TINY)
    bad = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: "bogus"})})
    with pytest.raises(ConfigError) as e:
        validate(bad)
    assert str(e.value) == message
    # Every allowed value passes the loader's type check, from a key=value override and from YAML.
    for value in allowed:
        raw = "null" if value is None else value
        try:
            assert getattr(getattr(load_config(TINY, [f"{key}={raw}"]), section), field) == value
        except ConfigError as other:  # another rule may refuse the value on this config; never its type
            assert "must be one of" not in str(other), other


def test_literal_values_load_from_a_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("precision: {policy: bf16}\ncheckpoint: {local_transfer: network, local_snapshot: host}\n"
                    "data: {source: null}\n")
    cfg = load_config(path, need_data=False)
    assert (cfg.precision.policy, cfg.checkpoint.local_transfer, cfg.checkpoint.local_snapshot) == ("bf16", "network",
                                                                                                    "host")
    assert cfg.data.source is None
    path.write_text("checkpoint: {local_snapshot: gpu}\n")
    with pytest.raises(ConfigError, match=r"^config key 'checkpoint.local_snapshot' must be one of auto, device, host; "
                                          r"got 'gpu'$"):
        load_config(path)


def test_config_py_writes_a_literals_values_once():
    """A Literal field's allowed values appear in config.py once, in its annotation: the checks and
    messages read them from there (`choices`, `literal_choices`), never from a copy."""
    tree = ast.parse((REPO / "jaxtrain/config.py").read_text())
    in_annotations = {id(n.slice) for n in ast.walk(tree)
                      if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "Literal"}
    sets = {frozenset(map(str, allowed)) - {"None"} for _, allowed in literal_keys()}
    copies = [n.lineno for n in ast.walk(tree)
              if isinstance(n, (ast.Tuple, ast.List, ast.Set)) and id(n) not in in_annotations and len(n.elts) > 1
              and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.elts)
              and frozenset(e.value for e in n.elts) in sets]
    assert copies == [], f"config.py writes a Literal's values by hand at line(s) {copies}"


# ----------------------------------------------------------------------------- device-time checks: one call


def test_device_time_checks_are_one_jax_free_call():
    from jaxtrain.parallel import mesh, mesh_shape
    assert mesh.validate_against_devices is mesh_shape.validate_against_devices  # one function, re-exported
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(ast.parse((REPO / "jaxtrain/parallel/mesh_shape.py").read_text()))
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in getattr(n, "names", [])}
    assert not any(m and m.split(".")[0] == "jax" for m in imported)  # the launcher may call it


def test_the_dcn_split_is_checked_with_the_counts_as_when_the_mesh_is_built():
    from jaxtrain.parallel.mesh_shape import validate_against_devices
    cfg = load_config(TINY, ["mesh.data=4", "mesh.dcn_data=2"])
    assert validate_against_devices(cfg, 4, 3)["data"] == 4  # no slice count: left to build_mesh
    with pytest.raises(ConfigError) as e:
        validate_against_devices(cfg, 4, 3, num_slices=0)
    assert str(e.value) == "mesh.dcn_data=2 = 2 must equal the 3 process(es) (one DCN granule each)"
    assert validate_against_devices(cfg, 4, 2, num_slices=0)["data"] == 4
    assert validate_against_devices(cfg, 4, 1, num_slices=0)["data"] == 4  # one process: no DCN
    cfg = load_config(TINY, ["mesh.data=2", "mesh.fsdp=2", "mesh.dcn_fsdp=4"])
    with pytest.raises(ConfigError, match="mesh.fsdp=2 is not divisible by mesh.dcn_fsdp=4"):
        validate_against_devices(cfg, 4, 4, num_slices=0)


def test_the_chaos_process_checks_run_in_the_device_time_call():
    from jaxtrain.parallel.mesh_shape import validate_against_devices
    cfg = load_config(TINY, ["chaos.hang_at_step=3", "chaos.hang_process=2"])
    with pytest.raises(ConfigError) as e:
        validate_against_devices(cfg, 2, 2)
    assert str(e.value) == ("chaos.hang_process=2 names no process of this job: it has 2 process(es), "
                            "numbered 0 to 1")
    cfg.chaos.validate_processes(3)  # the drills' own method: fine on a job of three
