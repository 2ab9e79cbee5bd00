"""gpt-oss (GptOssForCausalLM) import/export against transformers itself: random small models (4
layers alternating sliding-window and full attention, a window of 4 on rows of 16, GQA, 4 experts
top-2, YaRN rope without truncation, a clamped SwiGLU with non-default limit and alpha, every
weight moved off its init: sinks, attention / router / expert biases included), jaxtrain's forward
equal to transformers' logits (fp32, <= 1e-4) on plain and packed rows, import -> export bitwise,
transformers loads the export with equal logits; the streaming import's per-expert pieces
de-interleave gate_up_proj as the whole tensor does. What jaxtrain cannot represent is refused by
name (CLI: one line, exit 2), MXFP4 checkpoints with the way to dequantize them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import GptOssConfig, GptOssForCausalLM

from jaxtrain.commands import cli
from jaxtrain.config import ConfigError, load_config
from jaxtrain.hf.importer import model_only_config
from jaxtrain.hf.mapping import hf_config_from_model, model_section_from_hf, param_plan, params_from_hf
from test_qwen3 import assert_import_refused, assert_transformers_logits_and_bitwise_round_trip, hf_logits, jax_model

VOCAB = 80
TOKENS = np.random.default_rng(7).integers(0, VOCAB, (2, 16))
DOCS = [[7, 9], [5, 5, 6]]  # the packed rows' documents (each longer than the window somewhere)
WINDOW = 4
RMS_EPS = 3e-6  # neither side's default: an unmapped field would show
YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 32}

# name -> GptOssConfig keywords beyond the common ones.
VARIANTS = {
    "untied-biased-yarn": dict(tie_word_embeddings=False, attention_bias=True, rope_parameters=YARN),
    "tied-unbiased-default-rope": dict(tie_word_embeddings=True, attention_bias=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 900.0}),
}


def make_gpt_oss(path: Path, extra: dict, *, seed: int = 0) -> Path:
    """A random small GptOssForCausalLM saved with save_pretrained (offline)."""
    config = GptOssConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=RMS_EPS,
                                    sliding_window=WINDOW, swiglu_limit=1.5, swiglu_alpha=1.3,
                                    router_aux_loss_coef=0.02), **extra})
    model = GptOssForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # sinks and every bias too: a misplaced one shows
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpt_oss_import_equals_transformers_plain_and_packed_and_round_trips_bitwise(variant, tmp_path):
    extra = VARIANTS[variant]
    src = make_gpt_oss(tmp_path / "src", extra)
    out, exported = tmp_path / "imported", tmp_path / "exported"
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 0
    m = load_config(out / "config.yaml", need_data=False).model
    assert (m.sliding_window, m.sliding_window_pattern, m.attention_sinks, m.attention_bias, m.mlp_bias,
            m.mlp_activation, m.swiglu_limit, m.swiglu_alpha, m.norm_eps) == (
        WINDOW, 2, True, extra["attention_bias"], True, "clamped_swiglu", 1.5, 1.3, RMS_EPS)
    assert (m.num_experts, m.experts_per_token, m.moe_mlp_dim, m.moe_router, m.moe_norm_topk_prob,
            m.moe_aux_loss) == (4, 2, 24, "softmax", True, 0.02)
    # transformers' layer_types (sliding on even layers) are jaxtrain's local layers.
    hf = json.loads((src / "config.json").read_text())
    assert [m.layer_is_local(i) for i in range(4)] == [k == "sliding_attention" for k in hf["layer_types"]]
    if extra["rope_parameters"]["rope_type"] == "yarn":
        assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_len, m.rope_yarn_beta_fast,
                m.rope_yarn_truncate) == ("yarn", 4.0, 32, 8.0, False)
    assert_transformers_logits_and_bitwise_round_trip(src, out, exported, TOKENS, DOCS, (
        "architectures", "model_type", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
        "layer_types", "sliding_window", "attention_bias", "num_local_experts", "num_experts_per_tok",
        "swiglu_limit", "swiglu_alpha", "router_aux_loss_coef"))


def test_the_clamp_the_truncation_and_the_window_are_read_not_ignored(tmp_path):
    """swiglu_limit, YaRN's truncate and the window changed in config.json: transformers' logits
    change and jaxtrain's follow them."""
    src = make_gpt_oss(tmp_path / "src", VARIANTS["untied-biased-yarn"])
    hf = json.loads((src / "config.json").read_text())
    results = []
    for name, change in (("same", {}), ("limit", {"swiglu_limit": 0.5}), ("wide", {"sliding_window": 16}),
                         ("truncate", {"rope_parameters": {**hf["rope_parameters"], "truncate": True}})):
        path = tmp_path / name
        shutil.copytree(src, path)
        (path / "config.json").write_text(json.dumps({**hf, **change}))
        out = tmp_path / f"imported-{name}"
        assert cli.main(["import-hf", str(path), "--output", str(out)]) == 0
        got, want = np.asarray(jax_model(out)(jnp.asarray(TOKENS, jnp.int32))), hf_logits(path, TOKENS)
        assert np.abs(got - want).max() <= 1e-4, name
        results.append(got)
    assert all(np.abs(results[0] - r).max() > 1e-3 for r in results[1:])


def test_streamed_pieces_are_one_expert_each_and_equal_the_whole_tensor_conversion(tmp_path):
    """param_plan with tiny pieces (the streaming import's) splits gate_up_proj / down_proj into one
    expert per piece and assembles the same parameters as whole tensors do."""
    src = make_gpt_oss(tmp_path / "src", VARIANTS["untied-biased-yarn"])
    tensors = load_file(src / "model.safetensors")
    m = model_only_config(model_section_from_hf(json.loads((src / "config.json").read_text()))).model
    whole = params_from_hf(tensors.__getitem__, m)
    for leaf in param_plan(m, piece_bytes=1):
        a = np.full(leaf.shape, np.nan, np.float32)
        for p in leaf.pieces:
            a[p.index] = p.convert(tensors[p.name][p.rows[0]:p.rows[1]]).reshape(a[p.index].shape)
        node = whole
        for key in leaf.path:
            node = node[key]
        np.testing.assert_array_equal(a, node, err_msg=str(leaf.path))
        if leaf.path[-1] in ("w_gate", "w_up", "w_down"):
            assert len(leaf.pieces) == m.num_layers * m.num_experts and leaf.block[:2] == (1, 1)


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "src", VARIANTS["untied-biased-yarn"])


@pytest.mark.parametrize("changes,field", [
    ({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}}, "quantization_config"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"rope_parameters": {**YARN, "rope_type": "llama3"}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.5}}, "rope_parameters.attention_factor"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"architectures": ["GptOssForSequenceClassification"]}, "architectures"),
])
def test_what_gpt_oss_cannot_represent_is_refused_by_name(changes, field, source, tmp_path, capsys):
    assert_import_refused(source, changes, f"'{field}", tmp_path, capsys)


def test_mxfp4_refusal_says_how_to_dequantize():
    with pytest.raises(ConfigError, match=r"mxfp4.*Mxfp4Config\(dequantize=True\)"):
        model_section_from_hf({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}})


def test_what_gpt_oss_cannot_export_is_refused_by_name():
    base = ["model.attention_sinks=true", "model.mlp_bias=true", "model.mlp_activation=clamped_swiglu",
            "model.num_experts=4"]
    hf_config_from_model(load_config(None, base).model, "fp32")  # the base is fine
    for overrides, named in ((["model.num_experts=0"], "model.num_experts=0"),
                             (["model.mlp_bias=false"], "model.mlp_bias=false"),
                             (["model.mlp_activation=silu"], "model.mlp_activation"),
                             (["model.num_shared_experts=1"], "model.num_shared_experts"),
                             (["model.rope_scaling=llama3"], "model.rope_scaling"),
                             (["model.sliding_window=4", "model.rope_local_theta=77"], "model.rope_local_theta")):
        with pytest.raises(ConfigError, match=f"GptOssForCausalLM .* cannot represent {named}"):
            hf_config_from_model(load_config(None, [*base, *overrides]).model, "fp32")
