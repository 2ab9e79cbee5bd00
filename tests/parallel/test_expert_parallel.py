"""Expert parallelism computes what data parallelism computes: mesh.expert=4 x data=2 against
data=8 on the same 8 simulated devices (each device routes the same group of tokens in both, so
capacity and dropping agree too): loss, grad_norm, every gradient leaf, parameters after 3 steps;
also inside pipeline stages (GPipe and circular, with fsdp, tensor, interleaved and first dense
layers) against data=8 without a pipeline; and checkpoints restore across expert-parallel sizes
bitwise."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from trees import assert_trees_close, assert_trees_equal

from jaxtrain.config import load_config
from jaxtrain.parallel.sharding import global_batch
from jaxtrain.train.step import BATCH_KEYS
from jaxtrain.trainer import Trainer

BASE = [
    "model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=64", "model.attention=xla",
    "model.num_experts=8", "model.experts_per_token=2", "model.moe_mlp_dim=32",
    "model.moe_aux_loss=0.01", "model.router_z_loss=0.001",
    "data.seq_len=16", "data.global_batch_size=16", "train.steps=3", "optim.warmup_steps=0",
    "optim.learning_rate=1e-3", "checkpoint.compilation_cache_dir=null",
]


def run(overrides: list[str]) -> tuple[dict, dict, list[float], dict]:
    """(first step's metrics, its gradients, 3 steps' losses, final params and routing bias) on all 8
    devices."""
    trainer = Trainer(load_config(None, BASE + overrides), write_files=False, devices=jax.devices())
    first = next(type(trainer.data)(trainer.cfg, 0, 1))
    batch = global_batch({k: first[k] for k in BATCH_KEYS}, trainer.mesh, trainer.rules)
    state = jax.tree_util.tree_map(lambda x: x.copy(), trainer.state)
    _, metrics, grads = trainer.layout.jit_train_step(return_grads=True)(state, batch, trainer.layout.chaos_factor())
    metrics, grads = jax.device_get(metrics), jax.device_get(grads)
    losses = [trainer.step()["loss"] for _ in range(3)]
    return metrics, grads, losses, jax.device_get({"params": trainer.state["params"], "moe": trainer.state["moe"]})


def assert_runs_equal(got, want, rel=1e-5):
    (m, g, losses, params), (rm, rg, rlosses, rparams) = got, want
    for key in ("loss", "grad_norm", "moe_aux_loss", "router_z_loss", "moe_max_load", "moe_dropped_fraction"):
        assert abs(m[key] - rm[key]) <= rel * abs(rm[key]), (key, m[key], rm[key])
    assert_trees_close(g, rg, rel, "gradient ")
    np.testing.assert_allclose(losses, rlosses, rtol=rel)
    assert_trees_close(params, rparams, 1e-4, "after 3 steps ")


# Capacity large enough to drop nothing (factor E / k: every slot a group could need), and dropless.
DISPATCH = {"capacity": ["model.capacity_factor=4.0"], "dropless": ["model.capacity_factor=0"]}


@pytest.mark.parametrize("dispatch", sorted(DISPATCH))
def test_expert4_data2_equals_data8(dispatch):
    want = run(["mesh.data=8", *DISPATCH[dispatch]])
    got = run(["mesh.data=2", "mesh.expert=4", *DISPATCH[dispatch]])
    assert got[0]["moe_dropped_fraction"] == 0
    assert_runs_equal(got, want)


def test_expert4_data2_equals_data8_with_qwen3_moe_routing():
    """Qwen3-MoE's family: QK-norm, softmax top-k gates not renormalised (norm_topk_prob: false),
    a dense layer then an MoE layer (decoder_sparse_step: 2), dropless as transformers runs it."""
    common = ["model.qk_norm=true", "model.moe_norm_topk_prob=false", "model.moe_every=2", "model.capacity_factor=0"]
    want = run(["mesh.data=8", *common])
    got = run(["mesh.data=2", "mesh.expert=4", *common])
    assert_runs_equal(got, want)


def test_expert_parallel_with_fsdp_and_tensor_and_interleaved_dense_layers():
    """moe_every=2: a dense layer, then an MoE layer; the dense one's MLP split over tensor."""
    common = ["model.capacity_factor=4.0", "model.moe_every=2"]
    want = run(["mesh.data=8", *common])
    got = run(["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", *common])
    assert_runs_equal(got, want)


# Inside pipeline stages: 4 layers (or 5 with a first dense layer), the routing statistics summed
# over microbatches and stage replicas; each microbatch's groups are smaller than without the
# pipeline, so only a capacity that drops nothing (or dropless) can agree. A moving routing bias
# takes each layer's own load: a statistic put back in the wrong layer's place (circular: stage s,
# round r holds layer group r·S + s) moves another layer's bias.
PIPELINED = {
    "gpipe_expert2_data2_sigmoid_bias": (
        ["model.num_layers=4", "model.capacity_factor=4.0", "model.moe_router=sigmoid",
         "model.router_bias_update_rate=0.01"],
        ["mesh.data=2", "mesh.stage=2", "mesh.expert=2", "pipeline.microbatches=2"]),
    "circular_expert2_tensor2": (
        ["model.num_layers=4", "model.capacity_factor=4.0", "model.moe_router=sigmoid",
         "model.router_bias_update_rate=0.01"],
        ["mesh.data=1", "mesh.stage=2", "mesh.expert=2", "mesh.tensor=2", "pipeline.microbatches=4",
         "pipeline.repeats=2"]),
    "gpipe_expert2_fsdp2_dropless_first_dense_interleaved": (
        ["model.num_layers=5", "model.first_dense_layers=1", "model.moe_every=2", "model.capacity_factor=0"],
        ["mesh.data=1", "mesh.stage=2", "mesh.expert=2", "mesh.fsdp=2", "pipeline.microbatches=2"]),
}


@pytest.mark.parametrize("case", sorted(PIPELINED))
def test_expert_parallel_inside_pipeline_stages_equals_data8(case):
    common, layout = PIPELINED[case]
    want = run(["mesh.data=8", *common])
    got = run([*layout, *common])
    assert got[0]["moe_dropped_fraction"] == 0
    assert_runs_equal(got, want)


def test_expert_weights_are_split_over_the_expert_axis():
    trainer = Trainer(load_config(None, BASE + ["mesh.data=2", "mesh.expert=4"]), write_files=False)
    w = trainer.state["params"]["blocks"]["mlp"]["w_gate"]
    assert w.addressable_shards[0].data.shape[1] == 8 // 4  # [layers, E, D, F]: E split 4 ways


def test_checkpoint_restores_across_expert_parallel_sizes(tmp_path):
    run_dir = tmp_path / "run"
    common = [f"run.output_dir={run_dir}", "model.router_bias_update_rate=0.01", "model.moe_router=sigmoid",
              "checkpoint.async_save=false"]
    saved = None
    for i, layout in enumerate((["mesh.data=2", "mesh.expert=4"], ["mesh.data=4", "mesh.expert=2"], ["mesh.data=8"])):
        # Each restore trains 1 more step: a longer schedule, consented to (docs/checkpoint.md).
        trainer = Trainer(load_config(None, BASE + common + layout + [f"train.steps={i + 1}", "run.allow_changes=[train.steps]"]),
                          devices=jax.devices())
        if saved is not None:
            assert trainer.resumed_from == i
            assert_trees_equal(jax.device_get({"params": trainer.state["params"], "moe": trainer.state["moe"],
                                               "opt_state": trainer.state["opt_state"]}), saved, "restored ")
        trainer.fit()
        saved = jax.device_get({"params": trainer.state["params"], "moe": trainer.state["moe"],
                                "opt_state": trainer.state["opt_state"]})
        assert np.any(saved["moe"]["router_bias"] != 0)
        trainer.close()
