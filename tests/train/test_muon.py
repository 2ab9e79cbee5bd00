"""Muon (optim.name=muon, jaxtrain/train/muon.py): its update against optax.contrib.muon and AdamW,
the Newton-Schulz iteration per stacked matrix against float64 numpy, sharded runs against one
device, the skip contract, learning the tiny chain, and refused keys."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TINY, read_jsonl
from trees import assert_trees_close, assert_trees_differ, assert_trees_equal, named_leaves

from jaxtrain.config import ConfigError, load_config
from jax.sharding import PartitionSpec as P

from jaxtrain.train import muon as muon_module
from jaxtrain.train.muon import MatrixDims, MuonState, iteration_spec, matrix_dims, model_matrix_dims, orthogonalise
from jaxtrain.train.optim import applied_learning_rate, learning_rate_schedule, make_optimizer

COEFFS = (3.4445, -4.7750, 2.0315)


def numpy_newton_schulz(x: np.ndarray, steps: int = 5, coeffs=COEFFS) -> np.ndarray:
    """Keller Jordan's quintic iteration on one matrix, float64: X / ||X||_F, then
    X <- aX + (bA + cA^2)X with A = XX^T, on the transpose when X is tall."""
    x = np.asarray(x, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-8)
    a, b, c = coeffs
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def tiny_cfg(*overrides: str):
    return load_config(TINY, ["optim.name=muon", "optim.grad_clip_norm=0", "optim.warmup_steps=0",
                              "optim.weight_decay=0.1", *overrides])


def random_tree(like, seed: int, scale: float = 1.0):
    leaves, treedef = jax.tree_util.tree_flatten(like)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([scale * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def tiny_params(cfg, seed: int = 0):
    """Random parameters with the tiny model's tree (shapes from the abstract model)."""
    from flax import nnx

    from jaxtrain.model.llama import Transformer
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    return random_tree(nnx.to_pure_dict(nnx.split(abstract)[1]), seed, 0.05)


def test_matrix_layout_from_logical_axes():
    # wq [L, D, N, H] is D x N*H per layer; wo [L, N, H, D] is N*H x D; experts are a batch axis.
    assert matrix_dims(("layers", "embed", "heads", "head_dim")) == MatrixDims((0,), (1,), (2, 3))
    assert matrix_dims(("layers", "heads", "head_dim", "embed")) == MatrixDims((0,), (1, 2), (3,))
    assert matrix_dims(("layers", "experts", "moe_mlp", "embed")) == MatrixDims((0, 1), (2,), (3,))
    assert matrix_dims(("layers", "kv_lora", "heads", "head_dim")) == MatrixDims((0,), (1,), (2, 3))
    # AdamW's: embedding, head, norms, biases (also per head and per expert), sinks
    for names in [("vocab", "embed"), ("embed", "vocab"), ("layers", "norm"), ("layers", "heads", "head_dim"),
                  ("layers", "experts", "moe_mlp"), ("layers", "heads"), ("norm",)]:
        assert matrix_dims(names) is None, names
    dims = model_matrix_dims(tiny_cfg())
    assert dims[("blocks", "attn", "wq")] == MatrixDims((0,), (1,), (2, 3))
    assert dims[("embed",)] is None and dims[("head",)] is None and dims[("final_norm", "scale")] is None


def test_stacked_layers_and_experts_are_orthogonalised_per_matrix():
    rng = np.random.default_rng(0)
    x_LDF = rng.standard_normal((3, 16, 40)).astype(np.float32)
    x_LEDF = rng.standard_normal((2, 3, 24, 8)).astype(np.float32)  # tall: the transpose's Gram
    x_LDNH = rng.standard_normal((2, 16, 4, 6)).astype(np.float32)
    got = np.asarray(orthogonalise(jnp.asarray(x_LDF), MatrixDims((0,), (1,), (2,)), COEFFS, 5))
    np.testing.assert_allclose(got[1], numpy_newton_schulz(x_LDF[1]), rtol=0, atol=2e-5)
    got = np.asarray(orthogonalise(jnp.asarray(x_LEDF), MatrixDims((0, 1), (2,), (3,)), COEFFS, 5))
    np.testing.assert_allclose(got[1, 2], numpy_newton_schulz(x_LEDF[1, 2]), rtol=0, atol=2e-5)
    got = np.asarray(orthogonalise(jnp.asarray(x_LDNH), MatrixDims((0,), (1,), (2, 3)), COEFFS, 5))
    np.testing.assert_allclose(got[1], numpy_newton_schulz(x_LDNH[1].reshape(16, 24)).reshape(16, 4, 6),
                               rtol=0, atol=2e-5)
    # ...and not as one matrix of the whole stack: that answer is a different one.
    whole = numpy_newton_schulz(x_LDF.transpose(1, 0, 2).reshape(16, 120)).reshape(16, 3, 40)[:, 1]
    assert np.max(np.abs(whole - numpy_newton_schulz(x_LDF[1]))) > 1e-2
    # What the iteration is for: singular values pulled near 1 (Jordan's ~U(0.5, 1.5)), from a spread.
    s = np.linalg.svd(numpy_newton_schulz(x_LDF[0]), compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.3


def test_update_equals_optax_contrib_muon_and_adamw():
    cfg = tiny_cfg()
    params = tiny_params(cfg)
    tx = make_optimizer(cfg)
    dims = model_matrix_dims(cfg)
    key = lambda path: tuple(str(k.key) for k in path)
    # optax's Muon with Moonlight's scale (consistent_rms=0.2), our layouts, decay on every matrix
    # (all_but_norms); AdamW for the rest is optim.name=adamw's own optimizer.
    spec = jax.tree_util.tree_map_with_path(
        lambda p, _: None if dims[key(p)] is None else optax.contrib.MuonDimensionNumbers(
            dims[key(p)].rows, dims[key(p)].cols), params)
    ref_muon = optax.contrib.muon(learning_rate_schedule(cfg), beta=0.95, nesterov=True, weight_decay=0.1,
                                  consistent_rms=0.2, muon_weight_dimension_numbers=spec)
    ref_adamw = make_optimizer(load_config(TINY, ["optim.grad_clip_norm=0", "optim.warmup_steps=0",
                                                  "optim.weight_decay=0.1"]))
    states = [tx.init(params), ref_muon.init(params), ref_adamw.init(params)]
    for step in range(3):
        grads = random_tree(params, 100 + step)
        outs = []
        for i, opt in enumerate((tx, ref_muon, ref_adamw)):
            u, states[i] = opt.update(grads, states[i], params)
            outs.append(named_leaves(u))
        ours, muon_ref, adamw_ref = outs
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
            name = jax.tree_util.keystr(path)
            if dims[key(path)] is None:  # AdamW: optim.name=adamw's, to float32 rounding (op order)
                np.testing.assert_allclose(ours[name], adamw_ref[name], rtol=0, atol=1e-6 * np.max(np.abs(adamw_ref[name])),
                                           err_msg=name)
            else:
                scale = np.max(np.abs(muon_ref[name]))
                np.testing.assert_allclose(ours[name], muon_ref[name], rtol=0, atol=2e-5 * scale, err_msg=name)
        params = optax.apply_updates(params, jax.tree_util.tree_map(jnp.asarray, jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(params), [ours[jax.tree_util.keystr(p)] for p, _ in
                                                   jax.tree_util.tree_flatten_with_path(params)[0]])))


def test_update_rms_matches_adamw_scale():
    # Moonlight's scale: a Muon matrix update has RMS ~ 0.2 x the rate, as AdamW's does (~ lr).
    cfg = tiny_cfg("optim.weight_decay=0", "optim.schedule=constant", "optim.learning_rate=1.0")
    params = tiny_params(cfg)
    tx = make_optimizer(cfg)
    u, _ = tx.update(random_tree(params, 7), tx.init(params), params)
    w = np.asarray(u["blocks"]["mlp"]["w_up"][0])
    rms = float(np.sqrt(np.mean(w ** 2)))
    assert 0.1 < rms < 0.3, rms


def test_skipped_step_keeps_the_whole_state_bitwise():
    cfg = tiny_cfg()
    params = tiny_params(cfg)
    tx = make_optimizer(cfg)
    state = tx.update(random_tree(params, 1), tx.init(params), params)[1]  # moments and counts non-zero
    bad = jax.tree_util.tree_map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), random_tree(params, 2))
    kept = jax.jit(lambda g, s, p: tx.update(g, s, p, skip=True)[1])(bad, state, params)
    assert_trees_equal(kept, state, "skipped Muon state ")
    moved = jax.jit(lambda g, s, p: tx.update(g, s, p, skip=False)[1])(random_tree(params, 3), state, params)
    count = lambda s: [int(x.count) for x in jax.tree_util.tree_leaves(s, is_leaf=lambda x: isinstance(x, MuonState))
                       if isinstance(x, MuonState)]
    assert count(moved) == [2] and count(kept) == [1]
    assert float(applied_learning_rate(learning_rate_schedule(cfg), kept)) > 0  # one schedule count


SHARDED_BASE = [
    "model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=8",
    "model.num_kv_heads=4", "model.head_dim=8", "model.mlp_dim=64", "model.attention=xla",
    "data.seq_len=16", "data.global_batch_size=16", "train.steps=3", "optim.warmup_steps=0",
    "optim.learning_rate=1e-3", "optim.name=muon", "mesh.data=1",
]


def three_steps(overrides: list[str], devices) -> dict:
    from jaxtrain.trainer import Trainer
    trainer = Trainer(load_config(None, SHARDED_BASE + overrides), write_files=False, devices=devices)
    initial = jax.device_get(trainer.state["params"])
    for _ in range(3):
        trainer.step()
    final = jax.device_get(trainer.state["params"])
    assert_trees_differ(final, initial, 3e-4)
    return final


def test_fsdp4_tensor2_equals_one_device_after_three_steps():
    one = three_steps(["mesh.fsdp=1", "mesh.tensor=1"], jax.devices()[:1])
    sharded = three_steps(["mesh.fsdp=4", "mesh.tensor=2"], jax.devices())
    assert_trees_close(sharded, one, 3e-4, "parameter after 3 Muon steps ")


def test_fsdp4_with_layers_spread_over_it_equals_one_device_after_three_steps():
    # 4 layers over fsdp=4: each device orthogonalises whole matrices of one layer (all-to-all).
    one = three_steps(["model.num_layers=4", "mesh.fsdp=1", "mesh.tensor=1"], jax.devices()[:1])
    sharded = three_steps(["model.num_layers=4", "mesh.fsdp=4", "mesh.tensor=1"], jax.devices()[:4])
    assert_trees_close(sharded, one, 3e-4, "parameter after 3 Muon steps ")


def test_iteration_spec_moves_matrix_axes_onto_layers_and_experts_or_gathers():
    L, R, C = MatrixDims((0,), (1,), (2,)), MatrixDims((0,), (1,), (2, 3)), MatrixDims((0, 1), (2,), (3,))
    sizes = {"stage": 1, "fsdp": 8, "tensor": 2, "expert": 2}
    # 8 layers over fsdp 8: the embed split moves to the layers (beside stage); tensor (16 ways
    # would not divide 8) is gathered; the matrix is whole.
    assert iteration_spec(P("stage", "fsdp", "tensor"), (8, 64, 128), L, sizes) == P(("stage", "fsdp"), None, None)
    assert iteration_spec(P(None, "fsdp", "tensor"), (16, 64, 128), L, sizes) == P(("fsdp", "tensor"), None, None)
    assert iteration_spec(P(None, "fsdp", None), (8, 64, 128), L, sizes) == P("fsdp", None, None)
    # 2 layers: fsdp 8 does not divide them, tensor 2 does; fsdp is gathered (dropped).
    assert iteration_spec(P(None, "fsdp", "tensor", None), (2, 64, 4, 16), R, sizes) == P("tensor", None, None, None)
    # Nothing divides 3 layers: gather the matrix once.
    assert iteration_spec(P(None, "fsdp", None), (3, 64, 128), L, sizes) == P(None, None, None)
    # Experts (already on `expert`) and layers share the moved axes where their sizes allow: fsdp on
    # the 8 layers, tensor beside expert on the 4 experts (16 ways, each device 1 layer x 2 experts).
    assert iteration_spec(P(None, "expert", "fsdp", "tensor"), (8, 4, 64, 32), C, sizes) == \
        P("fsdp", ("expert", "tensor"), None, None)
    # 2 layers, 4 experts: fsdp 8 fits neither, tensor the layers (the first of the equal choices).
    assert iteration_spec(P(None, "expert", "fsdp", "tensor"), (2, 4, 64, 32), C, sizes) == \
        P("tensor", "expert", None, None)
    # No matrix dimension split (or only over size-1 axes): nothing to move.
    assert iteration_spec(P("fsdp", None, None), (8, 64, 128), L, sizes) is None
    assert iteration_spec(P(None, "stage", None), (8, 64, 128), L, sizes) is None


def muon_collective_bytes(layers: int, name: str) -> tuple[float, int]:
    """Wire bytes per step per device of the compiled train step (as `jaxtrain inspect` counts them
    as compiled), and the Muon matrices' fp32 bytes, for a small model on fsdp=4 (4 devices)."""
    from jaxtrain.observe.inspection import inspect_report
    cfg = load_config(TINY, ["model.vocab_size=64", "model.d_model=64", f"model.num_layers={layers}",
                             "model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=16", "model.mlp_dim=128",
                             "model.attention=xla", "data.seq_len=16", "data.global_batch_size=8", "mesh.data=1",
                             "mesh.fsdp=4", f"optim.name={name}"])
    report = inspect_report(cfg, jax.devices()[:4])
    dims = model_matrix_dims(cfg)
    matrix = sum(int(np.prod(p["shape"])) * 4 for k, p in report["parameters"].items()
                 if dims[tuple(k.strip("[]'").split("']['"))] is not None)
    return sum(report["collectives_as_compiled"].values()), matrix


@pytest.mark.parametrize("layers", [4, 2])
def test_muon_moves_each_matrix_once_under_fsdp(layers, monkeypatch):
    """With 4 layers over fsdp=4 each matrix shard crosses once each way (all-to-all: 2 x 3/4 of a
    quarter of the matrices beyond AdamW's traffic); with 2 layers (4 does not divide 2) each
    matrix is gathered once (3/4 of the matrices). Re-gathering in every Newton-Schulz step (the
    iteration left to XLA on the split matrices) moves ~9.75x the matrices beyond AdamW's."""
    adamw, matrix = muon_collective_bytes(layers, "adamw")
    muon, _ = muon_collective_bytes(layers, "muon")
    bound = adamw + (2 * matrix / 4 if layers == 4 else matrix)
    assert muon <= bound, (muon, adamw, matrix)
    assert muon - adamw >= (0.3 if layers == 4 else 0.7) * matrix  # the move is there: Muon needs whole matrices
    monkeypatch.setattr(muon_module, "iteration_spec", lambda *args: None)  # the iteration on the shards
    old, _ = muon_collective_bytes(layers, "muon")
    assert old > adamw + 5 * matrix, (old, adamw, matrix)


def test_muon_keys_need_optim_name_muon():
    with pytest.raises(ConfigError, match="optim.muon_momentum.*needs optim.name=muon"):
        load_config(TINY, ["optim.muon_momentum=0.9"])
    with pytest.raises(ConfigError, match="not built"):
        load_config(TINY, ["optim.name=muon", "optim.qk_clip=100"])
    with pytest.raises(ConfigError, match="optim.muon_ns_b.*needs optim.name=muon"):
        load_config(TINY, ["optim.muon_ns_b=-4"])
    with pytest.raises(ConfigError, match="muon_ns_steps"):
        load_config(TINY, ["optim.name=muon", "optim.muon_ns_steps=0"])
    cfg = load_config(TINY, ["optim.name=muon", "optim.muon_ns_a=3", "optim.muon_ns_steps=4"])
    assert (cfg.optim.muon_ns_a, cfg.optim.muon_ns_steps) == (3.0, 4)


@pytest.mark.slow
def test_tiny_config_reaches_the_entropy_floor_with_muon(tmp_path):
    out = tmp_path / "tiny"
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
                        "optim.name=muon", "--cpu-devices", "1"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    floor = read_jsonl(out / "events.jsonl")[0]["entropy_floor"]
    logs = read_jsonl(out / "metrics.jsonl")
    losses = [m["loss"] for m in logs]
    final = sum(losses[-3:]) / 3
    assert losses[0] - floor > 1.0
    assert -0.05 <= final - floor <= 0.10, (final, floor)  # tests/test_train.py's margin
    reached = next(m["step"] for m in logs if m["loss"] - floor <= 0.10)
    print(f"muon reached floor + 0.10 at step {reached}; final - floor = {final - floor:.4f}")


def test_jaxtrain_train_runs_muon_on_split_matrices_with_its_own_xla_flags(tmp_path):
    """`jaxtrain train` (the XLA flags it sets for this CPU) with Muon on fsdp 2 x tensor 2: the
    Newton-Schulz gathers made YNNPACK's elementwise fusions fail at run time; now the flags keep
    YNNPACK for dots and reductions only, and 3 steps finish with finite losses."""
    from jaxtrain.runtime.xla_cpu import YNN_FUSIONS_NO_ELTWISE, cpu_xla_flags

    cfg = load_config(TINY, ["optim.name=muon", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=1"])
    if cpu_xla_flags(cfg):  # a jaxlib these flags were checked with
        assert cpu_xla_flags(cfg)[0] == YNN_FUSIONS_NO_ELTWISE
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
                        "optim.name=muon", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=1", "train.steps=3",
                        "train.log_every=1", "data.global_batch_size=8", "data.seq_len=32", "model.num_layers=1",
                        "checkpoint.compilation_cache_dir=null", "--cpu-devices", "4"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [row["loss"] for row in read_jsonl(out / "metrics.jsonl") if "loss" in row]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
