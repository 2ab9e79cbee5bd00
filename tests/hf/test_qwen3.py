"""Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM) import/export against transformers
itself: random small models (GQA, head_dim given apart from hidden_size / heads, every weight moved
off its init, q_norm/k_norm included; MoE: 4 experts, top-2, norm_topk_prob true and false, dense
layers among the MoE ones), jaxtrain's forward equal to transformers' logits (fp32, <= 1e-4) on
plain and packed rows, import -> export bitwise (the tokenizer and generation config byte for byte),
transformers loads the export with equal logits. What the model cannot represent is refused by name
(CLI: one line, exit 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from jaxtrain.commands import cli
from jaxtrain.config import ConfigError, ModelConfig, load_config
from jaxtrain.hf.mapping import hf_config_from_model, layer_slots, model_section_from_hf, moe_layer_pattern
from jaxtrain.model.llama import Transformer
from test_hf import jax_params, write_tokenizer

VOCAB = 80
TOKENS = np.random.default_rng(3).integers(0, VOCAB, (2, 24))
DOCS = [[7, 10, 7], [12, 12]]  # the packed rows: each row's documents' lengths (sum 24)
RMS_EPS = 3e-6  # neither jaxtrain's nor transformers' default: an unmapped field would show
# Qwen3's own generation_config.json (two eos ids, sampling defaults): export must carry it as it is.
GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
              "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}
# What import-hf -> export-hf must carry through byte for byte beside the weights.
CARRIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# name -> (MoE keywords or None for dense, tied). The MoE patterns are ones jaxtrain represents:
# decoder_sparse_step=2 (dense, MoE, dense, MoE: model.moe_every=2) and mlp_only_layers=[0]
# (model.first_dense_layers=1), with norm_topk_prob false and true.
VARIANTS = {
    "qwen3-untied": (None, False),
    "qwen3-tied": (None, True),
    "qwen3-moe-step2-no-norm": ({"norm_topk_prob": False, "decoder_sparse_step": 2, "num_hidden_layers": 4}, False),
    "qwen3-moe-dense-first-norm": ({"norm_topk_prob": True, "mlp_only_layers": [0], "num_hidden_layers": 3}, False),
}


def make_qwen3(path: Path, moe: dict | None = None, *, tied: bool = False, seed: int = 0) -> Path:
    """A random small Qwen3 (or, with `moe`, Qwen3-MoE) saved with save_pretrained (offline)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=RMS_EPS,
                  tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if moe is None:
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **common))
    else:
        layers = moe.get("num_hidden_layers", 2)
        config = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                router_aux_loss_coef=0.02, **{**moe, "num_hidden_layers": layers})
        model = Qwen3MoeForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # q_norm / k_norm too: a misplaced one shows
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def write_tokenizer_and_generation_config(path: Path, generation: dict) -> None:
    """A tokenizer (tokenizer.json, tokenizer_config.json) and the family's generation_config.json
    beside a saved model, replacing the one save_pretrained wrote."""
    write_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def hf_logits(path: Path, tokens: np.ndarray = TOKENS) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def jax_model(directory: Path) -> Transformer:
    cfg, params = jax_params(directory)
    return nnx.merge(nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0], params)


def packed(docs_per_row: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(segment ids, positions restarting at 0 in each document) of rows packed with these lengths."""
    seg = np.array([np.repeat(np.arange(1, len(d) + 1), d) for d in docs_per_row], np.int32)
    pos = np.array([np.concatenate([np.arange(n) for n in d]) for d in docs_per_row], np.int32)
    return seg, pos


def assert_transformers_logits_and_bitwise_round_trip(src: Path, out: Path, exported: Path, tokens: np.ndarray,
                                                      docs: list[list[int]], config_keys: tuple[str, ...],
                                                      carried: tuple[str, ...] = ()) -> None:
    """The imported run `out` of the transformers model `src`: its forward pass equals transformers' logits
    (fp32, 1e-4) on plain rows and on packed rows (each document against transformers on it alone); export-hf
    to `exported` gives the same tensors bit for bit, keeps `config_keys`, writes the files named in `carried`
    (tokenizer, generation config) byte for byte as `src` has them, and transformers loads it into the same
    logits."""
    expected = hf_logits(src, tokens)
    model = jax_model(out)
    got = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    assert np.abs(expected).max() > 1.0  # logits large enough that a layout error could not hide
    assert np.abs(got - expected).max() <= 1e-4, np.abs(got - expected).max()
    # Packed rows (segment ids, positions restarting): each document's logits are transformers' on it alone.
    seg, pos = packed(docs)
    got = np.asarray(model(jnp.asarray(tokens, jnp.int32), jnp.asarray(pos), jnp.asarray(seg)))
    for row, lengths in enumerate(docs):
        start = 0
        for n in lengths:
            alone = hf_logits(src, tokens[row:row + 1, start:start + n])[0]
            assert np.abs(got[row, start:start + n] - alone).max() <= 1e-4, (row, start)
            start += n
    assert np.abs(got - expected).max() > 1e-2  # the packing matters: not the plain rows' logits
    assert cli.main(["export-hf", str(out), "--output", str(exported)]) == 0
    source, back = load_file(src / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(source) == sorted(back)
    for name in source:
        assert back[name].tobytes() == source[name].tobytes(), name
    a, b = json.loads((src / "config.json").read_text()), json.loads((exported / "config.json").read_text())
    for key in config_keys:
        assert a[key] == b[key], key
    for name in carried:
        assert (exported / name).read_bytes() == (src / name).read_bytes(), name
    np.testing.assert_array_equal(hf_logits(exported, tokens), expected)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_qwen3_import_equals_transformers_plain_and_packed_and_round_trips_bitwise(variant, tmp_path):
    moe, tied = VARIANTS[variant]
    src = make_qwen3(tmp_path / "src", moe, tied=tied)
    write_tokenizer_and_generation_config(src, GENERATION)
    out, exported = tmp_path / "imported", tmp_path / "exported"
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 0
    m = load_config(out / "config.yaml", need_data=False).model
    assert (m.qk_norm, m.tie_embeddings, m.head_dim, m.num_kv_heads, m.norm_eps) == (True, tied, 16, 2, RMS_EPS)
    if moe:
        hf_moe = [i for i in range(m.num_layers) if i not in moe.get("mlp_only_layers", [])
                  and (i + 1) % moe.get("decoder_sparse_step", 1) == 0]
        assert [i for i, (_, _, is_moe) in enumerate(layer_slots(m)) if is_moe] == hf_moe
        assert (m.num_experts, m.experts_per_token, m.moe_mlp_dim, m.mlp_dim) == (4, 2, 24, 48)
        assert m.moe_norm_topk_prob is moe["norm_topk_prob"] and m.moe_aux_loss == 0.02

    keys = ("architectures", "model_type", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
            *(("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef") if moe else ()))
    assert_transformers_logits_and_bitwise_round_trip(src, out, exported, TOKENS, DOCS, keys, CARRIED)


def test_norm_topk_prob_changes_the_logits(tmp_path):
    """The same Qwen3-MoE weights with norm_topk_prob flipped give other logits in transformers and
    in jaxtrain alike: the flag is read, not ignored."""
    src = make_qwen3(tmp_path / "src", {"norm_topk_prob": False})
    flipped = tmp_path / "flipped"
    shutil.copytree(src, flipped)
    hf = json.loads((flipped / "config.json").read_text())
    (flipped / "config.json").write_text(json.dumps({**hf, "norm_topk_prob": True}))
    results = []
    for path in (src, flipped):
        out = tmp_path / f"imported-{path.name}"
        assert cli.main(["import-hf", str(path), "--output", str(out)]) == 0
        got, want = np.asarray(jax_model(out)(jnp.asarray(TOKENS, jnp.int32))), hf_logits(path)
        assert np.abs(got - want).max() <= 1e-4
        results.append(got)
    assert np.abs(results[0] - results[1]).max() > 1e-2


def test_moe_layer_patterns_round_trip_as_transformers_places_them():
    """Every first_dense_layers / moe_every jaxtrain accepts (up to 8 layers) exports as
    decoder_sparse_step / mlp_only_layers that put the MoE layers where jaxtrain runs them
    (transformers' rule), and imports back to the same layers."""
    for layers in range(1, 9):
        for first in range(layers):
            for every in range(1, layers - first + 1):
                if (layers - first) % every:
                    continue
                m = load_config(None, [f"model.num_layers={layers}", "model.num_experts=4", "model.qk_norm=true",
                                       f"model.first_dense_layers={first}", f"model.moe_every={every}"]).model
                ours = {i for i, (_, _, moe) in enumerate(layer_slots(m)) if moe}
                hf = hf_config_from_model(m, "fp32")
                theirs = {i for i in range(layers) if i not in hf["mlp_only_layers"]
                          and (i + 1) % hf["decoder_sparse_step"] == 0}
                assert ours == theirs, (layers, first, every)
                back = model_section_from_hf(hf)
                again = ModelConfig(num_layers=layers, num_experts=4, first_dense_layers=back["first_dense_layers"],
                                    moe_every=back["moe_every"])
                assert {i for i, (_, _, moe) in enumerate(layer_slots(again)) if moe} == ours
    assert moe_layer_pattern(4, {1, 2}) is None and moe_layer_pattern(3, {1}) is None  # not jaxtrain's layouts


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("qwen3")
    return {"dense": make_qwen3(tmp / "dense"), "moe": make_qwen3(tmp / "moe", {"norm_topk_prob": True})}


@pytest.mark.parametrize("kind,changes,field", [
    ("dense", {"attention_bias": True}, "attention_bias"),
    ("dense", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ("dense", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("dense", {"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
    ("moe", {"use_sliding_window": True}, "use_sliding_window"),
    ("moe", {"decoder_sparse_step": 3}, "decoder_sparse_step"),  # 2 layers, no MoE layer at all
    ("moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),  # the last layer dense
    ("moe", {"num_experts_per_tok": 1}, "norm_topk_prob"),  # a single gate renormalised to 1
])
def test_what_qwen3_cannot_represent_is_refused_by_name(kind, changes, field, sources, tmp_path, capsys):
    assert_import_refused(sources[kind], changes, f"'{field}'", tmp_path, capsys)


def assert_import_refused(source: Path, changes: dict, named: str, tmp_path: Path, capsys) -> None:
    """import-hf of `source` with its config.json changed by `changes`: exit 2, one stderr line naming `named`,
    nothing written."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, **changes}))
    out = tmp_path / "out"
    capsys.readouterr()
    assert cli.main(["import-hf", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not out.exists()


def test_qwen3_moe_export_and_routing_keys_are_checked():
    base = ["model.num_experts=4", "model.qk_norm=true"]
    with pytest.raises(ConfigError, match="model.moe_norm_topk_prob=false is for model.moe_router=softmax"):
        load_config(None, [*base, "model.moe_router=sigmoid", "model.moe_norm_topk_prob=false"])
    for overrides, named in ((["model.moe_router=sigmoid"], "model.moe_router"),
                             (["model.num_shared_experts=1"], "model.num_shared_experts"),
                             (["model.experts_per_token=1"], "model.experts_per_token=1")):
        with pytest.raises(ConfigError, match=named):
            hf_config_from_model(load_config(None, [*base, *overrides]).model, "fp32")
    # Without qk_norm an MoE is written as Mixtral, which always renormalises the chosen k.
    with pytest.raises(ConfigError, match="MixtralForCausalLM cannot represent model.moe_norm_topk_prob=false"):
        hf_config_from_model(load_config(None, ["model.num_experts=4", "model.moe_norm_topk_prob=false"]).model, "fp32")
    top1 = load_config(None, [*base, "model.experts_per_token=1", "model.moe_norm_topk_prob=false"]).model
    assert hf_config_from_model(top1, "fp32")["norm_topk_prob"] is False  # top-1, the raw probability: fine
