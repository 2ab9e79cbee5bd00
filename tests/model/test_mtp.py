"""Multi-token prediction (jaxtrain/model/mtp.py): the train step's mtp_loss against a float64 numpy
computation from the model's own hidden states and weights; mtp_loss_weight=0 leaving the main loss
and every other gradient bitwise as without MTP; context parallelism agreeing with data parallelism;
`jaxtrain train` logging a falling mtp_loss; mesh.stage > 1 refused in one line."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import TINY, read_jsonl
from trees import assert_trees_close

from jaxtrain.config import load_config
from jaxtrain.model.llama import Transformer
from jaxtrain.parallel.sharding import Partitioning, global_batch
from jaxtrain.trainer import Trainer

B, L, V, D = 8, 16, 64, 32
BASE = [
    f"model.vocab_size={V}", f"model.d_model={D}", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.attention=xla",
    f"data.seq_len={L}", f"data.global_batch_size={B}", "train.steps=1", "optim.warmup_steps=0",
    "optim.learning_rate=1e-3", "checkpoint.compilation_cache_dir=null", "run.seed=3",
]


def packed_batch(seed: int = 0) -> dict:
    """Rows of two or three documents and some padding (segment 0): loss_mask 0 where the target is
    padding or in the next document, as the data pipeline packs them."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, V, size=(B, L + 1)).astype(np.int32)
    seg = np.zeros((B, L + 1), np.int32)
    pos = np.zeros((B, L + 1), np.int32)
    for b in range(B):
        cuts = sorted(rng.choice(np.arange(2, L - 1), size=2, replace=False))
        end = L + 1 - rng.integers(0, 3)  # up to 2 padding tokens
        starts = [0, *cuts]
        for i, s in enumerate(starts):
            e = starts[i + 1] if i + 1 < len(starts) else end
            seg[b, s:e], pos[b, s:e] = i + 1, np.arange(e - s)
    return {"tokens": seq[:, :L], "targets": seq[:, 1:], "segment_ids": seg[:, :L], "positions": pos[:, :L],
            "loss_mask": ((seg[:, :L] > 0) & (seg[:, :L] == seg[:, 1:])).astype(np.float32)}


def one_step(overrides: list[str], batch: dict, devices=None) -> tuple[dict, dict, dict]:
    """(metrics, gradients, the parameters before the step) of one train step on `batch`."""
    trainer = Trainer(load_config(None, BASE + overrides), write_files=False, devices=devices or jax.devices())
    params = jax.device_get(trainer.state["params"])
    state = jax.tree_util.tree_map(lambda x: x.copy(), trainer.state)
    _, metrics, grads = trainer.layout.jit_train_step(return_grads=True)(
        state, global_batch(batch, trainer.mesh, trainer.rules), trainer.layout.chaos_factor())
    return jax.device_get(metrics), jax.device_get(grads), params


def rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def test_mtp_loss_matches_float64_hand_computation():
    depth = 2
    batch = packed_batch(0)
    overrides = [f"model.mtp_depth={depth}", "model.mtp_loss_weight=0.3", "mesh.data=1"]
    metrics, _, params = one_step(overrides, batch, jax.devices()[:1])
    cfg = load_config(None, BASE + overrides).model

    # The model's own decoder output (before the final norm), in fp32, from the same parameters.
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model)
    model = nnx.merge(graphdef, params)
    h, _ = model.hidden_and_stats(jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                                  jnp.asarray(batch["segment_ids"]), final_norm=False)
    h = np.asarray(h, np.float64)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    eps = cfg.norm_eps
    block_graphdef = nnx.split(model.mtp)[0]

    tok, tgt, seg, mask = batch["tokens"], batch["targets"], batch["segment_ids"], batch["loss_mask"]
    losses = []
    for d in range(1, depth + 1):
        layer = jax.tree_util.tree_map(lambda a: a[d - 1], p["mtp"])
        # Module d at position t embeds token t + d and predicts token t + 1 + d (= targets[t + d]).
        emb_tok = np.zeros_like(tok)
        emb_tok[:, :L - d] = tok[:, d:]
        x = np.concatenate([rms_norm(h, layer["hnorm"]["scale"], eps),
                            rms_norm(p["embed"][emb_tok], layer["enorm"]["scale"], eps)], axis=-1) @ layer["eh_proj"]
        # The module's transformer block, run alone on that input (its own weights).
        one = nnx.merge(block_graphdef, jax.tree_util.tree_map(lambda a: a[d - 1], params["mtp"]))
        h = np.asarray(one.block(jnp.asarray(x, jnp.float32), jnp.asarray(batch["positions"]),
                                 jnp.asarray(seg), jnp.float32, Partitioning()), np.float64)
        logits = rms_norm(h, p["final_norm"]["scale"], eps) @ p["head"]
        lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
        total, count = 0.0, 0
        for b in range(B):
            for t in range(L - d):
                if seg[b, t + d] == seg[b, t] and mask[b, t + d]:
                    total += lse[b, t] - logits[b, t, tgt[b, t + d]]
                    count += 1
        assert 0 < count < B * (L - d) - B  # the document boundaries and the padding masked some
        losses.append(total / count)
    np.testing.assert_allclose(metrics["mtp_loss"], np.mean(losses), rtol=2e-5)
    assert abs(losses[0] - losses[1]) > 1e-4  # the depths differ: a mean of two different things


def test_zero_weight_leaves_main_loss_and_gradients_bitwise():
    batch = packed_batch(1)
    base, two = ["mesh.data=2"], jax.devices()[:2]
    m0, g0, p0 = one_step(base, batch, two)
    m1, g1, p1 = one_step([*base, "model.mtp_depth=1", "model.mtp_loss_weight=0"], batch, two)
    assert set(p1) == set(p0) | {"mtp"}
    for name in p0:  # the shared part starts from the same values
        jax.tree_util.tree_map(np.testing.assert_array_equal, p1[name], p0[name])
    assert m1["loss"] == m0["loss"] and m1["mtp_loss"] > 0
    for name in g0:
        jax.tree_util.tree_map(np.testing.assert_array_equal, g1[name], g0[name])
    assert all(np.all(g == 0) for g in jax.tree_util.tree_leaves(g1["mtp"]))
    # With a weight, the modules learn and the shared parameters' gradients change.
    m2, g2, _ = one_step([*base, "model.mtp_depth=1", "model.mtp_loss_weight=0.5"], batch, two)
    assert m2["loss"] == m0["loss"] and m2["mtp_loss"] == m1["mtp_loss"]
    assert all(np.any(g != 0) for g in jax.tree_util.tree_leaves(g2["mtp"]))
    assert not np.array_equal(g2["head"], g0["head"]) and not np.array_equal(g2["embed"], g0["embed"])


def test_context_parallel_and_grad_accum_equal_data_parallel():
    """The shifted targets are made before the zig-zag permutation and the microbatch split."""
    batch = packed_batch(2)
    common = ["model.mtp_depth=2"]
    m8, g8, _ = one_step(["mesh.data=8", *common], batch)
    mc, gc, _ = one_step(["mesh.data=4", "mesh.context=2", "train.grad_accum=2", *common], batch)
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert abs(mc[key] - m8[key]) <= 1e-5 * abs(m8[key]), key
    assert_trees_close(gc, g8, 1e-4, "gradient ")


def jaxtrain(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_cli_logs_a_falling_mtp_loss(tmp_path):
    out = tmp_path / "run"
    result = jaxtrain("train", "--config", TINY, f"run.output_dir={out}", "model.mtp_depth=1", "train.steps=60",
                      "train.log_every=10", "--cpu-devices", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "mtp_loss" in r]
    assert len(records) >= 5
    assert records[-1]["mtp_loss"] < records[0]["mtp_loss"] - 0.3, [r["mtp_loss"] for r in records]


def test_mtp_under_a_pipeline_exits_2_in_one_line(tmp_path):
    out = tmp_path / "run"
    result = jaxtrain("train", "--config", TINY, f"run.output_dir={out}", "model.mtp_depth=1", "mesh.stage=2",
                      "--cpu-devices", "8", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "model.mtp_depth=1 with mesh.stage=2" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()
