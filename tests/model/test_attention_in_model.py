"""The model's attention dispatch: a full train step with the Pallas kernel equals the XLA reference;
which implementation `auto` picks for a platform, dtype and set of installed libraries.

The sequence (136) is longer than the kernels' 128-row tiles and not a multiple of them, and the
packed rows put a document across the tile boundary: a tiling bug (a lost tile, wrong causal
bounds past the first tile, the padded tail) changes the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Packed, pack_at
from trees import assert_trees_close, assert_trees_differ

import jaxtrain.kernels as kernels
from jaxtrain.config import ConfigError, load_config
from jaxtrain.model.attention import attend, repeat_kv_heads, resolve_attention
from jaxtrain.parallel.sharding import Partitioning, global_batch
from jaxtrain.train.step import BATCH_KEYS
from jaxtrain.trainer import Trainer

L = 136  # > the 128-row default tile, not a multiple of it (padded to 2 tiles)
assert L > kernels.BlockSizes().block_q and L % kernels.BlockSizes().block_q
SMALL = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", f"data.seq_len={L}",
         "data.global_batch_size=4", "optim.warmup_steps=0", "mesh.data=1", "checkpoint.compilation_cache_dir=null"]
# Document boundaries at 10 and 132: the second document spans the tile boundary at 128.
BOUNDS = (10, 132)



def run(attention: str, mesh: tuple[str, ...] = (), devices: int = 1, steps: int = 3):
    """(first step's metrics, the gradients it applied, params after `steps` steps) on packed rows."""
    trainer = Trainer(load_config(None, SMALL + [f"model.attention={attention}", *mesh]), write_files=False,
                      devices=jax.devices()[:devices])
    first = pack_at(next(type(trainer.data)(trainer.cfg, 0, 1)), BOUNDS)  # the batch of the trainer's first step
    first = global_batch({k: first[k] for k in BATCH_KEYS}, trainer.mesh, trainer.rules)
    state = jax.tree_util.tree_map(lambda x: x.copy(), trainer.state)  # the step donates its input
    _, metrics, grads = trainer.layout.jit_train_step(return_grads=True)(state, first, trainer.layout.chaos_factor())
    trainer.data = Packed(trainer.data, BOUNDS)
    initial = jax.device_get(trainer.state["params"])
    losses = [trainer.step()["loss"] for _ in range(steps)]
    assert losses[0] == float(metrics["loss"])  # the trainer's first step ran on that same packed batch
    final = jax.device_get(trainer.state["params"])
    assert_trees_differ(final, initial, 1e-4)
    return jax.device_get(metrics), jax.device_get(grads), final


def assert_same_step(got, want) -> None:
    (m_got, g_got, p_got), (m_want, g_want, p_want) = got, want
    for key in ("loss", "grad_norm"):
        assert abs(m_got[key] - m_want[key]) <= 1e-5 * abs(m_want[key]), (key, m_got[key], m_want[key])
    assert_trees_close(g_got, g_want, 1e-4, "gradient ")
    assert_trees_close(p_got, p_want, 1e-4, "parameter after 3 steps ")


@pytest.fixture(scope="module")
def xla_one_device():
    return run("xla")


def test_pallas_train_step_equals_xla(xla_one_device):
    assert_same_step(run("pallas"), xla_one_device)


def test_auto_on_a_gpu_without_triton_resolves_by_dtype():
    """cuDNN has no fp32 attention: `auto` on a GPU without jax-triton picks XLA for fp32 (the
    default policy) and cuDNN for bf16/fp16, in the startup check and in the model alike."""
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1}
    no_triton, with_triton = ("xla", "cudnn"), ("xla", "triton", "cudnn")
    cfg = {p: load_config(None, SMALL + [f"precision.policy={p}"]) for p in ("fp32", "bf16", "fp16")}
    assert resolve_attention(cfg["fp32"], "gpu", sizes, available=no_triton) == "xla"
    assert resolve_attention(cfg["bf16"], "gpu", sizes, available=no_triton) == "cudnn"
    assert resolve_attention(cfg["fp16"], "gpu", sizes, available=no_triton) == "cudnn"
    assert resolve_attention(cfg["fp32"], "gpu", sizes, available=with_triton) == kernels.AUTO_GPU_IMPLEMENTATION
    assert resolve_attention(cfg["fp32"], "gpu", sizes, dtype=jnp.bfloat16, available=no_triton) == "cudnn"
    explicit = load_config(None, SMALL + ["model.attention=cudnn"])
    with pytest.raises(ConfigError, match="model.attention=cudnn: .*bf16 or fp16"):
        resolve_attention(explicit, "gpu", sizes, available=no_triton)
    # The model's own call: fp32 q/k/v under `auto` on that GPU runs XLA (here: the reference), not cuDNN.
    q = jax.random.normal(jax.random.key(0), (1, 24, 4, 16), jnp.float32)
    k, v = jax.random.normal(jax.random.key(1), (2, 1, 24, 2, 16), jnp.float32)
    got = attend(q, k, v, None, "auto", Partitioning(), platform="gpu", available=no_triton)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kernels.mha_reference(q, k, v, causal=True)))


def test_unavailable_attention_is_a_config_error():
    cfg = load_config(None, SMALL + ["model.attention=triton"])
    with pytest.raises(ConfigError, match="model.attention=triton"):
        resolve_attention(cfg, "cpu", {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1})


def test_pallas_under_data_and_tensor_parallelism_equals_single_device_xla(xla_one_device):
    """Kernels run per shard (shard_map): 2-way data x 2-way tensor gives the one-device answer."""
    assert_same_step(run("pallas", ("mesh.data=2", "mesh.tensor=2"), devices=4), xla_one_device)


@pytest.mark.parametrize("attention", ["pallas", "xla"])
def test_fewer_kv_heads_than_the_tensor_degree_equals_single_device_xla(attention, xla_one_device):
    """2 kv heads on 4-way tensor parallelism (as MaxText: kv heads replicated, not refused): each
    shard's one query head reads its own kv head; loss, every gradient leaf and the parameters after
    3 steps equal one device's."""
    assert_same_step(run(attention, ("mesh.tensor=4",), devices=4), xla_one_device)


def test_kv_heads_replicated_not_split_under_a_wider_tensor_axis():
    trainer = Trainer(load_config(None, SMALL + ["model.attention=pallas", "mesh.tensor=4"]), write_files=False,
                      devices=jax.devices()[:4])
    attn = trainer.state["params"]["blocks"]["attn"]
    assert attn["wk"].sharding.spec[2] is None and attn["wv"].sharding.spec[2] is None  # kv heads: whole
    assert attn["wq"].sharding.spec[2] == "tensor"  # query heads: split 4 ways


@pytest.mark.parametrize("kv, shards", [(2, 4), (1, 4), (4, 8), (6, 4), (4, 2), (3, 1)])
def test_repeated_kv_heads_line_up_with_each_shards_query_heads(kv, shards):
    """Against the GQA rule itself: after the repeat, shard s's query heads n read (n // (N/K'))
    a repeated head of shard s that is kv head n // (N/K)."""
    import math
    N = math.lcm(kv, shards) * 2
    k = jnp.arange(kv, dtype=jnp.float32).reshape(1, 1, kv, 1)
    rep = np.asarray(repeat_kv_heads(k, N, shards))[0, 0, :, 0]
    Kr = rep.shape[0]
    assert Kr % shards == 0 and N % Kr == 0
    for n in range(N):
        j = n // (N // Kr)
        assert j // (Kr // shards) == n // (N // shards)  # the repeated head is in the query head's shard
        assert rep[j] == n // (N // kv)  # and it is the kv head GQA assigns to query head n


def test_xla_attention_with_a_sharded_sequence_equals_one_device():
    """XLA partitions plain attention itself, so a rules table that splits `length` is fine there (the
    fused kernels refuse it: tests/test_config.py)."""
    assert_same_step(run("xla", ("mesh.fsdp=2", "mesh.rules={length: fsdp}"), devices=2), run("xla"))


def test_kernel_under_a_sharded_sequence_is_refused_at_trace_time_too():
    """Even past the config check (a model traced under other rules), per_shard refuses to split length."""
    from jaxtrain.parallel.mesh import build_mesh
    from jaxtrain.parallel.sharding import Partitioning
    cfg = load_config(None, SMALL + ["mesh.fsdp=2", "mesh.rules={length: fsdp}"])
    part = Partitioning(build_mesh(cfg.mesh, jax.devices()[:2]), cfg.mesh.rules)
    with pytest.raises(ConfigError, match="must see whole length"):
        part.per_shard(lambda x: x, (("batch", "length"),), ("batch", "length"), whole=("length",))
