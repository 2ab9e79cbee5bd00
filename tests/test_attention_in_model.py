"""The model's attention dispatch: a full train step with the Pallas kernel equals the XLA reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.trainer import Trainer, resolve_attention

SMALL = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", "data.seq_len=32",
         "data.global_batch_size=4", "optim.warmup_steps=0", "mesh.data=1", "checkpoint.compilation_cache_dir=null"]


def one_step(attention: str, mesh: tuple[str, ...] = (), devices: int = 1):
    trainer = Trainer(load_config(None, SMALL + [f"model.attention={attention}", *mesh]), write_files=False,
                      devices=jax.devices()[:devices])
    # Packed rows: a document boundary mid-block (position 10), so the kernel's segment masking
    # and per-document positions are exercised, not just the causal mask.
    batch = next(trainer.data)
    batch["segment_ids"][:] = np.where(np.arange(32) < 10, 1, 2)
    batch["positions"][:] = np.where(np.arange(32) < 10, np.arange(32), np.arange(32) - 10)
    trainer.data = iter([batch])
    metrics = trainer.step()
    return metrics, jax.device_get(trainer.state["params"])


def test_pallas_train_step_equals_xla():
    (m_x, p_x), (m_p, p_p) = one_step("xla"), one_step("pallas")
    assert abs(m_p["loss"] - m_x["loss"]) <= 1e-5 * abs(m_x["loss"])
    assert abs(m_p["grad_norm"] - m_x["grad_norm"]) <= 1e-4 * abs(m_x["grad_norm"])
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_p, p_x)


def test_unavailable_attention_is_a_config_error():
    cfg = load_config(None, SMALL + ["model.attention=triton"])
    with pytest.raises(ConfigError, match="model.attention=triton"):
        resolve_attention(cfg, "cpu", {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1})


def test_pallas_under_data_and_tensor_parallelism_equals_single_device_xla():
    """Kernels run per shard (shard_map): 2-way data x 2-way tensor gives the one-device answer."""
    (m_x, p_x), (m_p, p_p) = one_step("xla"), one_step("pallas", ("mesh.data=2", "mesh.tensor=2"), devices=4)
    assert abs(m_p["loss"] - m_x["loss"]) <= 1e-5 * abs(m_x["loss"])
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_p, p_x)
