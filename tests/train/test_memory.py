"""Memory per device: vocab-sized tensors stay sharded, and the step needs little beyond its state.

Everything here is compile-only (`jit(...).lower(ShapeDtypeStructs).compile().memory_analysis()`),
as `jaxtrain inspect` measures: no multi-GB array is ever allocated, so the tests run at Llama-3
shapes on the 8 simulated CPU devices of tests/conftest.py.

- The sharded embedding lookup (`jaxtrain.model.llama.embed_lookup`) equals a plain `jnp.take` on
  the whole table, values and table gradient, under layouts that exercise each of its paths.
- Vocab-sized temporaries: at Llama-3-8B's D = 4096 with fsdp = 8, temporaries(V = 128,256) -
  temporaries(V = 1,024) <= 4 x V x D x 4 bytes / fsdp. Before, the embedding table was gathered
  whole in fp32 and its gradient was a full [V, D] fp32 scatter buffer on every device (> 4 GiB).
- Beyond the state: the compiled step's peak (arguments + temporaries + outputs - aliased) stays
  within a small factor of (state + gradients) / devices + activations on a wide, shallow model;
  initialisation's per-device output and temporaries are of the sharded state, not the whole.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from jaxtrain.config import load_config
from jaxtrain.model.llama import embed_lookup
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.parallel.sharding import Partitioning
from jaxtrain.train.state import build_layout
from helpers import mesh_of

GiB = 2**30


@contextlib.contextmanager
def optimized():
    """XLA's usual optimisations for the duration (tests/conftest.py turns most of them off for
    compile time): memory figures are only meaningful for the program a real run compiles."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


DEFAULT = {"batch": ["data", "stage", "fsdp"], "length": None, "vocab": "tensor", "embed": "fsdp"}

# (mesh sizes, rules): each path of embed_lookup at least once.
LAYOUTS = {
    "fsdp8": ({"fsdp": 8}, DEFAULT),  # embed axis splits the tokens: gather ids, all-to-all rows back
    "data2-fsdp2-tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, DEFAULT),  # + vocab shards summed (psum)
    "vocab-over-fsdp": ({"fsdp": 4, "tensor": 2}, {**DEFAULT, "vocab": "fsdp", "embed": "tensor"}),  # psum_scatter; embed
    # over an axis that does not split the tokens (columns placed and summed)
    "embed-over-two-axes": ({"data": 2, "fsdp": 2, "tensor": 2},
                            {**DEFAULT, "batch": ["data", "fsdp", "tensor"], "vocab": None, "embed": ["fsdp", "tensor"]}),
    "length-split": ({"fsdp": 4, "tensor": 2}, {**DEFAULT, "batch": ["fsdp"], "length": "tensor", "vocab": None,
                                                 "embed": ["tensor", "fsdp"]}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_lookup_equals_take_values_and_table_gradient(name):
    sizes, rules = LAYOUTS[name]
    mesh = mesh_of(**sizes)
    part = Partitioning(mesh, rules)
    V, D, B, L = 64, 32, 8, 6
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(k1, (V, D), jnp.float32)
    tokens = jax.random.randint(k2, (B, L), 0, V)
    cotangent = jax.random.normal(k3, (B, L, D), jnp.float32)
    table_s = jax.device_put(table, NamedSharding(mesh, part.spec(("vocab", "embed"))))
    tokens_s = jax.device_put(tokens, NamedSharding(mesh, part.spec(("batch", "length"))))

    def objective(lookup):
        return lambda t, ids: jnp.sum(lookup(t, ids).astype(jnp.float32) * cotangent)

    sharded = lambda t, ids: embed_lookup(t, ids, jnp.bfloat16, part)
    plain = lambda t, ids: jnp.take(t, ids, axis=0).astype(jnp.bfloat16)
    got = jax.jit(sharded)(table_s, tokens_s)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(plain(table, tokens), np.float32))
    grad = jax.jit(jax.grad(objective(sharded)))(table_s, tokens_s)
    want = jax.grad(objective(plain))(table, tokens)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-5, atol=1e-5)
    # The gradient of the table is sharded like the table itself.
    assert grad.sharding.is_equivalent_to(table_s.sharding, 2)


def llama3_8b(vocab: int, *extra: str):
    """Llama-3-8B widths (D 4096, 32 heads, 8 kv heads of 128) with 1 layer and a small MLP; fsdp = 8."""
    return load_config("configs/llama3-8b.yaml", [
        f"model.vocab_size={vocab}", "model.num_layers=1", "model.mlp_dim=512", "data.seq_len=512",
        "data.global_batch_size=8", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", "model.attention=xla", *extra])


def hidden_grad_temporaries(vocab: int) -> int:
    """Temporaries per device of d(sum of the model's final hidden states)/d(params): the embedding
    side alone (no head, no loss), compiled from shapes on the layout's shardings."""
    cfg = llama3_8b(vocab)
    mesh = build_mesh(cfg.mesh, jax.devices())
    layout = build_layout(cfg, mesh)
    part = Partitioning(mesh, cfg.mesh.rules)
    params = layout.abstract_state()["params"]
    tokens = layout.abstract_batch()["tokens"]

    def objective(p, ids):
        model = nnx.merge(layout.graphdef, p)
        return jnp.sum(model.hidden(ids, part=part).astype(jnp.float32))

    fn = jax.jit(jax.grad(objective), out_shardings=layout.param_shardings)
    return fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_embedding_lookup_and_its_gradient_stay_sharded():
    """The embedding side alone: with fsdp = 8 the vocab-dependent temporaries are a fraction of the
    table's sharded size (the old gather-then-take held the whole fp32 table and a whole fp32
    scatter buffer per device: 2 x V x D x 4 = 3.9 GiB)."""
    V, D, fsdp = 128_256, 4096, 8
    with optimized():
        extra = hidden_grad_temporaries(V) - hidden_grad_temporaries(1024)
    shard = V * D * 4 / fsdp
    assert extra <= 1.5 * shard, f"{extra / GiB:.3f} GiB of vocab-sized temporaries (table shard {shard / GiB:.3f} GiB)"


def compiled_step(cfg):
    """The train step compiled from shapes alone, exactly as `jaxtrain inspect` compiles it."""
    mesh = build_mesh(cfg.mesh, jax.devices())
    layout = build_layout(cfg, mesh)
    return layout, layout.lower_train_step().compile()


@pytest.fixture(scope="module")
def llama3_8b_steps():
    """{vocab: (memory_analysis, optimized HLO text)} of the 1-layer Llama-3-8B-wide step, fsdp = 8."""
    out = {}
    with optimized():
        for vocab in (128_256, 1024):
            _, compiled = compiled_step(llama3_8b(vocab))
            out[vocab] = (compiled.memory_analysis(), compiled.as_text())
    return out


def test_no_embedding_sized_collective_or_scatter_in_the_step(llama3_8b_steps):
    """The embedding side inside the real step: no all-gather, all-reduce or scatter produces a
    whole [V, D] table (the embedding's orientation; the head's is [D, V]). Before, the step
    all-gathered the fp32 table, scatter-added its gradient into a whole fp32 [V, D] buffer and
    all-reduced that buffer (three 2 GiB values per device)."""
    hlo = llama3_8b_steps[128_256][1]
    whole = [line.strip()[:160] for line in hlo.splitlines()
             if "[128256,4096]" in line.split(" = ", 1)[-1].split("(", 1)[0]
             and any(f" {op}(" in line or f" {op}-start(" in line for op in ("all-gather", "all-reduce", "scatter"))]
    assert not whole, "whole embedding tables in the step:\n" + "\n".join(whole)


def test_vocab_sized_temporaries_fall_with_fsdp(llama3_8b_steps):
    """temporaries(V = 128,256) - temporaries(V = 1,024) <= 4 x V x D x 4 bytes / fsdp, the inspect
    figure (embedding and head together), at Llama-3-8B's D = 4096 with fsdp = 8.

    Four fp32 parameter shards: the two gradients and what the step needs around them. Measured
    0.95 GiB of 0.98: the fused loss's vocab-parallel head (never gathered; dW born sharded), the
    optimizer keeping its own state on a skipped step (no moment copies) and no `g / 1` copies of
    the gradients without fp16; on jax 0.12 also the clip as one scalar factor (optax's per-element
    select kept a clipped copy beside each gradient: 1.052 GiB, now 0.899). Before: 9.3 GiB (3fabe41);
    6.35 GiB with only the embedding side sharded."""
    V, D, fsdp = 128_256, 4096, 8
    extra = llama3_8b_steps[V][0].temp_size_in_bytes - llama3_8b_steps[1024][0].temp_size_in_bytes
    bound = 4 * V * D * 4 / fsdp
    assert extra <= bound, f"vocab-sized temporaries {extra / GiB:.3f} GiB per device > {bound / GiB:.3f} GiB"


def wide_and_shallow():
    """A wide, shallow model (D 2048, 1 layer, V 32,000, MLP 1,024: 150M parameters, 1.8 GB of fp32
    state with Adam) on fsdp = 8, where the state dwarfs the activations of 128 tokens per device."""
    return load_config("configs/llama3-70b.yaml", WIDE_AND_SHALLOW)


WIDE_AND_SHALLOW = [
    "model.num_layers=1", "model.vocab_size=32000", "model.mlp_dim=1024", "model.d_model=2048",
    "model.num_heads=16", "model.num_kv_heads=8", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1",
    "data.seq_len=128", "data.global_batch_size=8", "train.grad_accum=1", "model.attention=xla"]


def state_bytes_per_device(layout) -> float:
    """Bytes of the train state each device holds (its shards), from the abstract state."""
    total = 0
    for x in jax.tree_util.tree_leaves(layout.abstract_state()):
        total += int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
    return total


def test_initialisation_builds_only_each_devices_shards():
    """The compiled init writes each device's shards and nothing more: its per-device outputs are the
    sharded state, and its temporaries (the random bits) stay below that (an unsharded init, then a
    reshard, would hold the whole 1.8 GB state, 8 x this, on one device)."""
    cfg = wide_and_shallow()
    layout = build_layout(cfg, build_mesh(cfg.mesh, jax.devices()))
    with optimized():
        mem = jax.jit(layout.init_fn, out_shardings=layout.state_shardings).lower().compile().memory_analysis()
    state = state_bytes_per_device(layout)
    assert mem.output_size_in_bytes <= 1.01 * state
    assert mem.temp_size_in_bytes <= state, f"init temporaries {mem.temp_size_in_bytes / GiB:.3f} GiB"


INIT_UNDER_RUN_FLAGS = """
import json, sys
import jax
from jaxtrain.config import load_config
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.train.state import build_layout
cfg = load_config("configs/llama3-70b.yaml", sys.argv[1:])
layout = build_layout(cfg, build_mesh(cfg.mesh, jax.devices()))
lean = layout.compiled_init().memory_analysis()
plain = jax.jit(layout.init_fn, out_shardings=layout.state_shardings).lower().compile().memory_analysis()
print(json.dumps({"lean": lean.temp_size_in_bytes, "plain": plain.temp_size_in_bytes,
                  "state": lean.output_size_in_bytes}))
"""


def test_initialisation_under_the_runs_cpu_flags_needs_less_than_the_state():
    """`jaxtrain train` turns on YNNPACK's elementwise and reduce fusions on the CPU
    (jaxtrain/runtime/xla_cpu.py). Under them XLA compiled the shrunk llama3-70b's initialisation with
    27.7 GiB of temporaries for 7.83 GiB of state: a 29.7 GB allocation, refused at start-up on a
    24 GiB machine. The trainer's init (`StateLayout.compiled_init`) compiles without them: its
    temporaries stay below the state, in a process started with the run's flags, one device."""
    import json
    import os
    import subprocess
    import sys

    from jaxtrain.runtime.xla_cpu import cpu_xla_flags
    flags = cpu_xla_flags()
    if not flags:
        pytest.skip("this jaxlib is not one the CPU flags were checked with: jaxtrain sets none")
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}
    overrides = [o for o in WIDE_AND_SHALLOW if not o.startswith("mesh.fsdp")] + ["mesh.fsdp=1"]
    r = subprocess.run([sys.executable, "-c", INIT_UNDER_RUN_FLAGS, *overrides], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["lean"] <= 0.75 * got["state"], got  # (with the fusions: 4.1x here)
    print(f"init temporaries: {got['plain'] / GiB:.2f} GiB with the fusions, {got['lean'] / GiB:.2f} without; "
          f"state {got['state'] / GiB:.2f} GiB")


def test_step_peak_is_a_small_factor_of_state_and_gradients():
    """Peak per device of the compiled step (arguments + temporaries + outputs - aliased, as
    `jaxtrain inspect` reports it) <= 2 x ((state + gradients) / devices + activations). With the
    vocab tensors unsharded it was 4.6x, with the head still gathered 2.4x (0.90 GiB of 0.75); now
    1.3x (0.49 GiB). The donated state must alias its outputs."""
    cfg = wide_and_shallow()
    layout = build_layout(cfg, build_mesh(cfg.mesh, jax.devices()))
    with optimized():
        mem = layout.lower_train_step().compile().memory_analysis()
    m = cfg.model
    state = state_bytes_per_device(layout)
    grads = state / 3  # fp32 gradients of fp32 parameters, sharded like them (state: params + 2 Adam moments)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len / 8
    # Generous: 32 activations of [tokens, D + F] per layer in fp32, plus three loss chunks of logits.
    activations = 32 * tokens * (m.d_model + m.mlp_dim) * 4 * m.num_layers + 3 * 16 * 2**20
    assert mem.alias_size_in_bytes >= 0.99 * state, "the donated state does not alias the step's outputs"
    peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    bound = 2 * (state + grads + activations)
    assert peak <= bound, f"step peak {peak / GiB:.3f} GiB per device > {bound / GiB:.3f} GiB"


def test_the_guard_copies_no_optimizer_state():
    """The guard (keep the old state on a skipped step) costs no copy of the Adam moments: the
    step's temporaries with stability.guard on exceed those with it off by less than one of the
    largest moment shards ([32,000, 2,048] / fsdp 8 in fp32: 31 MiB). Selecting
    `where(skip, old, new)` over the optimizer's output state made XLA copy each large moment first
    (the new ones are written in place into the donated buffers the update still read): +76 MiB."""
    temps = {}
    for guard in ("true", "false"):
        cfg = load_config("configs/llama3-70b.yaml", [*WIDE_AND_SHALLOW, f"stability.guard={guard}"])
        layout = build_layout(cfg, build_mesh(cfg.mesh, jax.devices()))
        with optimized():
            temps[guard] = layout.lower_train_step().compile().memory_analysis().temp_size_in_bytes
    shard = 32_000 * 2048 * 4 / 8
    extra = temps["true"] - temps["false"]
    assert extra <= shard, f"the guard adds {extra / 2**20:.1f} MiB of temporaries (a moment shard: {shard / 2**20:.1f} MiB)"
