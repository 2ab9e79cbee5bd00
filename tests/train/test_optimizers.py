"""The optimizers behind optim.name (jaxtrain/train/optim.py, docs/optim.md): each learns the tiny
chain, keeps its state bitwise on a skipped step, restores onto another mesh, and resumes bitwise;
the weight-decay masks; and the inputs refused in one line."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TINY, read_jsonl
from trees import assert_trees_equal

from jaxtrain.checkpoint.checkpointer import Checkpointer
from jaxtrain.config import ConfigError, load_config
from jaxtrain.train.optim import (evaluation_params, is_matrix, make_optimizer, model_logical_axes,
                                  weight_decay_mask)
from jaxtrain.trainer import Trainer

# Each optimizer other than adamw (tested everywhere else; muon: tests/train/test_muon.py) with the
# learning rate docs/optim.md recommends for configs/tiny.yaml.
OTHERS = {"adafactor": [], "lion": ["optim.learning_rate=1e-3"], "sgd": ["optim.learning_rate=0.5"],
          "schedule_free": []}
SMALL = ["model.num_layers=1", "data.global_batch_size=8", "data.seq_len=32", "checkpoint.compilation_cache_dir=null"]


def overrides(name: str) -> list[str]:
    return [f"optim.name={name}", *OTHERS.get(name, [])]


def host(tree):
    return jax.device_get(tree)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- learning


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OTHERS))
def test_tiny_config_reaches_the_entropy_floor(tmp_path, name):
    """configs/tiny.yaml's 300 steps, as tests/test_train.py checks adamw: within the same margin."""
    out = tmp_path / "tiny"
    # Logged every step (the default 20 would first log sgd already near the floor); the final loss is
    # the mean of the same three steps as there (260, 280, 300).
    r = run_cli("train", "--config", TINY, f"run.output_dir={out}", *overrides(name), "train.log_every=1",
                "--cpu-devices", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    floor = read_jsonl(out / "events.jsonl")[0]["entropy_floor"]
    losses = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}
    final = (losses[260] + losses[280] + losses[300]) / 3
    assert losses[1] - floor > 1.0
    assert -0.05 <= final - floor <= 0.10, (name, final, floor)


# ----------------------------------------------------------------------------- the skip contract


@pytest.mark.parametrize("policy", ["fp32", "fp16"])
@pytest.mark.parametrize("name", ["adamw", *OTHERS, "muon"])
def test_a_skipped_step_keeps_the_optimizer_state_bitwise(tmp_path, name, policy):
    """Also under fp16's dynamic loss scaling: the NaN step is skipped (the scale halves), the
    optimizer never sees its gradients."""
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", *SMALL, *overrides(name), "train.steps=5",
                             "chaos.nan_at_steps=[3]", "optim.warmup_steps=0", f"precision.policy={policy}"])
    t = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    t.step()
    before = host(t.state)
    t.step()  # an applied step moves every part of the state (so the bitwise check below can fail)
    moved = host(t.state)
    assert not np.array_equal(moved["params"]["embed"], before["params"]["embed"])
    changed = [a for a, b in zip(jax.tree_util.tree_leaves(moved["opt_state"]),
                                 jax.tree_util.tree_leaves(before["opt_state"])) if not np.array_equal(a, b)]
    assert changed, "an applied step left the optimizer state as it was"
    record = t.step()  # step 3: NaN gradients
    assert record["skipped"] and np.isnan(record["loss"])
    after = host(t.state)
    assert_trees_equal(after["opt_state"], moved["opt_state"], what="opt_state ")
    assert_trees_equal(after["params"], moved["params"], what="params ")
    assert not t.step()["skipped"]
    t.close()


# ----------------------------------------------------------------------------- meshes and resume


@pytest.mark.parametrize("name", [*OTHERS, "muon"])
def test_checkpoint_restores_onto_another_mesh(tmp_path, name):
    """8 devices (data 2, fsdp 2, tensor 2) -> 1 device: the whole state, optimizer's included, bitwise."""
    base = [f"run.output_dir={tmp_path}", *SMALL, *overrides(name), "train.steps=2", "checkpoint.every_steps=0",
            "checkpoint.save_at_end=true", "model.num_heads=4", "model.num_kv_heads=2", "optim.weight_decay=0.1"]
    trainer = Trainer(load_config(TINY, [*base, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
                      devices=jax.devices()[:8])
    trainer.fit()
    saved = host(trainer.state)
    trainer.close()
    again = Trainer(load_config(TINY, [*base, "mesh.data=1", "train.steps=3", "run.allow_changes=[train.steps]"]),
                    devices=jax.devices()[:1])
    assert again.resumed_from == 2
    assert_trees_equal(host(again.state), saved)
    again.fit()
    assert int(again.state["step"]) == 3
    again.close()


RESUME = ["train.steps=30", "train.log_every=1", "checkpoint.every_steps=5", "model.num_layers=1",
          "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8", "data.seq_len=32",
          "optim.name=lion", "optim.learning_rate=1e-3"]


def resume_cmd(out: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
            f"checkpoint.compilation_cache_dir={cache}", *RESUME, *extra, "--cpu-devices", "1"]


def latest_state(out: Path) -> dict:
    cfg = load_config(out / "config.yaml", ["checkpoint.compilation_cache_dir=null"])
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    checkpoints = Checkpointer(str(out / "checkpoints"), cfg.checkpoint)
    state, _ = checkpoints.restore(checkpoints.latest_step(), trainer.abstract_state())
    checkpoints.close()
    trainer.close()
    return host(state)


@pytest.mark.slow
def test_lion_sigkill_then_same_command_resumes_bitwise(tmp_path):
    cache = tmp_path / "cache"
    reference = tmp_path / "uninterrupted"
    r = subprocess.run(resume_cmd(reference, cache), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    killed = subprocess.run(resume_cmd(out, cache, "chaos.kill_at_step=17"), capture_output=True, text=True,
                            timeout=600)
    assert killed.returncode == -signal.SIGKILL
    again = subprocess.run(resume_cmd(out, cache, "chaos.kill_at_step=17"), capture_output=True, text=True,
                           timeout=600, env={**os.environ, "JAXTRAIN_RESTART_ATTEMPT": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    restored = next(e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume")["restored_step"]
    assert restored in (10, 15)
    ref = {m["step"]: m["loss"] for m in read_jsonl(reference / "metrics.jsonl")}
    got = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}
    assert sorted(got) == list(range(1, 31))
    assert all(got[s] == ref[s] for s in range(restored + 1, 31)), "losses after the resume differ"
    assert_trees_equal(latest_state(out), latest_state(reference))


# ----------------------------------------------------------------------------- weight decay masks

GPT_OSS_TINY = str(Path(TINY).parent / "gpt-oss-tiny.yaml")  # norms, biases, sinks, experts, a router


def decayed(rule: str, cfg) -> set[str]:
    logical = model_logical_axes(cfg)
    params = jax.tree_util.tree_map(lambda names: np.zeros(len(names)), logical,
                                    is_leaf=lambda x: isinstance(x, tuple))
    mask = weight_decay_mask(rule, params, logical)
    return {"/".join(str(k.key) for k in path) for path, on in jax.tree_util.tree_leaves_with_path(mask) if on}


def test_weight_decay_masks_on_a_model_with_norms_biases_sinks_and_experts():
    cfg = load_config(GPT_OSS_TINY, [])
    assert cfg.model.num_experts > 0 and cfg.model.attention_bias and cfg.model.attention_sinks
    everything = {"/".join(str(k.key) for k in path)
                  for path, _ in jax.tree_util.tree_leaves_with_path(model_logical_axes(cfg),
                                                                     is_leaf=lambda x: isinstance(x, tuple))}
    norms = {"blocks/attn_norm/scale", "blocks/mlp_norm/scale", "final_norm/scale"}
    matrices = {"embed", "head", "blocks/attn/wq", "blocks/attn/wk", "blocks/attn/wv", "blocks/attn/wo",
                "blocks/mlp/router", "blocks/mlp/w_gate", "blocks/mlp/w_up", "blocks/mlp/w_down"}
    vectors = {"blocks/attn/bq", "blocks/attn/bk", "blocks/attn/bv", "blocks/attn/bo", "blocks/attn/sinks",
               "blocks/mlp/router_b", "blocks/mlp/b_gate", "blocks/mlp/b_up", "blocks/mlp/b_down"}
    assert everything == norms | matrices | vectors  # the model is what this test thinks it is
    assert decayed("all_but_norms", cfg) == matrices | vectors
    assert decayed("matrices", cfg) == matrices
    assert decayed("none", cfg) == set()


def test_is_matrix_counts_dims_per_layer_and_per_expert():
    assert is_matrix(("layers", "embed", "heads", "head_dim"))  # wq: [D, N * H] per layer
    assert is_matrix(("layers", "experts", "embed", "moe_mlp"))
    assert is_matrix(("dense_layers", "q_lora", "heads", "head_dim")) and is_matrix(("vocab", "embed"))
    assert not is_matrix(("layers", "heads", "head_dim"))  # a bias of a projection into heads
    assert not is_matrix(("layers", "experts", "moe_mlp"))  # one bias per expert
    assert not is_matrix(("layers", "norm")) and not is_matrix(("mtp_layers", "embed"))


@pytest.mark.parametrize("name", ["adamw", *OTHERS])
@pytest.mark.parametrize("rule", ["all_but_norms", "matrices", "none"])
def test_every_optimizer_decays_exactly_the_masked_leaves(name, rule):
    """A zero gradient: what moves is the weight decay alone, so exactly the leaves the mask names."""
    cfg = load_config(GPT_OSS_TINY, [*overrides(name), f"optim.weight_decay_mask={rule}", "optim.weight_decay=0.5",
                                     "optim.warmup_steps=0", "optim.learning_rate=0.1"])
    logical = model_logical_axes(cfg)
    params = jax.tree_util.tree_map(lambda names: jnp.full((3,) * len(names), 0.5, jnp.float32), logical,
                                    is_leaf=lambda x: isinstance(x, tuple))
    tx = make_optimizer(cfg)
    updates, _ = jax.jit(tx.update)(jax.tree_util.tree_map(jnp.zeros_like, params), tx.init(params), params)
    moved = jax.tree_util.tree_map(lambda u: bool(jnp.max(jnp.abs(u)) > 1e-6), updates)
    assert moved == weight_decay_mask(rule, params, logical)


# ----------------------------------------------------------------------------- the optimizers themselves


def test_adamw_is_optax_adamw():
    """The default optimizer: optax's adamw behind the clip, the same state tree (checkpoints restore)."""
    cfg = load_config(TINY, ["optim.warmup_steps=0", "optim.weight_decay=0.1"])
    params = {"w": jnp.linspace(-1, 1, 64).reshape(8, 8), "norm": {"scale": jnp.ones(8)}}
    grads = jax.tree_util.tree_map(lambda p: 0.01 * jnp.cos(3 * p), params)
    ours = make_optimizer(cfg)
    mask = {"w": True, "norm": {"scale": False}}
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        lambda count: optax.warmup_cosine_decay_schedule(0.0, 3e-3, 0, 300, 3e-4)(count),
        b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask))
    s1, s2 = ours.init(params), theirs.init(params)
    assert jax.tree_util.tree_structure(s1) == jax.tree_util.tree_structure(s2)
    for _ in range(3):
        u1, s1 = ours.update(grads, s1, params)
        u2, s2 = theirs.update(grads, s2, params)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), u1, u2)


def test_lion_and_sgd_steps_equal_numpy():
    """One update of each, against float64 numpy: sign of the mixed momentum (lion), heavy-ball
    momentum (sgd), decoupled weight decay x the rate for both."""
    w = np.linspace(-1.0, 1.0, 12).reshape(3, 4)
    g = 0.05 * np.sin(7 * w)  # norm < 1: not clipped
    lr, wd = 1e-2, 0.2
    common = ["optim.warmup_steps=0", f"optim.learning_rate={lr}", f"optim.weight_decay={wd}",
              "optim.schedule=constant"]
    for name, extra, step in (
            ("lion", ["optim.lion_b1=0.8", "optim.lion_b2=0.9"],
             lambda m: (np.sign(0.8 * m + 0.2 * g) + wd * w, 0.9 * m + 0.1 * g)),
            ("sgd", ["optim.sgd_momentum=0.7"], lambda m: (0.7 * m + g + wd * w, 0.7 * m + g))):
        tx = make_optimizer(load_config(TINY, [f"optim.name={name}", *common, *extra]))
        params = {"w": jnp.asarray(w, jnp.float32)}
        state, m = tx.init(params), np.zeros_like(w)
        for _ in range(2):
            u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
            direction, m = step(m)
            np.testing.assert_allclose(np.asarray(u["w"]), -lr * direction, rtol=1e-5, atol=1e-7, err_msg=name)


def test_schedule_free_evaluation_params_are_the_averaged_x():
    cfg = load_config(TINY, ["optim.name=schedule_free", "optim.warmup_steps=0"])
    tx = make_optimizer(cfg)
    params = {"w": jnp.linspace(-1, 1, 16)}
    state = tx.init(params)
    for _ in range(3):
        u, state = tx.update({"w": jnp.sin(params["w"])}, state, params)
        params = optax.apply_updates(params, u)
    sf = next(s for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, optax.contrib.ScheduleFreeState))
              if isinstance(s, optax.contrib.ScheduleFreeState))
    x = (np.asarray(params["w"]) - 0.1 * np.asarray(sf.z["w"])) / 0.9
    np.testing.assert_allclose(np.asarray(evaluation_params(state, params)["w"]), x, rtol=1e-5, atol=1e-6)
    assert not np.allclose(x, params["w"])
    adamw = make_optimizer(load_config(TINY, []))
    assert evaluation_params(adamw.init(params), params) is params


# ----------------------------------------------------------------------------- refused


@pytest.mark.parametrize("bad, words", [
    (["optim.name=adam"], "optim.name"),
    (["optim.lion_b1=0.8"], "optim.lion_b1"),  # a lion key with adamw
    (["optim.name=sgd", "optim.b2=0.9"], "optim.b2"),
    (["optim.name=lion", "optim.lion_b2=1.0"], "lion_b2"),
])
def test_bad_optimizer_config_is_one_clear_line(bad, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        load_config(TINY, bad)


def test_cli_refuses_a_lion_key_with_adamw_exit_2(tmp_path):
    r = run_cli("train", "--config", TINY, f"run.output_dir={tmp_path / 'run'}", "optim.lion_b1=0.8",
                "--cpu-devices", "1", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "optim.lion_b1" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_resume_with_another_optimizer_is_refused_even_with_consent(tmp_path):
    out = tmp_path / "run"
    base = [f"run.output_dir={out}", *SMALL, "train.steps=2", "--cpu-devices", "1"]
    assert run_cli("train", "--config", TINY, *base, cwd=tmp_path).returncode == 0
    before = tree_hash(out / "checkpoints")
    r = run_cli("train", "--config", TINY, *base[:-2], "train.steps=4", "optim.name=lion", "run.allow_changes=all",
                "--cpu-devices", "1", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert "optim.name changes adamw -> lion" in line and "cannot" in line, line
    assert tree_hash(out / "checkpoints") == before
