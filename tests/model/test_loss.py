"""The fused, chunked loss (jaxtrain/model/loss.py) against the plain loss on materialised logits.

fp32: objective, cross-entropy and z-loss sums, and the gradients with respect to the hidden
states and the head, to 1e-5 relative, with masked tokens and with z-loss; alone, inside the
model's loss_sum, sharded over data x fsdp x tensor on 8 simulated devices (with dW accumulated
sharded like the head), and the train step's own gradients against autodiff of the mean loss
plus z-loss. fp16/bf16: the fused loss with a loss-scale cotangent against fp32.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.config import load_config
from jaxtrain.model.llama import Transformer
from jaxtrain.model.loss import chunk_length, fused_loss
from jaxtrain.parallel.sharding import Partitioning
from jaxtrain.train.step import loss_sum

TOL = 1e-5


def token_losses(logits_BLV, targets_BL):
    """Per-token cross-entropy and log-partition (logsumexp of the logits), both in fp32: the plain
    loss on materialised logits, the reference the fused loss is tested against."""
    logits_BLV = logits_BLV.astype(jnp.float32)
    lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return lse_BL - target_logit_BL, lse_BL


def plain_loss(x_BLD, head_DV, targets_BL, mask_BL, z_loss):
    """The loss as the model computed it before fusion: full logits, then token_losses."""
    logits = jnp.einsum("bld,dv->blv", x_BLD, head_DV, preferred_element_type=jnp.float32)
    ce_BL, lse_BL = token_losses(logits, targets_BL)
    ce, z = jnp.sum(ce_BL * mask_BL), jnp.sum(lse_BL * lse_BL * mask_BL)
    return ce + z_loss * z, ce, z


def inputs(B=4, L=24, D=16, V=50, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (B, L, D), jnp.float32)
    head = jax.random.normal(k[1], (D, V), jnp.float32) * 0.5  # logits of std ~2: a peaked softmax
    targets = jax.random.randint(k[2], (B, L), 0, V)
    mask = (jax.random.uniform(k[3], (B, L)) > 0.3).astype(jnp.float32)
    mask = mask.at[0].set(0.0)  # one whole row masked out
    return x, head, targets, mask


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def value_and_grads(fn, x, head, targets, mask, z_loss):
    def objective(x, head):
        total, ce, z = fn(x, head, targets, mask, z_loss)
        return total, (ce, z)
    (total, (ce, z)), (dx, dhead) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(x, head)
    return total, ce, z, dx, dhead


@pytest.mark.parametrize("z_loss", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [24, 8, 3])  # one chunk, a few, many
def test_fused_loss_equals_plain_loss_and_gradients(z_loss, chunk):
    x, head, targets, mask = inputs()
    want = value_and_grads(plain_loss, x, head, targets, mask, z_loss)
    got = value_and_grads(lambda *a: fused_loss(*a, chunk=chunk), x, head, targets, mask, z_loss)
    for name, g, w in zip(("objective", "ce", "z", "dx", "dhead"), got, want):
        assert rel(g, w) <= TOL, (name, rel(g, w))
    # The masked row gets no gradient; the z-loss term changes the gradient when on.
    assert float(jnp.max(jnp.abs(got[3][0]))) == 0.0
    assert float(jnp.abs(want[1] - want[0])) > 1.0 if z_loss else float(want[0]) == float(want[1])


def test_fused_loss_without_gradients_matches():
    x, head, targets, mask = inputs(seed=1)
    want = jax.jit(plain_loss, static_argnums=4)(x, head, targets, mask, 0.1)
    got = jax.jit(lambda *a: fused_loss(*a, chunk=6), static_argnums=4)(x, head, targets, mask, 0.1)
    for g, w in zip(got, want):
        assert rel(g, w) <= TOL


def test_gradient_scales_with_the_cotangent():
    """The stored unit gradients are multiplied by the incoming cotangent (the loss scale, fp16)."""
    x, head, targets, mask = inputs(seed=2)
    g1 = jax.grad(lambda h: fused_loss(x, h, targets, mask, chunk=8)[0])(head)
    g3 = jax.grad(lambda h: 3.0 * fused_loss(x, h, targets, mask, chunk=8)[0])(head)
    assert rel(g3, 3.0 * g1) <= TOL


def test_chunk_length_divides_and_fits():
    assert chunk_length(8, 256, 32000, chunk_bytes=16 * 2**20) == 16  # 8 x 16 x 32000 x 4 B = 16 MiB
    assert chunk_length(8, 256, 32000, chunk_bytes=2**40) == 256
    assert chunk_length(8, 256, 32000, chunk_bytes=1) == 1
    assert chunk_length(2, 100, 1000, chunk_bytes=2 * 30 * 1000 * 4) == 25  # largest divisor of 100 <= 30


def small_model_config(overrides=()):
    return load_config(None, ["model.vocab_size=96", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
                              "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.attention=xla",
                              "data.seq_len=16", "data.global_batch_size=8", *overrides])


def model_batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    B, L = cfg.data.global_batch_size, cfg.data.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((B, L), np.int32),
            "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
            "loss_mask": (rng.random((B, L)) > 0.2).astype(np.float32)}


def plain_loss_sum(params, graphdef, batch, z_loss):
    """step.loss_sum as it was before fusion: the model's logits, then token_losses."""
    model = nnx.merge(graphdef, params)
    logits = model(batch["tokens"], batch["positions"], batch["segment_ids"])
    mask = batch["loss_mask"].astype(jnp.float32)
    ce_BL, lse_BL = token_losses(logits, batch["targets"])
    ce, z = jnp.sum(ce_BL * mask), jnp.sum(lse_BL * lse_BL * mask)
    return ce + z_loss * z, (ce, z, jnp.sum(mask))


@pytest.mark.parametrize("tie", [False, True])
def test_loss_sum_equals_plain_loss_sum_on_the_model(tie):
    cfg = small_model_config([f"model.tie_embeddings={str(tie).lower()}"])
    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    batch = model_batch(cfg)
    grad = lambda f: jax.jit(jax.value_and_grad(lambda p: f(p, graphdef, batch, 0.01), has_aux=True))(params)
    (want_total, want_aux), want_g = grad(plain_loss_sum)
    (got_total, got_aux), got_g = grad(loss_sum)
    assert rel(got_total, want_total) <= TOL
    for g, w in zip(got_aux, want_aux):
        assert rel(g, w) <= TOL
    errors = jax.tree_util.tree_map(rel, got_g, want_g)
    assert max(jax.tree_util.tree_leaves(errors)) <= TOL, errors


def test_sharded_fused_loss_equals_plain_loss():
    """data=2 x fsdp=2 x tensor=2: batch split four ways, head over fsdp and vocab over tensor."""
    from jaxtrain.parallel.mesh import build_mesh
    cfg = load_config(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    mesh = build_mesh(cfg.mesh, jax.devices()[:8])
    rules = cfg.mesh.rules
    x, head, targets, mask = inputs(B=8, L=12, D=16, V=64, seed=3)
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, None)))
    head = jax.device_put(head, NamedSharding(mesh, P("fsdp", "tensor")))

    def sharded(*a):
        return fused_loss(*a, chunk=4, part=Partitioning(mesh, rules))

    want = value_and_grads(plain_loss, x, head, targets, mask, 0.1)
    got = value_and_grads(sharded, x, head, targets, mask, 0.1)
    for name, g, w in zip(("objective", "ce", "z", "dx", "dhead"), got, want):
        assert rel(g, w) <= TOL, (name, rel(g, w))
    # The compiled fp16 gradient (fp16: the CPU backend upcasts bf16 collectives to fp32, not fp16
    # ones). The head is never gathered: it is resharded once, in fp16, by an all-to-all to
    # [D, V / (tensor x fsdp)] = f16[16,16] per device, and the only all-gathers are each chunk's
    # hidden states over fsdp (f16[.., 2, 2, 4, 16]: the fsdp group's 2 x 2 rows of 4 positions, D=16).
    # dW is born sharded: the chunk loop carries one f32[1,16,16] per device (D=16, V=64 over
    # 4), never a whole-D f32[16,32] partial sum (what gathering the head gives), and no
    # dW-sized value is reduced inside the loop: the data shards' partials once, after it, then
    # one all-to-all into the parameter's [D/fsdp, V/tensor] = [8,32] layout.
    x_fp16 = x.astype(jnp.float16)
    hlo = jax.jit(jax.grad(lambda x, h: sharded(x, h, targets, mask, 0.1)[0], argnums=(0, 1))).lower(x_fp16, head).compile().as_text()
    collectives, computation = [], None
    for line in hlo.splitlines():
        if line.endswith("{") and " = " not in line:
            computation = line.split()[0] if not line.startswith("ENTRY") else "ENTRY"
        m = re.search(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(", line)
        if m:
            collectives.append((computation, m.group(2), m.group(1)))
    gathers = [shape for _, op, shape in collectives if op == "all-gather"]
    assert gathers and all(re.match(r"f16\[(1,)?2,2,4,16\]", g) for g in gathers), gathers
    assert any(c == "ENTRY" and op == "all-to-all" and shape.startswith("(f16") for c, op, shape in collectives), collectives
    carries = [line.split(" while(")[0] for line in hlo.splitlines() if " while(" in line]
    assert carries and all("f32[1,16,16]" in line for line in carries), carries
    assert not any("16,32]" in line or "f32[1,8,32]" in line for line in carries), carries
    # Inside the loop only per-token values move: [2, 2, 4] softmax statistics and the [2, 2, 4, 16]
    # dx partials (summed over the vocab slices).
    in_loop = [(op, shape) for c, op, shape in collectives if c != "ENTRY"]
    assert in_loop and all(re.match(r"f(16|32)\[(1,)?2,2,4(,16)?\]", shape) for _, shape in in_loop), in_loop
    assert [op for c, op, _ in collectives if c == "ENTRY"] == ["all-to-all", "all-reduce", "all-to-all"], collectives


@pytest.mark.parametrize("dtype, tol", [(jnp.float16, 2e-3), (jnp.bfloat16, 1e-2)])
def test_low_precision_fused_loss_follows_fp32_with_a_loss_scale(dtype, tol):
    """fp16/bf16 inputs, cotangent 2**12 (a loss scale), against the fp32 plain loss on the same
    rounded inputs. The softmax gradient is scaled before it is rounded to the compute dtype: in fp16
    the low-probability columns' p (~1e-5, subnormal) keep their precision. Rounded first and scaled
    after (the loss scale protecting nothing in the head), their dW was off by 1.4e-2."""
    x, head, targets, mask = inputs(B=4, L=32, D=32, V=2048, seed=5)
    head = head * 2.0  # a peaked softmax: most probabilities far below fp16's smallest normal 6e-5
    x_lp, c = x.astype(dtype), 2.0 ** 12
    ref_dx, ref_dW = jax.grad(lambda x, h: c * plain_loss(x, h, targets, mask, 0.0)[0], argnums=(0, 1))(
        x_lp.astype(jnp.float32), head.astype(dtype).astype(jnp.float32))

    def fused(grad_scale):
        f = lambda x, h: c * fused_loss(x, h, targets, mask, 0.0, chunk=8, grad_scale=grad_scale)[0]
        return jax.jit(jax.grad(f, argnums=(0, 1)))(x_lp, head)

    counted = np.asarray(targets)[np.asarray(mask) > 0]
    cols = np.setdiff1d(np.arange(head.shape[1]), counted)  # columns no counted token targets: p only
    want = np.asarray(ref_dW, np.float64)[:, cols]
    low = np.argsort(np.linalg.norm(want, axis=0))[:len(cols) // 2]  # the less probable half

    def column_error(dW):
        got = np.asarray(dW, np.float64)[:, cols]
        return float(np.max((np.linalg.norm(got - want, axis=0) / np.linalg.norm(want, axis=0))[low]))

    dx, dW = fused(c)
    assert dx.dtype == dtype and dW.dtype == jnp.float32
    assert rel(dx, ref_dx) <= tol and rel(dW, ref_dW) <= tol
    assert column_error(dW) <= tol, column_error(dW)
    if dtype == jnp.float16:  # rounded before the scale (grad_scale=1): the subnormals lose their digits
        assert column_error(fused(1.0)[1]) > 5 * column_error(dW)


def test_step_gradients_are_those_of_the_mean_loss_with_z_loss():
    """The train step's own gradients (return_grads; fp32, loss scale 1) with z_loss = 0.05 equal
    autodiff of mean(ce) + 0.05 mean(lse^2) over the counted tokens, on materialised logits: the sign,
    the coefficient and the normalisation of the z-loss term, and the reported metrics."""
    from jaxtrain.parallel.mesh import build_mesh
    from jaxtrain.train.state import build_layout
    w = 0.05
    cfg = small_model_config([f"stability.z_loss={w}", "optim.grad_clip_norm=0", "mesh.data=1"])
    layout = build_layout(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    state = layout.init()
    params = jax.device_get(state["params"])
    batch = model_batch(cfg, seed=4)

    def mean_objective(p):
        model = nnx.merge(layout.graphdef, p)
        logits = model(batch["tokens"], batch["positions"], batch["segment_ids"])
        ce_BL, lse_BL = token_losses(logits, batch["targets"])
        mask = batch["loss_mask"]
        n = np.sum(mask)
        return jnp.sum(ce_BL * mask) / n + w * jnp.sum(lse_BL ** 2 * mask) / n, (jnp.sum(ce_BL * mask) / n,
                                                                                 jnp.sum(lse_BL ** 2 * mask) / n)

    (_, (want_ce, want_z)), want = jax.jit(jax.value_and_grad(mean_objective, has_aux=True))(params)
    _, metrics, got = layout.jit_train_step(return_grads=True)(state, batch, layout.chaos_factor())
    errors = jax.tree_util.tree_map(rel, jax.device_get(got), want)
    assert max(jax.tree_util.tree_leaves(errors)) <= TOL, errors
    assert rel(metrics["loss"], want_ce) <= TOL and rel(metrics["z_loss"], want_z) <= TOL
    # A wrong coefficient would show: the z-loss term's own gradient is far above the tolerance.
    zero_z = jax.grad(lambda p: mean_objective(p)[1][0])(params)
    assert max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(rel, zero_z, want))) > 100 * TOL
