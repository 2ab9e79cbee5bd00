"""fp16 loss scaling and gradient numerics (jaxtrain/train/precision.py, jaxtrain/train/step.py,
jaxtrain/model/projection.py): the scaler alone (growth, backoff, its float32 ceiling); in the step,
a scale that means the same at any tokens per step, real overflows and their back-offs, an overflow
on one data shard, `finite` for huge finite gradients; and fp32 reductions of weight gradients in
the compiled data x fsdp step."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY

from trees import assert_trees_equal

from jaxtrain.config import load_config
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.parallel.sharding import global_batch
from jaxtrain.train.precision import init_loss_scale, update_loss_scale
from jaxtrain.train.state import build_layout
from jaxtrain.train.step import BATCH_KEYS, all_finite, global_norm
from jaxtrain.trainer import Trainer


def fp16(**precision: float) -> object:
    return load_config(None, ["precision.policy=fp16", *(f"precision.{k}={v}" for k, v in precision.items())])


def test_scale_grows_after_the_interval_and_backs_off_on_overflow():
    cfg = fp16(loss_scale_init=1024.0, growth_interval=2, growth_factor=2.0, backoff_factor=0.5, min_loss_scale=1.0)
    s = init_loss_scale(cfg)
    scales = []
    for finite in (True, True, True, False, False):
        s = update_loss_scale(cfg, s, jnp.bool_(finite))
        scales.append(float(s["scale"]))
    assert scales == [1024.0, 2048.0, 2048.0, 1024.0, 512.0]


def test_scale_never_grows_into_infinity():
    big = float(np.finfo(np.float32).max) / 2
    cfg = fp16(loss_scale_init=big, growth_interval=1, growth_factor=4.0)
    s = update_loss_scale(cfg, init_loss_scale(cfg), jnp.bool_(True))
    assert float(s["scale"]) == np.float32(big)  # kept, not inf: an inf scale would skip every later step
    s = update_loss_scale(cfg, s, jnp.bool_(False))
    assert np.isfinite(float(s["scale"])) and float(s["scale"]) < big


# ----------------------------------------------------------------------------- the scaler in the step

ONE_LAYER = ["model.num_layers=1", "checkpoint.compilation_cache_dir=null"]


def trainer(tmp_path, *overrides, devices=1) -> Trainer:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", *ONE_LAYER, *overrides])
    return Trainer(cfg, write_files=False, devices=jax.devices()[:devices])


def host(tree):
    return jax.tree_util.tree_map(lambda x: np.array(x), jax.device_get(tree))


def test_the_default_scale_means_the_same_at_any_tokens_per_step(tmp_path):
    """The loss scale multiplies the mean loss: fp16 with the default scale (2**15) skips the same
    steps at 256 and at 4,096 tokens per step (none). Scaling the summed loss made the effective
    scale 2**15 x tokens: at 4k tokens the first step overflowed and was skipped (while the weight
    gradients were fp16 sums over tokens; with them fp32 this passes either way: the next test
    is the one that tells the mean from the sum)."""
    skipped = {}
    for batch, seq in ((8, 32), (16, 256)):
        t = trainer(tmp_path / str(batch), "precision.policy=fp16", f"data.global_batch_size={batch}",
                    f"data.seq_len={seq}")
        records = [t.step() for _ in range(3)]
        skipped[batch * seq] = [r["step"] for r in records if r["skipped"]]
        assert records[0]["loss_scale"] == 32768.0
    assert skipped == {256: [], 4096: []}, skipped


def first_fitting_scale(tmp_path, batch: int, seq: int, init: float) -> tuple[float, float]:
    """(the first loss scale at which a step is not skipped, backing off from `init`; the counted
    tokens of a batch), fp16, growth off."""
    t = trainer(tmp_path, "precision.policy=fp16", f"data.global_batch_size={batch}", f"data.seq_len={seq}",
                f"precision.loss_scale_init={init}", "precision.growth_interval=1000")
    tokens = float(np.sum(next(type(t.data)(t.cfg, 0, 1))["loss_mask"]))  # its first batch's
    for _ in range(20):
        r = t.step()
        if not r["skipped"]:
            return r["loss_scale"], tokens
    raise AssertionError(f"no scale from {init} down fits at {batch} x {seq}")


def test_the_scale_multiplies_the_mean_loss_so_the_overflow_point_follows_the_token_count(tmp_path):
    """What the fp16 backward carries is scale x d(mean loss): per token that is scale / N times
    the token's own gradient (N counted tokens), and the first fp16 value, the softmax gradient
    s (p - onehot) with |p - onehot| just under 1 at init, overflows at s > 65504. So the largest
    power-of-two scale that fits is 2**16 x N, bounded from both sides: 2**24 at 256 tokens and,
    with 16x the tokens, 16x larger, 2**28 at 4,096. Scaling the summed loss (s = scale) fits the
    same 2**16 at any N. (The default-scale test above cannot tell the two apart: the default
    fits either way, the weight gradients, sums over tokens, being fp32 (model/projection.py).)"""
    fits = {}
    for batch, seq, init in ((8, 32, 2.0 ** 26), (16, 256, 2.0 ** 30)):  # 2**2 above each fit
        scale, tokens = first_fitting_scale(tmp_path / str(batch), batch, seq, init)
        assert tokens == batch * seq  # every target counted (the Markov source masks none)
        # The cotangent of each token's loss: 2**16 fits (x (1 - p) < 65504), 2**17 overflowed.
        assert scale / tokens == 2.0 ** 16, (batch, seq, scale, tokens)
        fits[batch * seq] = scale
    assert fits == {256: 2.0 ** 24, 4096: 2.0 ** 28}, fits


def test_a_real_fp16_overflow_backs_off_until_it_fits(tmp_path):
    """No injected NaN: a scale of 2**30 really overflows fp16. Each overflowing step is skipped
    (parameters and optimizer state kept bitwise) and halves the scale, until a scale fits; from
    then on no step is skipped."""
    t = trainer(tmp_path, "precision.policy=fp16", "data.global_batch_size=8", "data.seq_len=32",
                f"precision.loss_scale_init={2.0 ** 30}", "precision.growth_interval=1000")
    before = host({k: t.state[k] for k in ("params", "opt_state")})
    records = []
    for _ in range(12):
        records.append(t.step())
        if records[-1]["skipped"]:  # nothing of the overflowed update was applied
            assert_trees_equal(host({k: t.state[k] for k in ("params", "opt_state")}), before)
    k = next(i for i, r in enumerate(records) if not r["skipped"])
    assert k >= 3, [r["loss_scale"] for r in records]  # several genuine overflows ...
    assert [r["loss_scale"] for r in records[:k + 1]] == [2.0 ** (30 - i) for i in range(k + 1)]  # ... each halving
    assert all(not np.isfinite(r["grad_norm"]) for r in records[:k])
    assert not any(r["skipped"] for r in records[k:]) and records[-1]["skipped_steps"] == k
    assert {r["loss_scale"] for r in records[k:]} == {2.0 ** (30 - k)}
    assert np.isfinite(records[-1]["loss"])
    after = host(t.state["params"])  # the clean steps were applied
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(after),
                                                        jax.tree_util.tree_leaves(before["params"])))


def _shards(tree) -> dict:
    return {(jax.tree_util.keystr(p), s.device.id): np.asarray(s.data)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] for s in x.addressable_shards}


def test_an_overflow_on_one_data_shard_is_skipped_by_every_shard(tmp_path):
    """data=2 x fsdp=2 x tensor=2, fp16: one token's embedding row is 1e5 (inf in fp16) and that
    token occurs only in the rows of batch shard 0, so only that shard's activations and gradients
    overflow. Every shard of the parameters, the optimizer state and the statistics is kept bitwise,
    and the scale backs off once."""
    t = trainer(tmp_path, "precision.policy=fp16", "precision.loss_scale_init=64", "mesh.data=2", "mesh.fsdp=2",
                "mesh.tensor=2", "model.num_heads=4", "model.num_kv_heads=2", "data.global_batch_size=8",
                "data.seq_len=32", devices=8)
    t.step()
    poison = t.cfg.model.vocab_size - 1
    params = jax.device_get(t.state["params"])
    params["embed"] = params["embed"].copy()
    params["embed"][poison] = 1e5
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, t.state["params"])
    t.state["params"] = jax.tree_util.tree_map(jax.device_put, params, shardings)
    local = next(t.data)
    local = {k: np.array(local[k]) for k in BATCH_KEYS}
    local["tokens"][local["tokens"] == poison] = 0
    local["tokens"][0, 5] = poison  # row 0: on batch shard 0 (rows 0-1 of 8 over data x fsdp = 4)
    batch = global_batch(local, t.mesh, t.rules)
    holders = {s.device.id for s in batch["tokens"].addressable_shards if poison in np.asarray(s.data)}
    first = {s.device.id for s in batch["tokens"].addressable_shards if (s.index[0].start or 0) == 0}
    assert holders == first and len(holders) < 8  # only batch shard 0's devices (its tensor replicas) see it
    before = {k: _shards(t.state[k]) for k in ("params", "opt_state", "stability")}
    t.state, metrics = t.layout.jit_train_step()(t.state, batch, t.layout.chaos_factor())
    assert bool(metrics["skipped"]) and bool(metrics["nonfinite"])
    for k in ("params", "opt_state"):
        after = _shards(t.state[k])
        assert after.keys() == before[k].keys()
        for key, value in before[k].items():
            assert np.array_equal(after[key], value, equal_nan=True), (k, key)
    stats_after = _shards(t.state["stability"])
    for key, value in before["stability"].items():
        if "skipped_steps" not in key[0]:
            assert np.array_equal(stats_after[key], value, equal_nan=True), key
    assert float(t.state["loss_scale"]["scale"]) == 32.0


def test_large_finite_gradients_count_as_finite():
    """Elements of 1e20 are finite, but their fp32 sum of squares is not: `finite` comes from every
    element, and the norm of such a tree is still finite and right."""
    grads = {"a": jnp.full((4, 4), 1e20, jnp.float32), "b": jnp.ones((3,), jnp.float32)}
    assert not np.isfinite(float(jnp.sqrt(sum(jnp.sum(g * g) for g in grads.values()))))  # what the norm did
    finite = all_finite(grads)
    assert bool(finite)
    assert float(global_norm(grads, finite)) == pytest.approx(4e20, rel=1e-6)
    assert float(global_norm({"b": jnp.ones((4,))}, finite)) == 2.0
    assert not bool(all_finite({**grads, "c": jnp.array([1.0, jnp.inf])}))
    assert not bool(all_finite({**grads, "c": jnp.array([jnp.nan])}))


def test_a_step_with_huge_finite_gradients_is_not_skipped(tmp_path):
    """The step itself: a drill multiplies step 2's loss by 1e20 (fp32), so its gradients have
    elements around 1e19..1e20. The step is finite and applied (clipping tames it), the
    reported norm is finite, and the scale-free policy skips nothing."""
    t = trainer(tmp_path, "data.global_batch_size=8", "data.seq_len=32", "chaos.spike_at_steps=[2]",
                "chaos.spike_factor=1e20")
    records = [t.step() for _ in range(3)]
    assert not any(r["skipped"] for r in records), records
    assert np.isfinite(records[1]["grad_norm"]) and records[1]["grad_norm"] > 1e19


# ----------------------------------------------------------------------------- fp32 gradient reduction


def reductions_after_partitioning(policy: str, tmp_path) -> list[str]:
    """The all-reduce / reduce-scatter instructions of the data=2 x fsdp=4 train step right after
    XLA's SPMD partitioner (before the CPU backend upcasts 16-bit reductions to fp32, which would
    hide a bf16 reduction in the final HLO)."""
    cfg = load_config(TINY, [*ONE_LAYER, "data.global_batch_size=8", "data.seq_len=32", f"precision.policy={policy}",
                             "mesh.data=2", "mesh.fsdp=4", "model.vocab_size=96"])
    layout = build_layout(cfg, build_mesh(cfg.mesh, jax.devices()[:8]))
    dump = tmp_path / policy
    compiled = layout.lower_train_step().compile({"xla_dump_to": str(dump), "xla_dump_hlo_pass_re": "spmd-partitioning"})
    after = [f for f in os.listdir(dump) if "after_spmd-partitioning" in f and f.endswith(".txt")]
    assert after, sorted(os.listdir(dump))[:20]
    lines = [line.strip() for f in after for line in (dump / f).read_text().splitlines()
             if re.search(r" (all-reduce|reduce-scatter)(-start)?\(", line)]
    final = [line for line in compiled.as_text().splitlines() if re.search(r" (all-reduce|reduce-scatter)(-start)?\(", line)]
    return lines, final


@pytest.mark.parametrize("policy", ["fp16", "bf16"])
def test_weight_gradients_are_reduced_in_fp32(policy, tmp_path):
    """Every cross-device reduction of a data x fsdp step sums fp32: the layers' weight gradients
    leave their matmuls in fp32 (jaxtrain/model/projection.py). Before, 14 of the fp16 step's 40
    all-reduces (every layer weight's) ran in f16, and the bf16 step's in bf16."""
    lines, final = reductions_after_partitioning(policy, tmp_path)
    shaped = [line for line in lines if re.search(r"= \(?[a-z0-9]+\[\d", line)]  # not just scalars
    assert len(shaped) >= 7, lines  # the seven layer matmul weights (at least) are reduced here
    for line in lines:
        types = set(re.findall(r"\b(f16|bf16|f32|f64)\[", line.split(" all-reduce(")[0].split(" reduce-scatter(")[0]))
        assert not types & {"f16", "bf16"}, line[:200]  # f32 (or a pred: the isfinite reduction)
    for line in final:  # the compiled step too (fp16 is not upcast on the CPU: this is the real program)
        head = line.split("all-reduce(")[0].split("reduce-scatter(")[0]
        assert "f16[" not in head, line[:200]
