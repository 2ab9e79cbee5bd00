"""Mixtral (MixtralForCausalLM) import/export against transformers itself: a random small model
(GQA, 4 experts, top-2), logits equal (fp32, <= 1e-4), round trip bitwise; what MixtralForCausalLM
cannot represent is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import MixtralConfig, MixtralForCausalLM

from jaxtrain.commands import cli
from jaxtrain.config import ConfigError, load_config
from jaxtrain.hf.mapping import hf_config_from_model, model_section_from_hf
from test_hf import jax_logits

TOKENS = np.array([[1, 5, 9, 33, 2, 17, 60, 4, 8, 3, 44, 12], [7, 7, 0, 63, 25, 31, 2, 9, 18, 40, 1, 6]])


def make_mixtral(path: Path, seed: int = 0) -> Path:
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, sliding_window=None)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def hf_logits(path: Path) -> np.ndarray:
    model = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def test_mixtral_import_gives_transformers_logits_and_round_trips_bitwise(tmp_path):
    src = make_mixtral(tmp_path / "src")
    out, exported = tmp_path / "imported", tmp_path / "exported"
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 0
    cfg = load_config(out / "config.yaml", need_data=False)
    assert (cfg.model.num_experts, cfg.model.experts_per_token, cfg.model.moe_mlp_dim) == (4, 2, 24)
    expected = hf_logits(src)
    got = jax_logits(out, tokens=TOKENS)
    assert np.abs(expected).max() > 1.0
    assert np.abs(got - expected).max() <= 1e-4, np.abs(got - expected).max()
    assert cli.main(["export-hf", str(out), "--output", str(exported)]) == 0
    source, back = load_file(src / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(source) == sorted(back)
    for name in source:
        assert back[name].tobytes() == source[name].tobytes(), name
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    np.testing.assert_array_equal(hf_logits(exported), expected)


def test_what_mixtral_cannot_represent_is_refused_by_name():
    base = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 4,
            "num_experts_per_tok": 2}
    assert model_section_from_hf(base)["num_experts"] == 4
    for change, field in (({"sliding_window": 4096}, "sliding_window"), ({"router_jitter_noise": 0.1}, "router_jitter"),
                          ({"num_experts_per_tok": 1}, "num_experts_per_tok")):
        with pytest.raises(ConfigError, match=field):
            model_section_from_hf({**base, **change})
    for override, named in (("model.moe_router=sigmoid", "moe_router"), ("model.num_shared_experts=1", "num_shared"),
                            ("model.first_dense_layers=1", "first_dense_layers")):
        m = load_config("configs/moe-tiny.yaml", [override]).model
        with pytest.raises(ConfigError, match=named):
            hf_config_from_model(m, "fp32")
