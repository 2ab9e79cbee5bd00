"""Every dispatch kind of jaxtrain/parallel/experts.py computes the same thing, forward and gradients,
on skewed routing (every count and offset differs, some experts get nothing): the GPU/TPU kinds
run here too, by name, so they are tested where the CPU would otherwise choose its own.

Dropless expert parallelism by ragged all-to-all (`_ragged_exchange`): XLA:CPU has no ragged-all-to-all (UNIMPLEMENTED on jax 0.10.2 and 0.12), so here the primitive is
replaced by `emulated_ragged_all_to_all`: `jax.lax.ragged_all_to_all`'s documented semantics built
from one dense all-to-all (checked against a numpy model of those semantics below). Everything
around it, the counts' all-gather, the send/receive offsets, the grouping by local expert, the
grouped matmuls and the way back, is the code that runs on GPU and TPU. On 8 simulated devices it
must equal the dispatch without a mesh, forward and every gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from trees import assert_trees_close

from jaxtrain.parallel.experts import RAGGED_ALL_TO_ALL_PLATFORMS, dispatch_kind, routed_experts, tile_rows
from jaxtrain.parallel.sharding import Partitioning


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` from a dense all-to-all: every peer's slice padded to the operand's rows."""
    n, rows = input_offsets.shape[0], operand.shape[0]
    idx = jnp.arange(rows)
    chunks = jnp.stack([jnp.where((idx < send_sizes[j])[:, None],
                                  operand[jnp.clip(input_offsets[j] + idx, 0, rows - 1)], 0) for j in range(n)])
    chunks = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [source, rows, ...]
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source writes here
    for i in range(n):
        at = jnp.where(idx < recv_sizes[i], offsets[i] + idx, output.shape[0])  # past the end: dropped
        output = output.at[at].set(chunks[i], mode="drop")
    return output


def test_the_emulation_follows_ragged_all_to_all_semantics():
    """Each device i sends operand[in_off[j]:+send[j]] to device j, written there at out_off[j]."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
    rng = np.random.default_rng(0)
    rows = 6
    sends = rng.integers(0, 3, (4, 4))  # sends[i, j]: rows i sends j
    operand = rng.normal(size=(4, rows, 2)).astype(np.float32)
    in_off = np.cumsum(sends, 1) - sends
    out_off = np.cumsum(sends, 0) - sends  # receiver j: by source
    want = np.zeros((4, 4 * rows, 2), np.float32)
    for i in range(4):
        for j in range(4):
            want[j, out_off[i, j]:out_off[i, j] + sends[i, j]] = operand[i, in_off[i, j]:in_off[i, j] + sends[i, j]]

    def local(op, io, ss, oo, rs):
        return emulated_ragged_all_to_all(op[0], jnp.zeros((4 * rows, 2)), io[0], ss[0], oo[0], rs[0],
                                          axis_name="expert")[None]

    spec = P("expert")
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))(
        operand, in_off.astype(np.int32), sends.astype(np.int32), out_off.astype(np.int32),
        sends.T.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(got), want)


E, K, D, F = 8, 2, 16, 8


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(8, 4, D)), jnp.float32)
    # Skewed routing: expert 0 takes many rows, some experts none, so every count and offset differs.
    p = np.array([6, 3, 2, 2, 1, 1, 0.5, 0.01]) / 15.51
    experts = np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(32)]).reshape(8, 4, K)
    gates = jnp.asarray(rng.uniform(0.1, 1.0, (8, 4, K)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, jnp.asarray(experts, jnp.int32), gates, w


@pytest.mark.parametrize("shape", [(2, 4, 1), (2, 2, 2)], ids=["data2_expert4", "data2_expert2_tensor2"])
def test_ragged_exchange_equals_dispatch_without_mesh(shape):
    x, experts, gates, w = inputs()
    mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "expert", "tensor"))
    part = Partitioning(mesh, {"batch": ["data", "expert"], "experts": "expert", "moe_mlp": "tensor"})

    def loss(x, gates, w, part, kind):
        y, dropped = routed_experts(x, experts, gates, *w, 0.0, jnp.float32, part, kind=kind,
                                    ragged_exchange=emulated_ragged_all_to_all)
        return jnp.sum(y * jnp.cos(y)), (y, dropped)

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    want_g, (want_y, _) = jax.jit(lambda *a: grad(*a, Partitioning(), "dropless-ragged_dot"))(x, gates, w)
    got_g, (got_y, dropped) = jax.jit(lambda *a: grad(*a, part, "dropless-ragged_all_to_all"))(x, gates, w)
    assert float(dropped) == 0
    assert_trees_close(jax.device_get(got_y), jax.device_get(want_y), 1e-5, "output ")
    assert_trees_close(jax.device_get(got_g), jax.device_get(want_g), 1e-5, "gradient ")
    # And it is what ran: only the ragged path all-gathers (the per-expert counts); the dense one
    # exchanges its [E, T, D] buffer by all-to-all alone.
    hlo = jax.jit(lambda *a: loss(*a, part, "dropless-ragged_all_to_all")[0]).lower(x, gates, w).as_text()
    assert "all_gather" in hlo or "all-gather" in hlo


@pytest.mark.parametrize("tokens", [32, 1024])
def test_single_device_kinds_agree(tokens):
    """Dropless ragged_dot (GPU/TPU), dropless tiled (the CPU) and capacity with room for every
    assignment (factor E / k) on one device: the same output and gradients."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(1, tokens, D)), jnp.float32)
    p = np.array([6, 3, 2, 2, 1, 1, 0.5, 0.01]) / 15.51
    experts = jnp.asarray(np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(tokens)])[None], jnp.int32)
    gates = jnp.asarray(rng.uniform(0.1, 1.0, (1, tokens, K)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]

    def run(kind, factor):
        def loss(x, gates, w):
            y, dropped = routed_experts(x, experts, gates, *w, factor, jnp.float32, kind=kind)
            return jnp.sum(y * jnp.cos(y)), (y, dropped)
        g, (y, dropped) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, gates, w)
        assert float(dropped) == 0
        return jax.device_get((y, g))

    want = run("dropless-ragged_dot", 0.0)
    for kind, factor in (("dropless-tiled", 0.0), ("capacity", E / K)):
        assert_trees_close(run(kind, factor), want, 1e-5, f"{kind} ")


def test_tiles_bound_the_padding():
    for assignments, experts in ((64, 8), (2048, 8), (65536, 64), (16, 128)):
        m = tile_rows(assignments, experts)
        assert 8 <= m <= 128 and m & (m - 1) == 0
        assert m == 8 or experts * m <= assignments // 4


def test_dispatch_is_chosen_by_platform():
    assert dispatch_kind(1.25, 4, "gpu") == "capacity"
    assert dispatch_kind(0, 1, "cpu") == "dropless-tiled"
    assert dispatch_kind(0, 4, "cpu") == "dropless-dense-all_to_all"
    for platform in RAGGED_ALL_TO_ALL_PLATFORMS:
        assert dispatch_kind(0, 1, platform) == "dropless-ragged_dot"
        assert dispatch_kind(0, 4, platform) == "dropless-ragged_all_to_all"


def test_tiled_dispatch_fills_its_tight_tile_bound():
    """The worst case of the tile count: every expert's rows one more than whole tiles (n_e = 1 mod m),
    so sum_e ceil(n_e / m) = (A + E (m - 1)) / m tiles, every one used: a bound one tile short drops
    the last expert's rows, and the tiled output leaves ragged_dot's."""
    tokens = 32
    m = tile_rows(tokens * K, E)
    assert m == 8
    counts = [9] * (E - 1) + [1]  # 1 mod 8 each, 64 assignments
    order = np.repeat(np.arange(E), counts)  # choice-major: token t's choices are order[t], order[t + 32]
    experts = jnp.asarray(np.stack([order[:tokens], order[tokens:]], axis=1)[None], jnp.int32)
    assert all(len(set(row)) == K for row in np.asarray(experts[0]))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(1, tokens, D)), jnp.float32)
    gates = jnp.asarray(rng.uniform(0.1, 1.0, (1, tokens, K)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    tiled, _ = routed_experts(x, experts, gates, *w, 0.0, jnp.float32, kind="dropless-tiled")
    ragged, _ = routed_experts(x, experts, gates, *w, 0.0, jnp.float32, kind="dropless-ragged_dot")
    assert_trees_close(jax.device_get(tiled), jax.device_get(ragged), 1e-5, "output ")
