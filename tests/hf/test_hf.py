"""Hugging Face Llama import/export, checked against transformers itself (CPU torch).

Each tiny LlamaForCausalLM is random (norm scales too, so a misplaced tensor shows), saved with
`save_pretrained`, converted through the real CLI entry (`jaxtrain.commands.cli.main`), and compared by
logits on the same tokens. transformers is a test-only dependency (the `dev` extra). The file runs
under transformers 5.x (what the `dev` extra installs) and 4.x (checked by hand with 4.57: the
tiny models are then saved in 4.x's config layout, and 4.x loads what export-hf writes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
import yaml
from flax import nnx
from safetensors.numpy import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from jaxtrain.commands import cli
from jaxtrain.checkpoint.checkpointer import restore_params_only
from jaxtrain.config import load_config
from jaxtrain.hf import hf_tensors_from_params
from jaxtrain.model.llama import Transformer, rotary

VOCAB = 96
# Llama 3 rope scaling with a short original length, so the tiny head's 4 frequency pairs fall
# in all three bands: kept (wavelength < 16), interpolated (16..64) and stretched (> 64).
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 160))  # past original_max_position_embeddings
# Neither jaxtrain's default norm_eps (1e-5) nor transformers' (1e-6, the importer's fallback when
# the field is absent): a field that was not mapped would not go unnoticed.
RMS_EPS = 3e-6
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def rope_config(rope: dict) -> dict:
    """LlamaConfig keywords for `rope`: 5.x takes `rope_parameters`, 4.x `rope_theta` and
    `rope_scaling` (a keyword it does not know would be kept as an attribute and ignored)."""
    if TRANSFORMERS_5:
        return {"rope_parameters": rope}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": rope["rope_theta"], "rope_scaling": None if rope["rope_type"] == "default" else scaling}
TRAIN = ["model.attention=xla", "data.source=markov", "data.seq_len=32", "data.global_batch_size=8",
         "train.steps=3", "train.log_every=1", "optim.warmup_steps=0", "optim.learning_rate=0.01",
         "checkpoint.compilation_cache_dir=null"]


def make_hf(path: Path, *, tied: bool = False, rope: dict | None = None, dtype: torch.dtype = torch.float32,
            max_shard_size: str | None = None, seed: int = 0, head_dim: int | None = None) -> Path:
    """A random tiny GQA LlamaForCausalLM saved with save_pretrained (offline). `head_dim`:
    transformers' default is hidden_size // num_attention_heads (8)."""
    extra = {"head_dim": head_dim} if head_dim else {}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=RMS_EPS, tie_word_embeddings=tied,
                         **rope_config(rope or {"rope_type": "default", "rope_theta": 5000.0}), **extra)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(path: Path, tokens: np.ndarray = TOKENS) -> np.ndarray:
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def jax_params(directory: Path, overrides: tuple[str, ...] = (), step: int | None = None) -> tuple:
    """(config, params on one device) of a jaxtrain run or import directory's checkpoint `step`
    (default: the latest good one)."""
    # need_data=False: an import's config names no data (training refuses it; reading the model is fine)
    cfg = load_config(directory / "config.yaml", ["model.attention=xla", *overrides], need_data=False)
    abstract = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[1])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
    where = directory if step is None else directory / "checkpoints" / str(step)
    return cfg, restore_params_only(str(where), abstract)


def jax_logits(directory: Path, overrides: tuple[str, ...] = (), tokens: np.ndarray = TOKENS,
               step: int | None = None) -> np.ndarray:
    cfg, params = jax_params(directory, overrides, step)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0]
    return np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens, jnp.int32)))


def run_cli(*args: str) -> int:
    return cli.main([str(a) for a in args])


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<unk>"}))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """One untied fp32 source with tokenizer files, shared by the tests that do not modify it."""
    src = make_hf(tmp_path_factory.mktemp("hf") / "plain")
    write_tokenizer(src)
    return src


# ----------------------------------------------------------------------------- import == transformers


@pytest.mark.parametrize("variant", ["gqa-untied", "tied", "llama3-rope", "sharded-files", "head-dim-16"])
def test_import_gives_transformers_logits(variant, tmp_path, capsys):
    # head-dim-16: heads * head_dim = 64 != hidden_size = 32: q/k/v project up to 64, o_proj back
    # down to 32, and attention scales by 1/sqrt(16), not 1/sqrt(hidden_size / heads).
    head_dim = 16 if variant == "head-dim-16" else None
    src = make_hf(tmp_path / "src", tied=variant == "tied", rope=LLAMA3 if variant == "llama3-rope" else None,
                  max_shard_size="20KB" if variant == "sharded-files" else None, head_dim=head_dim)
    if variant == "sharded-files":
        assert (src / "model.safetensors.index.json").is_file() and len(list(src.glob("*.safetensors"))) > 2
    out = tmp_path / "imported"
    assert run_cli("import-hf", src, "--output", out) == 0
    expected = hf_logits(src)
    got = jax_logits(out)
    assert np.abs(got - expected).max() <= 1e-4, np.abs(got - expected).max()
    assert np.abs(expected).max() > 1.0  # logits large enough that a layout error could not hide

    cfg = load_config(out / "config.yaml", need_data=False)
    assert (cfg.model.tie_embeddings, cfg.model.num_kv_heads, cfg.model.head_dim) == (variant == "tied", 2,
                                                                                       head_dim or 8)
    assert cfg.model.norm_eps == RMS_EPS and cfg.model.rope_theta == (10000.0 if variant == "llama3-rope" else 5000.0)
    assert cfg.checkpoint.init_from == str(out)
    if head_dim:  # and back: transformers loads the export with the same head_dim and logits
        exported = tmp_path / "exported"
        assert run_cli("export-hf", out, "--output", exported) == 0
        assert json.loads((exported / "config.json").read_text())["head_dim"] == head_dim
        np.testing.assert_array_equal(hf_logits(exported), expected)
    if variant == "llama3-rope":
        assert cfg.model.rope_scaling == "llama3" and cfg.model.rope_original_max_len == 64
        # The scaling matters here: without it the logits are clearly different.
        assert np.abs(jax_logits(out, ("model.rope_scaling=none",)) - expected).max() > 1e-2
    # A committed checkpoint like any other: `jaxtrain checkpoints` lists step 0 as good.
    capsys.readouterr()
    assert run_cli("checkpoints", out / "checkpoints", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["valid"]) for r in rows] == [(0, True)]


def test_llama3_rotary_equals_transformers():
    """rotary() with Llama 3 scaling against transformers' rope at Llama 3.2's real settings."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=131072,
                         **rope_config(rope))
    positions = np.array([[0, 1, 7, 100, 2047, 9000, 70000, 131071]])
    x = np.random.default_rng(1).standard_normal((1, 8, 2, 128)).astype(np.float32)
    emb = LlamaRotaryEmbedding(config)
    cos, sin = emb(torch.tensor(x), torch.tensor(positions))
    # transformers' layout is [B, heads, L, H]; jaxtrain's [B, L, heads, H].
    expected = apply_rotary_pos_emb(torch.tensor(x).transpose(1, 2), torch.tensor(x).transpose(1, 2), cos, sin)[0]
    expected = expected.transpose(1, 2).numpy()
    got = np.asarray(rotary(jnp.asarray(x), jnp.asarray(positions), 500000.0, (32.0, 1.0, 4.0, 8192)))
    # Angles reach 1e5 rad: fp32 rounding of position * inv_freq differs by a few ulps between
    # the two implementations, hence 2e-3 rather than 1e-6; without scaling the error is O(1).
    assert np.abs(got - expected).max() < 2e-3
    plain = np.asarray(rotary(jnp.asarray(x), jnp.asarray(positions), 500000.0))
    assert np.abs(plain - expected).max() > 0.5


# ----------------------------------------------------------------------------- train, then export


@pytest.mark.parametrize("mesh,tied", [(("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), False),
                                       (("mesh.data=8",), True)])
def test_train_from_import_then_export_loads_in_transformers(mesh, tied, tmp_path):
    src = make_hf(tmp_path / "src", tied=tied, rope=LLAMA3)
    imported, run, exported = tmp_path / "imported", tmp_path / "run", tmp_path / "exported"
    assert run_cli("import-hf", src, "--output", imported) == 0
    assert run_cli("train", "--config", imported / "config.yaml", f"checkpoint.init_from={imported}",
                   f"run.output_dir={run}", *TRAIN, *mesh) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "init_from" for e in events)
    first_loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    # Starting from the imported weights: the first loss is the HF model's, not a fresh init's.
    assert abs(first_loss - np.log(VOCAB)) > 0.1

    assert run_cli("export-hf", run, "--output", exported) == 0
    _, trained = jax_params(run)
    _, initial = jax_params(imported)
    changed = jax.tree_util.tree_map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), trained, initial)
    assert min(jax.tree_util.tree_leaves(changed)) > 1e-4  # every parameter was trained
    expected = jax_logits(run)
    got = hf_logits(exported)
    assert np.abs(got - expected).max() <= 1e-4
    assert np.abs(got - hf_logits(src)).max() > 1e-2  # and it is not the source model
    config = json.loads((exported / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and ("lm_head.weight" in load_file(exported / "model.safetensors")) != tied


def test_export_step_n_of_a_run_started_from_an_import_keeps_tokenizer_and_token_ids(plain, tmp_path, capsys):
    """`--step N` exports checkpoint N, not the latest. The run was started from an import (its
    config.yaml, so data.tokenizer points into the import dir; checkpoint.init_from at it): the
    tokenizer files come through, and the source's token ids and dtype via the import's
    hf_config.json, found through init_from."""
    imported, run = tmp_path / "imported", tmp_path / "run"
    assert run_cli("import-hf", plain, "--output", imported) == 0
    assert run_cli("train", "--config", imported / "config.yaml", f"run.output_dir={run}", *TRAIN,
                   "checkpoint.every_steps=2", "mesh.data=8") == 0  # checkpoints 2 and 3 (the end)
    assert all((run / "checkpoints" / str(step) / "commit.json").is_file() for step in (2, 3))
    capsys.readouterr()
    step2, latest = tmp_path / "step2", tmp_path / "latest"
    assert run_cli("export-hf", run, "--output", step2, "--step", "2") == 0
    assert "export-hf: step 2 as fp32" in capsys.readouterr().out
    assert run_cli("export-hf", run, "--output", latest) == 0
    assert "export-hf: step 3 as fp32" in capsys.readouterr().out

    cfg, params2 = jax_params(run, step=2)
    expected = dict(hf_tensors_from_params(jax.device_get(params2), cfg.model))
    got, newest = load_file(step2 / "model.safetensors"), load_file(latest / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].tobytes() == t.tobytes(), name
    assert any(not np.array_equal(got[n], newest[n]) for n in got)  # step 2 is not step 3
    np.testing.assert_allclose(hf_logits(step2), jax_logits(run, step=2), atol=1e-4, rtol=0)

    for out in (step2, latest):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            assert (out / name).read_bytes() == (plain / name).read_bytes(), (out.name, name)
        source, written = json.loads((plain / "config.json").read_text()), json.loads((out / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "dtype"):
            assert written[key] == source[key], key


def test_training_an_import_without_naming_data_is_refused(plain, tmp_path, capsys):
    """An import's config.yaml leaves data.source unchosen (null): `train` with it alone exits 2
    with one line naming what to set, and writes nothing. Naming the data trains as usual:
    `data.source=markov` is exercised by the two tests above (TRAIN names it explicitly)."""
    imported, run = tmp_path / "imported", tmp_path / "run"
    assert run_cli("import-hf", plain, "--output", imported) == 0
    capsys.readouterr()
    assert run_cli("train", "--config", imported / "config.yaml", f"run.output_dir={run}", "train.steps=1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for named in ("data.source=text data.path=", "data.source=tokens data.path=", "data.source=markov"):
        assert named in err, err
    assert not run.exists()
    text = (imported / "config.yaml").read_text()
    assert "  source: null  # choose:" in text and yaml.safe_load(text)["data"]["source"] is None
    # Nothing but the data is missing: naming it is enough for the config to load.
    assert load_config(imported / "config.yaml", ["data.source=markov"]).data.source == "markov"


# ----------------------------------------------------------------------------- round trips


def test_round_trip_fp32_is_bitwise_and_keeps_config_and_tokenizer(plain, tmp_path):
    imported, exported, sharded = tmp_path / "imported", tmp_path / "new" / "exported", tmp_path / "sharded"
    assert run_cli("import-hf", plain, "--output", imported) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (imported / name).read_bytes() == (plain / name).read_bytes()
    assert load_config(imported / "config.yaml", need_data=False).data.tokenizer == str(imported / "tokenizer.json")
    assert run_cli("export-hf", imported, "--output", exported) == 0
    source, back = load_file(plain / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(source) == sorted(back)
    for name in source:
        assert back[name].dtype == np.float32 and back[name].tobytes() == source[name].tobytes(), name
    a, b = json.loads((plain / "config.json").read_text()), json.loads((exported / "config.json").read_text())
    own_layout = ("rope_parameters",) if TRANSFORMERS_5 else ("rope_theta", "rope_scaling")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "hidden_act", "bos_token_id", "eos_token_id", "dtype", "model_type", *own_layout):
        assert a[key] == b[key], key
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (exported / name).read_bytes() == (plain / name).read_bytes()

    # Sharded output: an index plus shards that transformers loads into the same model. Through
    # the installed entry point in a fresh process this time (JAX kept on the CPU by the command).
    done = subprocess.run([sys.executable, "-m", "jaxtrain", "export-hf", str(imported), "--output", str(sharded),
                           "--max-shard-size", "20KB"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "export-hf: step 0 as fp32" in done.stdout
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and sorted(index["weight_map"]) == sorted(source)
    assert not (sharded / "model.safetensors").exists()
    np.testing.assert_array_equal(hf_logits(sharded), hf_logits(plain))


def test_bf16_source_upcasts_exactly_and_exports_the_same_bytes(tmp_path):
    src = make_hf(tmp_path / "src", dtype=torch.bfloat16)
    source = load_file(src / "model.safetensors")
    assert source["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    imported = tmp_path / "imported"
    assert run_cli("import-hf", src, "--output", imported) == 0
    _, params = jax_params(imported)
    embed = np.asarray(params["embed"])
    assert embed.dtype == np.float32
    np.testing.assert_array_equal(embed, source["model.embed_tokens.weight"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(params["blocks"]["mlp"]["w_down"][1]),
                                  source["model.layers.1.mlp.down_proj.weight"].astype(np.float32).T)
    # Default dtype is the source's (bf16); --dtype bf16 says the same; fp32 is the exact upcast.
    for args, dtype in (((), ml_dtypes.bfloat16), (("--dtype", "bf16"), ml_dtypes.bfloat16),
                        (("--dtype", "fp32"), np.float32)):
        out = tmp_path / f"export-{len(args)}-{np.dtype(dtype).name}"
        assert run_cli("export-hf", imported, "--output", out, *args) == 0
        back = load_file(out / "model.safetensors")
        for name, t in source.items():
            assert back[name].dtype == dtype, name
            assert back[name].tobytes() == t.astype(dtype).tobytes(), name
        assert json.loads((out / "config.json").read_text())["dtype"] == np.dtype(dtype).name
    np.testing.assert_allclose(jax_logits(imported), hf_logits(src), atol=1e-4, rtol=0)


def test_transformers_4_and_5_config_layouts_both_load(tmp_path):
    # A theta that is neither the importer's fallback nor transformers' default (10000): a layout
    # whose rope_theta was not read would import with the wrong rotary frequencies.
    theta = 40000.0
    rope = dict(LLAMA3, rope_theta=theta)
    native = make_hf(tmp_path / "native", rope=rope)  # saved by the installed transformers
    saved = json.loads((native / "config.json").read_text())
    assert ("rope_parameters" in saved) == TRANSFORMERS_5 and ("rope_theta" in saved) != TRANSFORMERS_5
    base = {k: v for k, v in saved.items() if k not in ("rope_parameters", "rope_theta", "rope_scaling", "dtype",
                                                        "torch_dtype")}
    # transformers 5.x layout: rope_parameters. 4.x layout, as Llama 3.1's own config.json:
    # top-level rope_theta and rope_scaling.
    hf5 = dict(base, dtype="float32", rope_parameters=rope)
    hf4 = dict(base, torch_dtype="float32", rope_theta=theta,
               rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    src5, src4 = tmp_path / "v5", tmp_path / "v4"
    for src, hf in ((src5, hf5), (src4, hf4)):
        shutil.copytree(native, src)
        (src / "config.json").write_text(json.dumps(hf))
    # Older 4.x files spell the type as `type` and may leave out original_max_position_embeddings.
    legacy = dict(hf4, max_position_embeddings=64,
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    src_legacy = tmp_path / "legacy"
    shutil.copytree(native, src_legacy)
    (src_legacy / "config.json").write_text(json.dumps(legacy))
    models = []
    for src in (src5, src4, src_legacy):
        out = tmp_path / f"imported-{src.name}"
        assert run_cli("import-hf", src, "--output", out) == 0
        models.append(load_config(out / "config.yaml", need_data=False).model)
        if src is not src_legacy:  # transformers reads only its own version's layout: compare with that
            np.testing.assert_allclose(jax_logits(out), hf_logits(native), atol=1e-4, rtol=0)
    assert models[0] == models[1] and models[1].rope_theta == theta and models[1].norm_eps == RMS_EPS
    assert models[2] == models[0].__class__(**{**models[0].__dict__, "max_seq_len": 64})
    # The theta matters to these logits: at the fallback they are clearly different.
    out4 = tmp_path / f"imported-{src4.name}"
    assert np.abs(jax_logits(out4, ("model.rope_theta=10000.0",)) - hf_logits(native)).max() > 1e-2


# ----------------------------------------------------------------------------- refusals


def _with_config(plain: Path, tmp_path: Path, **changes) -> Path:
    src = tmp_path / "src"
    shutil.copytree(plain, src)
    hf = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    (src / "config.json").write_text(json.dumps(hf))
    return src


@pytest.mark.parametrize("changes,field", [
    ({"model_type": "mistral"}, "model_type"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"hidden_size": None}, "hidden_size"),
    ({"intermediate_size": 64}, "model.layers.0.mlp.gate_proj.weight"),  # config and tensors disagree
])
def test_unsupported_sources_are_refused_by_name(changes, field, plain, tmp_path, capsys):
    src = _with_config(plain, tmp_path, **changes)
    out = tmp_path / "out"
    capsys.readouterr()
    assert run_cli("import-hf", src, "--output", out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{field}'" in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_bad_inputs_and_outputs_exit_2_and_touch_nothing(plain, tmp_path, capsys):
    assert run_cli("import-hf", tmp_path / "missing", "--output", tmp_path / "a") == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "a").exists()
    # URLs: named as such (not "does not exist"), before any network access or local 'gs:' folder.
    for args in (("import-hf", "gs://bucket/llama", "--output", tmp_path / "a"),
                 ("import-hf", plain, "--output", "s3://bucket/imported")):
        assert run_cli(*args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "is a URL; it must be a local directory" in err, err
    assert not (tmp_path / "a").exists() and not Path("s3:").exists()

    extra = tmp_path / "extra"  # a tensor the model has no place for (a bias)
    shutil.copytree(plain, extra)
    tensors = load_file(extra / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    from safetensors.numpy import save_file
    save_file(tensors, str(extra / "model.safetensors"), metadata={"format": "pt"})
    assert run_cli("import-hf", extra, "--output", tmp_path / "b") == 2
    assert "'model.layers.0.self_attn.q_proj.bias'" in capsys.readouterr().err and not (tmp_path / "b").exists()

    pickles = tmp_path / "pickles"  # PyTorch .bin only: never unpickled
    pickles.mkdir()
    shutil.copy(plain / "config.json", pickles)
    (pickles / "pytorch_model.bin").write_bytes(b"not read")
    assert run_cli("import-hf", pickles, "--output", tmp_path / "c") == 2
    assert ".bin" in capsys.readouterr().err

    taken = tmp_path / "taken"  # an existing, non-empty output is never touched
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert run_cli("import-hf", plain, "--output", taken) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"] and (taken / "keep.txt").read_text() == "mine"

    imported = tmp_path / "imported"
    assert run_cli("import-hf", plain, "--output", imported) == 0
    assert run_cli("export-hf", imported, "--output", taken) == 2
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    capsys.readouterr()
    assert run_cli("export-hf", imported, "--output", "gs://bucket/exported") == 2
    assert "export-hf --output 'gs://bucket/exported' is a URL" in capsys.readouterr().err
    assert not Path("gs:").exists()
    assert run_cli("export-hf", imported, "--output", tmp_path / "d", "--step", "7") == 2
    assert "good steps: 0" in capsys.readouterr().err and not (tmp_path / "d").exists()
    assert run_cli("export-hf", tmp_path / "missing", "--output", tmp_path / "e") == 2
    assert "config.yaml" in capsys.readouterr().err and not (tmp_path / "e").exists()
    # A config.yaml whose model does not match the checkpoint: named, nothing written.
    mismatch = tmp_path / "mismatch"
    shutil.copytree(imported, mismatch)
    cfg = yaml.safe_load((mismatch / "config.yaml").read_text())
    cfg["model"]["mlp_dim"] = 64
    (mismatch / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert run_cli("export-hf", mismatch, "--output", tmp_path / "f") == 2
    assert "w_gate" in capsys.readouterr().err and not (tmp_path / "f").exists()
    assert not list(tmp_path.glob(".*.partial-*"))


@pytest.mark.parametrize("overrides,named", [
    (["model.rope_scaling_factor=0.5"], "model.rope_scaling_factor"),
    (["model.rope_low_freq_factor=4", "model.rope_high_freq_factor=4"], "model.rope_high_freq_factor"),
    (["model.rope_original_max_len=0"], "model.rope_original_max_len"),
])
def test_rope_scaling_keys_are_validated(overrides, named):
    from jaxtrain.config import ConfigError
    assert load_config(None, overrides).model.rope_scaling == "none"  # unused unless llama3
    with pytest.raises(ConfigError, match=named):
        load_config(None, ["model.rope_scaling=llama3", *overrides])
