"""The model's attention dispatch: a full train step with the Pallas kernel equals the XLA reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from trees import assert_trees_close, assert_trees_differ

from jaxtrain.config import ConfigError, load_config
from jaxtrain.model.attention import resolve_attention
from jaxtrain.parallel.sharding import global_batch
from jaxtrain.train.step import BATCH_KEYS
from jaxtrain.trainer import Trainer

SMALL = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", "data.seq_len=32",
         "data.global_batch_size=4", "optim.warmup_steps=0", "mesh.data=1", "checkpoint.compilation_cache_dir=null"]


def run(attention: str, mesh: tuple[str, ...] = (), devices: int = 1, steps: int = 3):
    """(first step's metrics, the gradients it applied, params after `steps` steps) on packed rows."""
    trainer = Trainer(load_config(None, SMALL + [f"model.attention={attention}", *mesh]), write_files=False,
                      devices=jax.devices()[:devices])
    # Packed rows: a document boundary mid-block (position 10), so the kernel's segment masking
    # and per-document positions are exercised, not just the causal mask.
    batches = []
    for _ in range(steps):
        batch = next(trainer.data)
        batch["segment_ids"][:] = np.where(np.arange(32) < 10, 1, 2)
        batch["positions"][:] = np.where(np.arange(32) < 10, np.arange(32), np.arange(32) - 10)
        batches.append(batch)
    first = global_batch({k: batches[0][k] for k in BATCH_KEYS}, trainer.mesh, trainer.rules)
    state = jax.tree_util.tree_map(lambda x: x.copy(), trainer.state)  # the step donates its input
    _, metrics, grads = trainer.layout.jit_train_step(return_grads=True)(state, first)
    trainer.data = iter(batches)
    initial = jax.device_get(trainer.state["params"])
    for _ in range(steps):
        trainer.step()
    final = jax.device_get(trainer.state["params"])
    assert_trees_differ(final, initial, 1e-4)
    return jax.device_get(metrics), jax.device_get(grads), final


def assert_same_step(got, want) -> None:
    (m_got, g_got, p_got), (m_want, g_want, p_want) = got, want
    for key in ("loss", "grad_norm"):
        assert abs(m_got[key] - m_want[key]) <= 1e-5 * abs(m_want[key]), (key, m_got[key], m_want[key])
    assert_trees_close(g_got, g_want, 1e-4, "gradient ")
    assert_trees_close(p_got, p_want, 1e-4, "parameter after 3 steps ")


def test_pallas_train_step_equals_xla():
    assert_same_step(run("pallas"), run("xla"))


def test_unavailable_attention_is_a_config_error():
    cfg = load_config(None, SMALL + ["model.attention=triton"])
    with pytest.raises(ConfigError, match="model.attention=triton"):
        resolve_attention(cfg, "cpu", {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1})


def test_pallas_under_data_and_tensor_parallelism_equals_single_device_xla():
    """Kernels run per shard (shard_map): 2-way data x 2-way tensor gives the one-device answer."""
    assert_same_step(run("pallas", ("mesh.data=2", "mesh.tensor=2"), devices=4), run("xla"))


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
