"""Gemma 3 text (Gemma3ForCausalLM) import/export against transformers itself: random small models
(7 layers, local and global layers mixed, a window of 4 on rows of 16, GQA, every weight moved off
its init, the four norms per layer and q/k norms included), jaxtrain's forward equal to
transformers' logits (fp32, <= 1e-4) on plain and packed rows, import -> export bitwise (the
tokenizer and generation config byte for byte), transformers loads the export with equal logits.
What jaxtrain cannot represent is refused by name (CLI: one line, exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from jaxtrain.commands import cli
from jaxtrain.config import ConfigError, load_config
from jaxtrain.hf.mapping import hf_config_from_model
from test_qwen3 import (CARRIED, assert_import_refused, assert_transformers_logits_and_bitwise_round_trip, hf_logits,
                        jax_model, write_tokenizer_and_generation_config)

VOCAB = 80
TOKENS = np.random.default_rng(5).integers(0, VOCAB, (2, 16))
DOCS = [[7, 9], [5, 5, 6]]  # the packed rows' documents (each longer than the window somewhere)
WINDOW = 4
RMS_EPS = 3e-6
# Gemma 3's generation_config.json: two eos ids (<eos> and <end_of_turn>), the hybrid cache.
GENERATION = {"bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106], "pad_token_id": 0,
              "top_k": 64, "top_p": 0.95, "transformers_version": "4.50.0.dev0"}


def pattern_types(layers: int, every: int) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]


# name -> (Gemma3TextConfig keywords, the window pattern jaxtrain should read).
VARIANTS = {
    # Gemma 3's own pattern (layer 5 global), tied, the scale from head_dim (query_pre_attn_scalar = H).
    "tied-pattern6": (dict(tie_word_embeddings=True, query_pre_attn_scalar=16), 6),
    # Globals at 2 and 5, untied, query_pre_attn_scalar != head_dim, linear rope on the global layers.
    "untied-pattern3-linear": (dict(tie_word_embeddings=False, query_pre_attn_scalar=24,
                                    layer_types=pattern_types(7, 3),
                                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 50_000.0},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 700.0}}), 3),
}


def make_gemma3(path: Path, extra: dict, *, seed: int = 0) -> Path:
    """A random small Gemma3ForCausalLM saved with save_pretrained (offline)."""
    config = Gemma3TextConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=256, rms_norm_eps=RMS_EPS, sliding_window=WINDOW,
                                        rope_parameters={"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 20_000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 900.0}}),
                                 **extra})
    model = Gemma3ForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms store w of (1 + w): around 0
            p.copy_(0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gemma3_import_equals_transformers_plain_and_packed_and_round_trips_bitwise(variant, tmp_path):
    extra, pattern = VARIANTS[variant]
    src = make_gemma3(tmp_path / "src", extra)
    write_tokenizer_and_generation_config(src, GENERATION)
    out, exported = tmp_path / "imported", tmp_path / "exported"
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 0
    m = load_config(out / "config.yaml", need_data=False).model
    assert (m.sliding_window, m.sliding_window_pattern, m.norm_plus_one, m.post_norms, m.embed_scale, m.qk_norm,
            m.mlp_activation, m.norm_eps) == (WINDOW, pattern, True, True, True, True, "gelu_tanh", RMS_EPS)
    assert m.tie_embeddings is extra["tie_word_embeddings"]
    assert [m.layer_is_local(i) for i in range(7)] == [(i + 1) % pattern != 0 for i in range(7)]

    # Packed rows: the window and the rotary positions restart with each document.
    assert_transformers_logits_and_bitwise_round_trip(src, out, exported, TOKENS, DOCS, (
        "architectures", "model_type", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
        "layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation", "bos_token_id", "eos_token_id",
        "pad_token_id"), CARRIED)


def test_the_window_and_the_local_rope_are_read_not_ignored(tmp_path):
    """With the window as long as the rows, or the local layers' rope base changed, transformers'
    logits change and jaxtrain's follow them."""
    src = make_gemma3(tmp_path / "src", VARIANTS["tied-pattern6"][0])
    hf = json.loads((src / "config.json").read_text())
    results = []
    for name, change in (("same", {}), ("wide", {"sliding_window": 16}),
                         ("local-rope", {"rope_parameters": {**hf["rope_parameters"], "sliding_attention": {
                             "rope_type": "default", "rope_theta": 77.0}}})):
        path = tmp_path / name
        shutil.copytree(src, path)
        (path / "config.json").write_text(json.dumps({**hf, **change}))
        out = tmp_path / f"imported-{name}"
        assert cli.main(["import-hf", str(path), "--output", str(out)]) == 0
        got, want = np.asarray(jax_model(out)(jnp.asarray(TOKENS, jnp.int32))), hf_logits(path, TOKENS)
        assert np.abs(got - want).max() <= 1e-4, name
        results.append(got)
    assert np.abs(results[0] - results[1]).max() > 1e-2 and np.abs(results[0] - results[2]).max() > 1e-2


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_gemma3(tmp_path_factory.mktemp("gemma3") / "src", VARIANTS["tied-pattern6"][0])


@pytest.mark.parametrize("changes,field", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention"] * 5 + ["full_attention", "full_attention"]}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_parameters.rope_type"),
])
def test_what_gemma3_cannot_represent_is_refused_by_name(changes, field, source, tmp_path, capsys):
    assert_import_refused(source, changes, f"'{field}", tmp_path, capsys)


def test_window_keys_are_checked_against_the_mesh_and_the_family():
    gemma = ["model.sliding_window=4", "model.sliding_window_pattern=3", "model.num_layers=6"]
    with pytest.raises(ConfigError, match="model.sliding_window=4 with mesh.context=2"):
        load_config(None, [*gemma, "mesh.context=2", "mesh.data=-1", "data.seq_len=64"])
    with pytest.raises(ConfigError, match="model.sliding_window_pattern=3 with mesh.stage=2"):
        load_config(None, [*gemma, "mesh.stage=2", "mesh.data=-1", "pipeline.microbatches=2"])
    load_config(None, [*gemma, "model.num_experts=4"])  # local and global MoE layers: gpt-oss (no refusal)
    # The CLI (one line, exit 2): tests/test_config.py::test_bad_config_exits_2_with_one_line_and_writes_nothing.
    with pytest.raises(ConfigError, match="LlamaForCausalLM cannot represent model.sliding_window"):
        hf_config_from_model(load_config(None, ["model.sliding_window=4"]).model, "fp32")
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM .* cannot represent model.norm_plus_one=false"):
        hf_config_from_model(load_config(None, ["model.post_norms=true", "model.qk_norm=true", "model.embed_scale=true",
                                                "model.mlp_activation=gelu_tanh"]).model, "fp32")


def test_gemma3_1b_preset_has_gemma3_1bs_parameter_count():
    """configs/gemma3-1b.yaml builds Gemma 3 1B's 999,885,952 parameters (transformers' count of
    Gemma3ForCausalLM at that shape, tied, the four norms per layer and q/k norms included)."""
    import jax
    from flax import nnx

    from jaxtrain.model.llama import Transformer
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs/gemma3-1b.yaml")
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))) == 999_885_952
    assert [i for i in range(26) if not cfg.model.layer_is_local(i)] == [5, 11, 17, 23]
