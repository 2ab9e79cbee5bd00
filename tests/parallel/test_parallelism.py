"""Every parallel layout computes what one device computes: loss, gradients, parameters after 3 steps."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from trees import assert_trees_close, assert_trees_differ

from jaxtrain.config import load_config
from jaxtrain.parallel.sharding import bytes_per_device, global_batch
from jaxtrain.train.step import BATCH_KEYS
from jaxtrain.trainer import Trainer

# Sizes chosen so every weight dimension divides by 8 (tensor=8 needs heads and kv_heads of 8).
BASE = [
    "model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=8",
    "model.num_kv_heads=8", "model.head_dim=8", "model.mlp_dim=64", "model.attention=xla",
    "data.seq_len=16", "data.global_batch_size=16", "train.steps=3", "optim.warmup_steps=0",
    "optim.learning_rate=1e-3",  # Adam magnifies float noise in ~0 gradients by lr
]
# Parameters after 3 Adam steps, relative to each leaf's largest entry: Adam divides by sqrt(v), so
# a gradient entry near zero turns its float noise into an update of up to lr. jax 0.12.1's fusions
# gave 1.6e-4 on Gemma 3 at data=2 x tensor=4 (0.12.0: < 1e-4); every parameter moves by > 3e-3.
PARAM_RTOL = 3e-4
GQA = ["model.num_kv_heads=4"]
QK_NORM = ["model.qk_norm=true"]  # Qwen3's per-head q/k RMSNorm: its [head_dim] scales replicated
# Gemma 3's layer: (1 + w) norms (four per layer and q/k), scaled embeddings, GeGLU, q scaled by
# query_pre_attn_scalar, local layers (window 4 of 16) with their own rope and a global one with linear rope.
GEMMA3 = ["model.num_layers=3", "model.sliding_window=4", "model.sliding_window_pattern=3", "model.post_norms=true",
          "model.norm_plus_one=true", "model.embed_scale=true", "model.mlp_activation=gelu_tanh",
          "model.query_pre_attn_scalar=12", "model.rope_local_theta=500", "model.rope_scaling=linear",
          "model.rope_scaling_factor=2", *QK_NORM]
# DeepSeek's multi-head latent attention: q and kv latents (replicated), Hv 6 != Hqk 8, YaRN with
# mscale != mscale_all_dim (both its factors != 1).
MLA = ["model.kv_lora_rank=16", "model.q_lora_rank=12", "model.qk_nope_head_dim=4", "model.qk_rope_head_dim=4",
       "model.v_head_dim=6", "model.rope_scaling=yarn", "model.rope_scaling_factor=4", "model.rope_original_max_len=8",
       "model.rope_yarn_mscale=0.5", "model.rope_yarn_mscale_all_dim=1"]
# The DeepSeek-V3 family whole: MLA, a dense first layer, then MoE layers with sigmoid group-limited
# routing (4 groups of 2 experts, 2 groups kept), routed scaling, a shared expert, the aux-loss-free
# bias moving, and one multi-token-prediction module.
DEEPSEEK = [*MLA, "model.num_layers=3", "model.first_dense_layers=1", "model.num_experts=8",
            "model.experts_per_token=2", "model.moe_mlp_dim=16", "model.moe_router=sigmoid", "model.moe_n_group=4",
            "model.moe_topk_group=2", "model.moe_routed_scaling_factor=2.5", "model.num_shared_experts=1",
            "model.router_bias_update_rate=0.01", "model.mtp_depth=1"]

LAYOUTS = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "tensor8": ["mesh.data=1", "mesh.tensor=8"],
    "data2_fsdp2_tensor2_gqa": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *GQA],
    "data2_tensor4_gqa_qknorm": ["mesh.data=2", "mesh.tensor=4", *GQA, *QK_NORM],
    "fsdp8_qknorm": ["mesh.data=1", "mesh.fsdp=8", *QK_NORM],
    "data2_tensor4_gqa_gemma3": ["mesh.data=2", "mesh.tensor=4", *GQA, *GEMMA3],
    "fsdp8_gemma3": ["mesh.data=1", "mesh.fsdp=8", *GEMMA3],
    "data2_fsdp2_tensor2_mla": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *MLA],
    "data2_tensor4_mla": ["mesh.data=2", "mesh.tensor=4", *MLA],
    "data2_expert4_deepseek": ["mesh.data=2", "mesh.expert=4", *DEEPSEEK],
    "data2_fsdp2_tensor2_deepseek": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *DEEPSEEK],
}


def run(overrides: list[str], devices) -> tuple[dict, dict, list[float], dict]:
    """(metrics of the first step, the gradients that step applied, losses of 3 steps, final params)."""
    trainer = Trainer(load_config(None, BASE + overrides + ["mesh.fsdp=1", "mesh.tensor=1", "mesh.data=1"]
                                  if len(devices) == 1 else BASE + overrides), write_files=False, devices=devices)
    # The compiled train step itself, under this layout's shardings, returning the gradients it applies.
    first = next(type(trainer.data)(trainer.cfg, 0, 1))
    batch = global_batch({k: first[k] for k in BATCH_KEYS}, trainer.mesh, trainer.rules)
    state = jax.tree_util.tree_map(lambda x: x.copy(), trainer.state)  # the step donates its input
    _, metrics, grads = trainer.layout.jit_train_step(return_grads=True)(state, batch, trainer.layout.chaos_factor())
    metrics, grads = jax.device_get(metrics), jax.device_get(grads)
    initial = jax.device_get(trainer.state["params"])
    losses = [trainer.step()["loss"] for _ in range(3)]
    assert losses[0] == float(metrics["loss"])  # the same step as the one the trainer runs
    final = jax.device_get(trainer.state["params"])
    # Every parameter moved by more than the tolerance it is compared with below, so "equal" is not
    # the trivial "nothing changed".
    assert_trees_differ(final, initial, PARAM_RTOL)
    return metrics, grads, losses, final


@pytest.fixture(scope="module")
def single_device_runs():
    one = jax.devices()[:1]
    runs: dict = {}

    def reference(model: tuple[str, ...]) -> tuple:
        """The one-device run of these model overrides, run once."""
        if model not in runs:
            runs[model] = run(list(model), one)
        return runs[model]
    return reference


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_device(layout, single_device_runs):
    overrides = LAYOUTS[layout]
    model = tuple(o for o in overrides if o.startswith("model."))
    ref_metrics, ref_grads, ref_losses, ref_params = single_device_runs(model)
    metrics, grads, losses, params = run(overrides, jax.devices())
    for key in ("loss", "grad_norm"):
        assert abs(metrics[key] - ref_metrics[key]) <= 1e-5 * abs(ref_metrics[key]), (key, metrics[key], ref_metrics[key])
    assert_trees_close(grads, ref_grads, 1e-4, "gradient ")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, PARAM_RTOL, "parameter after 3 steps ")


def test_fsdp8_splits_every_large_weight():
    trainer = Trainer(load_config(None, BASE + LAYOUTS["fsdp8"]), write_files=False)
    params = trainer.state["params"]
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    small = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        shard = x.addressable_shards[0].data
        if x.ndim >= 2 and x.size >= 1024:  # every matrix: split 8 ways along its `embed` dimension
            assert shard.size * 8 == x.size, (jax.tree_util.keystr(path), x.shape, shard.shape)
        else:
            small += x.nbytes
    per_device = bytes_per_device(params)
    assert len(per_device) == 8
    assert max(per_device.values()) <= total / 8 + small, (per_device, total, small)
    # Optimizer moments follow the parameters' shardings (ZeRO-3), not replicated copies.
    opt_bytes = bytes_per_device(trainer.state["opt_state"])
    opt_total = sum(x.nbytes for x in jax.tree_util.tree_leaves(trainer.state["opt_state"]))
    assert max(opt_bytes.values()) <= opt_total / 8 + 2 * small + 64


def test_mixed_layout_compiles_without_resharding_whole_tensors(capfd):
    """XLA warns when it must replicate a tensor to reshard it (an all-gather of everything, then a
    slice): the embedding lookup under data x fsdp x tensor used to do that."""
    # No compilation cache: a cache hit would skip the compile, and with it the warning.
    cfg = load_config(None, BASE + LAYOUTS["data2_fsdp2_tensor2_gqa"] + ["checkpoint.compilation_cache_dir=null"])
    trainer = Trainer(cfg, write_files=False)
    trainer._compile()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
