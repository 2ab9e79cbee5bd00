"""DeepSeek-V3 (DeepseekV3ForCausalLM) import/export against transformers itself: random small models
(3 layers: first_k_dense_replace=1 dense layer then 2 MoE layers; 8 routed experts in 4 groups, top-2
among the best 2 groups, 1 shared expert, routed_scaling_factor 2.5; MLA with q_lora_rank 24 or a
full-rank query, kv_lora_rank 16, rope 8 / nope 12 / value 10 channels; YaRN with mscale != mscale_all_dim;
every weight and the e_score_correction_bias moved off their init), jaxtrain's forward (routing bias
from the imported train state) equal to transformers' logits (fp32, <= 1e-4) on plain and packed rows,
import -> export bitwise (the bias included), transformers loads the export with equal logits; the
interleaved rope layout, the bias and the group limit each shown to matter. What jaxtrain cannot
represent is refused by name (CLI: one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from jaxtrain.checkpoint.trained_run import restore_router_bias
from jaxtrain.commands import cli
from jaxtrain.config import ConfigError, load_config
from jaxtrain.hf.deepseek_v3 import rope_order
from jaxtrain.hf.mapping import hf_config_from_model
from jaxtrain.model.llama import Transformer
from test_hf import jax_params
from test_qwen3 import assert_import_refused, hf_logits, packed

VOCAB = 80
LAYERS = 3
TOKENS = np.random.default_rng(7).integers(0, VOCAB, (2, 24))
DOCS = [[7, 10, 7], [12, 12]]  # the packed rows: each row's documents' lengths (sum 24)
RMS_EPS = 3e-6  # neither side's default: an unmapped field would show
YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0}


def make_deepseek(path: Path, *, q_lora: int | None = 24, interleave: bool = True, seed: int = 0) -> Path:
    """A random small DeepseekV3ForCausalLM saved with save_pretrained (offline)."""
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=q_lora,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=256,
        rms_norm_eps=RMS_EPS, rope_parameters=dict(YARN), rope_interleave=interleave, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # of the size of the sigmoid scores' spread
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(path)
    return path


def jax_logits(directory: Path, tokens: np.ndarray = TOKENS, overrides: tuple[str, ...] = (), docs=None,
               bias: bool = True) -> np.ndarray:
    """jaxtrain's logits of an imported run, routed with the train state's `moe.router_bias` it holds
    (zeros with `bias=False`); `docs`: packed rows (segment ids, positions restarting)."""
    cfg, params = jax_params(directory, overrides)
    model = nnx.merge(nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0], params)
    router_bias = restore_router_bias(str(directory), cfg, None) if bias else None
    pos = seg = None
    if docs is not None:
        seg, pos = (jnp.asarray(a) for a in packed(docs))
    h = model.hidden_and_stats(jnp.asarray(tokens, jnp.int32), pos, seg, router_bias=router_bias)[0]
    return np.asarray(jnp.einsum("bld,dv->blv", h, model.head_weight()))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_deepseek(tmp_path_factory.mktemp("deepseek") / "src")


@pytest.mark.parametrize("q_lora", [24, None])
def test_deepseek_v3_import_equals_transformers_plain_and_packed_and_round_trips_bitwise(q_lora, tmp_path):
    src = make_deepseek(tmp_path / "src", q_lora=q_lora)
    out, exported = tmp_path / "imported", tmp_path / "exported"
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 0
    m = load_config(out / "config.yaml", need_data=False).model
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.head_dim) == (
        16, q_lora or 0, 8, 12, 10, 20)
    assert (m.num_experts, m.experts_per_token, m.moe_n_group, m.moe_topk_group, m.moe_routed_scaling_factor,
            m.num_shared_experts, m.first_dense_layers, m.moe_router, m.moe_mlp_dim, m.mlp_dim) == (
        8, 2, 4, 2, 2.5, 1, 1, "sigmoid", 16, 48)
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_len, m.rope_yarn_mscale,
            m.rope_yarn_mscale_all_dim, m.norm_eps, m.mtp_depth) == ("yarn", 4.0, 64, 0.8, 1.0, RMS_EPS, 0)

    expected = hf_logits(src, TOKENS)
    got = jax_logits(out)
    assert np.abs(expected).max() > 1.0  # large enough that a layout error could not hide
    assert np.abs(got - expected).max() <= 1e-4, np.abs(got - expected).max()
    packed_got = jax_logits(out, docs=DOCS)
    for row, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:
            alone = hf_logits(src, TOKENS[row:row + 1, start:start + n])[0]
            assert np.abs(packed_got[row, start:start + n] - alone).max() <= 1e-4, (row, start)
            start += n
    assert np.abs(packed_got - expected).max() > 1e-2  # the packing matters
    # The routing bias and the group limit choose experts here: without either the logits move.
    assert np.abs(jax_logits(out, bias=False) - expected).max() > 1e-2
    ungrouped = jax_logits(out, overrides=("model.moe_n_group=1", "model.moe_topk_group=1"))
    assert np.abs(ungrouped - expected).max() > 1e-2

    assert cli.main(["export-hf", str(out), "--output", str(exported)]) == 0
    source, back = load_file(src / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(source) == sorted(back)
    assert any(name.endswith("e_score_correction_bias") for name in back)
    for name in source:
        assert back[name].tobytes() == source[name].tobytes(), name
    a, b = json.loads((src / "config.json").read_text()), json.loads((exported / "config.json").read_text())
    for key in ("architectures", "model_type", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                "v_head_dim", "n_group", "topk_group", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
                "routed_scaling_factor", "first_k_dense_replace", "moe_intermediate_size", "rope_parameters",
                "rope_interleave", "rms_norm_eps", "tie_word_embeddings"):
        assert a[key] == b[key], key
    np.testing.assert_array_equal(hf_logits(exported, TOKENS), expected)


def test_rope_interleave_false_is_read_as_it_is_and_exported_interleaved(source, tmp_path):
    """The same weights read with rope_interleave false are another model (transformers and jaxtrain agree
    on it); its export is interleaved (rope rows reordered) and gives transformers the same logits."""
    src = tmp_path / "plain"
    src.mkdir()
    for f in source.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, "rope_interleave": False}))
    out, exported = tmp_path / "imported", tmp_path / "exported"
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 0
    expected = hf_logits(src, TOKENS)
    assert np.abs(jax_logits(out) - expected).max() <= 1e-4
    assert np.abs(hf_logits(source, TOKENS) - expected).max() > 1e-2  # the layout matters
    assert cli.main(["export-hf", str(out), "--output", str(exported)]) == 0
    assert json.loads((exported / "config.json").read_text())["rope_interleave"] is True
    q_src = load_file(src / "model.safetensors")["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    q_out = load_file(exported / "model.safetensors")["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    np.testing.assert_array_equal(q_out[16:][rope_order(8)], q_src[16:])  # HF interleaved row order[c] = ours c
    assert np.abs(hf_logits(exported, TOKENS) - expected).max() <= 1e-4


def test_mtp_layers_are_skipped_and_said(source, tmp_path, capsys):
    """DeepSeek-V3's checkpoints hold the MTP module as layer num_hidden_layers: import skips those tensors
    (and says so), and the model is the same; any other stray tensor is still refused."""
    src = tmp_path / "with-mtp"
    src.mkdir()
    for f in source.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    rng = np.random.default_rng(0)
    mtp = {f"model.layers.{LAYERS}.eh_proj.weight": (32, 64), f"model.layers.{LAYERS}.enorm.weight": (32,),
           f"model.layers.{LAYERS}.self_attn.q_a_proj.weight": (24, 32)}
    save_file({**tensors, **{k: rng.standard_normal(s).astype(np.float32) for k, s in mtp.items()}},
              src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "imported"
    capsys.readouterr()
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 0
    assert "Skipped 3 tensor(s)" in capsys.readouterr().out
    assert np.abs(jax_logits(out) - hf_logits(source, TOKENS)).max() <= 1e-4
    save_file({**tensors, "model.extra.weight": np.zeros(3, np.float32)}, src / "model.safetensors")
    assert_import_refused(src, {}, "'model.extra.weight'", tmp_path / "stray", capsys)


@pytest.mark.parametrize("changes,field", [
    ({"topk_method": "greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"first_k_dense_replace": LAYERS}, "first_k_dense_replace"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.3}}, "rope_parameters.attention_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_what_deepseek_v3_cannot_represent_is_refused_by_name(changes, field, source, tmp_path, capsys):
    assert_import_refused(source, changes, f"'{field}'", tmp_path, capsys)


def test_export_refuses_what_deepseek_v3_cannot_represent():
    base = ["model.kv_lora_rank=16", "model.head_dim=20", "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=12",
            "model.v_head_dim=10", "model.num_experts=8", "model.moe_router=sigmoid"]
    m = load_config(None, base).model
    hf = hf_config_from_model(m, "fp32")
    assert (hf["model_type"], hf["q_lora_rank"], hf["num_nextn_predict_layers"]) == ("deepseek_v3", None, 0)
    for overrides, named in ((["model.moe_router=softmax"], "model.moe_router=softmax"),
                             (["model.num_experts=0"], "model.num_experts=0"),
                             (["model.rope_scaling=linear", "model.rope_scaling_factor=2"],
                              "model.rope_scaling=linear")):
        with pytest.raises(ConfigError, match=named):
            hf_config_from_model(load_config(None, [*base, *overrides]).model, "fp32")


def test_a_trained_run_exports_its_routing_bias_and_drops_its_mtp_module(tmp_path, capsys):
    """configs/deepseek-v3-tiny.yaml trained 3 steps (the routing bias moved, one MTP module): export-hf
    says it dropped the `mtp` parameters, writes the run's bias, and transformers gives jaxtrain's logits."""
    import subprocess
    import sys

    from helpers import REPO

    run = tmp_path / "run"
    config = REPO / "configs/deepseek-v3-tiny.yaml"
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", str(config),
                        f"run.output_dir={run}", "train.steps=3", "train.log_every=1", "data.seq_len=16",
                        "data.global_batch_size=4", "--cpu-devices", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    exported = tmp_path / "exported"
    capsys.readouterr()
    assert cli.main(["export-hf", str(run), "--output", str(exported)]) == 0
    assert "dropped the mtp parameters" in capsys.readouterr().out
    cfg = load_config(run / "config.yaml", need_data=False)
    bias = np.asarray(restore_router_bias(str(run), cfg, None))
    assert np.abs(bias).max() > 0  # moved by router_bias_update_rate
    written = load_file(exported / "model.safetensors")
    np.testing.assert_array_equal(written["model.layers.1.mlp.gate.e_score_correction_bias"], bias[0])
    assert not any("eh_proj" in name or name.startswith("model.layers.2.") for name in written)
    tokens = TOKENS[:, :16] % cfg.model.vocab_size
    assert np.abs(jax_logits(run, tokens) - hf_logits(exported, tokens)).max() <= 1e-4


def test_a_run_started_from_the_import_routes_with_its_bias(source, tmp_path):
    """checkpoint.init_from of an import restores the routing bias (e_score_correction_bias) beside the
    parameters: a fine-tune starts routing as the source model does, not with a zero bias."""
    from jaxtrain.trainer import Trainer

    out = tmp_path / "imported"
    assert cli.main(["import-hf", str(source), "--output", str(out)]) == 0
    cfg = load_config(out / "config.yaml", ["data.source=markov", f"run.output_dir={tmp_path / 'run'}",
                                             "data.seq_len=16", "data.global_batch_size=8", "mesh.data=-1"])
    trainer = Trainer(cfg, write_files=False)
    got = np.asarray(jax.device_get(trainer.state["moe"]["router_bias"]))
    want = np.stack([load_file(next(source.glob("*.safetensors")))[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
                     for i in range(1, LAYERS)])
    assert np.abs(want).max() > 0.1
    np.testing.assert_array_equal(got, want)
