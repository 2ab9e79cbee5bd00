"""A whole train step with context parallelism equals one without: `mesh.context` x data (x fsdp /
tensor) against `mesh.data=8`, on packed rows whose documents cross the context shards: loss,
grad_norm, every gradient leaf (fp32, rel <= 1e-5) and the parameters after 3 steps; the `start`
event names the context schedule.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from helpers import TINY, Packed, pack_at
from trees import assert_trees_close, assert_trees_differ

from jaxtrain.config import load_config
from jaxtrain.parallel.sharding import global_batch
from jaxtrain.train.step import BATCH_KEYS
from jaxtrain.trainer import Trainer
from jaxtrain.runtime.xla_cpu import cpu_xla_flags


L = 64
SMALL = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", f"data.seq_len={L}",
         "data.global_batch_size=8", "optim.warmup_steps=0", "checkpoint.compilation_cache_dir=null"]
BOUNDS = (5, 21, 45)  # off every chunk grid (chunks of 4 at zig-zag context 8); documents span shards



def run(*overrides: str, steps: int = 3):
    trainer = Trainer(load_config(None, SMALL + list(overrides)), write_files=False, devices=jax.devices()[:8])
    first = pack_at(next(type(trainer.data)(trainer.cfg, 0, 1)), BOUNDS)
    first = global_batch({k: first[k] for k in BATCH_KEYS}, trainer.mesh, trainer.rules)
    state = jax.tree_util.tree_map(lambda x: x.copy(), trainer.state)
    _, metrics, grads = trainer.layout.jit_train_step(return_grads=True)(state, first, trainer.layout.chaos_factor())
    trainer.data = Packed(trainer.data, BOUNDS)
    initial = jax.device_get(trainer.state["params"])
    losses = [trainer.step()["loss"] for _ in range(steps)]
    assert losses[0] == float(metrics["loss"])
    final = jax.device_get(trainer.state["params"])
    assert_trees_differ(final, initial, 1e-4)
    return jax.device_get(metrics), jax.device_get(grads), final, trainer


def assert_same_step(got, want) -> None:
    (m_got, g_got, p_got, _), (m_want, g_want, p_want, _) = got, want
    for key in ("loss", "grad_norm"):
        assert abs(m_got[key] - m_want[key]) <= 1e-5 * abs(m_want[key]), (key, m_got[key], m_want[key])
    assert_trees_close(g_got, g_want, 1e-5, "gradient ")
    assert_trees_close(p_got, p_want, 1e-4, "parameter after 3 steps ")


@pytest.fixture(scope="module")
def data8():
    return run("mesh.data=8", "model.attention=xla")


CASES = {
    "ring-zigzag-context4-data2": ("mesh.context=4", "mesh.data=2"),
    "ring-zigzag-context8": ("mesh.context=8", "mesh.data=1"),  # chunks of 4 tokens, documents across 5 shards
    "ring-plain-context2-fsdp2-tensor2": ("mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=1",
                                          "context.order=plain"),
    "allgather-plain-context4-data2": ("mesh.context=4", "mesh.data=2", "context.attention=allgather",
                                       "context.order=plain"),
    "pallas-ring-zigzag-context2-tensor2-data2": ("mesh.context=2", "mesh.tensor=2", "mesh.data=2",
                                                  "model.attention=pallas"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_train_step_equals_data_parallel(name, data8):
    got = run("model.attention=xla", *CASES[name])
    assert_same_step(got, data8)


# Qwen3's QK-norm and Gemma 3's layer without its window (windows with mesh.context > 1 are refused:
# test_config.py): (1 + w) norms before and after attention and the MLP, GeGLU, scaled embeddings,
# scores scaled by 1/sqrt(12), not 1/sqrt(head_dim=16).
QK_NORM_GEMMA_LAYERS = ("model.qk_norm=true", "model.post_norms=true", "model.norm_plus_one=true",
                        "model.embed_scale=true", "model.mlp_activation=gelu_tanh", "model.query_pre_attn_scalar=12")


def test_context_parallel_train_step_equals_data_parallel_with_qk_norm_and_gemma_layers():
    """context 2 x data 4 (zig-zag ring) against data 8, the same model: the per-head norms see each
    context shard's own queries and keys, the scale and the extra norms change nothing across shards."""
    got = run("model.attention=xla", "mesh.context=2", "mesh.data=4", *QK_NORM_GEMMA_LAYERS)
    want = run("model.attention=xla", "mesh.data=8", *QK_NORM_GEMMA_LAYERS)
    assert_same_step(got, want)


SEQUENCE_PARALLEL = "mesh.rules={act_length: [context, tensor]}"
SP_CASES = {
    "tensor2": ("mesh.tensor=2", "mesh.data=4"),
    "tensor4": ("mesh.tensor=4", "mesh.data=2"),
    "context2-tensor2": ("mesh.context=2", "mesh.tensor=2", "mesh.data=2"),
}


@pytest.mark.parametrize("name", list(SP_CASES))
def test_sequence_parallel_activations_equal_data_parallel(name, data8):
    """Megatron's sequence parallelism (the residual stream's length over tensor) changes no number."""
    got = run("model.attention=xla", SEQUENCE_PARALLEL, *SP_CASES[name])
    assert_same_step(got, data8)
    from jaxtrain.parallel.sharding import logical_to_spec
    assert "tensor" in str(logical_to_spec(("batch", "act_length", "act_embed"), got[3].rules)[1])


def test_a_context_parallel_checkpoint_restores_onto_a_layout_without_it(tmp_path):
    """context 4 x data 2 (zig-zag ring) saves; data 8 restores it bitwise and trains on; and back."""
    base = load_config(None, SMALL + ["model.attention=xla", f"run.output_dir={tmp_path}", "checkpoint.every_steps=0",
                                      "checkpoint.save_at_end=true"])
    layouts = [["mesh.context=4", "mesh.data=2"], ["mesh.data=8"], ["mesh.context=8", "mesh.data=1",
                                                                     "context.attention=allgather"]]
    previous = None
    for i, mesh in enumerate(layouts):
        # Each restore trains 2 more steps: a longer schedule, consented to (docs/checkpoint.md).
        trainer = Trainer(base.with_overrides(*mesh, f"train.steps={2 * (i + 1)}", "run.allow_changes=[train.steps]"),
                          devices=jax.devices()[:8])
        restored = jax.device_get(trainer.state)
        if previous is not None:
            assert trainer.resumed_from == 2 * i
            jax.tree_util.tree_map(np.testing.assert_array_equal, restored, previous)
        trainer.fit()
        previous = jax.device_get(trainer.state)
        trainer.close()
    assert int(previous["step"]) == 6


def test_sequence_parallelism_turns_the_activation_all_reduces_into_gathers_and_scatters():
    """What Megatron's sequence parallelism is for: with the residual stream's length over tensor,
    each layer's tensor-parallel all-reduce of activations becomes an all-gather before the block
    and a reduce-scatter after it, as compiled and counted by `jaxtrain inspect`. (That the step's
    numbers do not change is test_sequence_parallel_activations_equal_data_parallel.)"""
    from jaxtrain.observe.inspection import inspect_report
    base = SMALL + ["model.attention=xla", "mesh.tensor=2", "mesh.data=4", "data.seq_len=256"]
    plain = inspect_report(load_config(None, base), jax.devices()[:8])["collectives"]
    sp = inspect_report(load_config(None, base + [SEQUENCE_PARALLEL]), jax.devices()[:8])["collectives"]
    assert plain["all-gather"] == plain["reduce-scatter"] == 0, plain  # tensor parallelism alone: all-reduces
    assert sp["all-reduce"] <= 0.2 * plain["all-reduce"], (sp, plain)  # left: the gradients' data reductions
    assert sp["all-gather"] > 0.3 * plain["all-reduce"] and sp["reduce-scatter"] > 0.3 * plain["all-reduce"], (sp, plain)


def test_jaxtrain_train_runs_context_parallel_with_its_own_cpu_flags(tmp_path, jaxtrain_train):
    """The user's command, through `jaxtrain train` and the XLA flags it sets on the CPU (the tests
    above run in-process without them). With YNNPACK's elementwise fusions on, context 4 x data 2
    failed at its first step ("Instruction with unsupported layout in YNN fusion"): the loss
    all-gathered its dx over `context`, and the gather's length-major layout reached a YNN fusion
    (jaxlib 0.10 after a model-level fix; jaxlib 0.12 again, so the CLI now keeps YNNPACK for dots and
    reductions whenever length is split)."""
    from jaxtrain.runtime.xla_cpu import YNN_FUSIONS, YNN_FUSIONS_NO_ELTWISE
    out = tmp_path / "run"
    r = jaxtrain_train("--config", TINY, "--cpu-devices", "8", "data.seq_len=512",
                       "model.max_seq_len=512", "mesh.context=4", "mesh.data=2", "train.steps=3", "train.log_every=1",
                       "checkpoint.save_at_end=false", f"run.output_dir={out}", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    start = json.loads((out / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["context"]["size"] == 4
    if cpu_xla_flags():  # a checked jaxlib: the flags without the elementwise fusions, recorded
        assert YNN_FUSIONS_NO_ELTWISE in start["xla_flags"] and YNN_FUSIONS not in start["xla_flags"]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses


def test_jaxtrain_train_runs_sequence_parallel_with_its_own_cpu_flags(tmp_path, jaxtrain_train):
    """Sequence parallelism (the residual stream's length over [context, tensor]) through `jaxtrain
    train` and its CPU flags: with YNNPACK's elementwise fusions on it failed at its first step ("Instruction
    with unsupported layout in YNN fusion", RMSNorm's backward and rotary's angles): its all-gathers along
    length are laid out length-major and pass that layout to the fusions that feed them. The CLI keeps
    YNNPACK for dots and reductions for such configs (jaxtrain/runtime/xla_cpu.py)."""
    from jaxtrain.runtime.xla_cpu import YNN_FUSIONS, YNN_FUSIONS_NO_ELTWISE
    out = tmp_path / "run"
    r = jaxtrain_train("--config", TINY, "--cpu-devices", "8", "data.seq_len=512",
                       "model.max_seq_len=512", "mesh.context=2", "mesh.tensor=2", "mesh.data=2", SEQUENCE_PARALLEL,
                       "train.steps=3", "train.log_every=1", "checkpoint.save_at_end=false", f"run.output_dir={out}",
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    start = json.loads((out / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["context"]["size"] == 2
    if cpu_xla_flags():  # a checked jaxlib: the flags without the elementwise fusions, recorded
        assert YNN_FUSIONS_NO_ELTWISE in start["xla_flags"] and YNN_FUSIONS not in start["xla_flags"]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
