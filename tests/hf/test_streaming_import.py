"""`jaxtrain import-hf` streams: a model several times larger than the memory budget is imported
with a measured peak RSS under that budget, and the checkpoint holds the source's exact values.

The wide model is written as safetensors directly (numpy; transformers would first build it in
torch), its expected jaxtrain parameters are computed here with numpy (reshape/transpose of each
HF tensor, independent of jaxtrain.hf.mapping), and the checkpoint is read back with the
repository's own restore path (`restore_params_only`, as `checkpoint.init_from` reads it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

import jaxtrain.hf.streaming as streaming
from jaxtrain.checkpoint.checkpointer import restore_params_only
from jaxtrain.config import ConfigError
from jaxtrain.hf.importer import import_hf, model_only_config, read_hf
from jaxtrain.hf.mapping import param_plan
from test_hf import make_hf
from test_mixtral import make_mixtral
from test_qwen3 import VARIANTS, make_qwen3

# The wide model: 8 layers of d_model 1024, MLP 4096, 16 heads of 64 (4 kv heads), vocab 16384,
# untied: 155 M parameters, 621 MB (592 MiB) of fp32, source and checkpoint alike.
D, F, L, V, H, N, K = 1024, 4096, 8, 16384, 64, 16, 4
MODEL_BYTES = 4 * (2 * V * D + D + L * (2 * D * N * H + 2 * D * K * H + 3 * D * F + 2 * D))
# Peak RSS of the import minus that of a bare `import jaxtrain.hf.importer, jax`. Measured (2-core
# Xeon, 2026-12-06): ~100 MB, of which ~40 MB is the import's code path (Orbax, tensorstore, the
# CLI) on any model; the in-memory import it replaces peaked above the model's 638 MB.
BUDGET_BYTES = 160 * 2**20


def _tensors(rng: np.random.Generator):
    """(name, fp32 tensor) of the wide Llama, in file order."""
    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    yield "model.embed_tokens.weight", r(V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        yield from [(p + "self_attn.q_proj.weight", r(N * H, D)), (p + "self_attn.k_proj.weight", r(K * H, D)),
                    (p + "self_attn.v_proj.weight", r(K * H, D)), (p + "self_attn.o_proj.weight", r(D, N * H)),
                    (p + "mlp.gate_proj.weight", r(F, D)), (p + "mlp.up_proj.weight", r(F, D)),
                    (p + "mlp.down_proj.weight", r(D, F)), (p + "input_layernorm.weight", r(D)),
                    (p + "post_attention_layernorm.weight", r(D))]
    yield "model.norm.weight", r(D)
    yield "lm_head.weight", r(V, D)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """The wide random Llama as two safetensors shards and an index (written shard by shard, so
    this process never holds the whole model either)."""
    src = tmp_path_factory.mktemp("wide")
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": D,
              "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": N, "num_key_value_heads": K,
              "head_dim": H, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (src / "config.json").write_text(json.dumps(config))
    weight_map, shard, total = {}, {}, 0
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, t in _tensors(np.random.default_rng(0)):
        shard[name] = t
        total += t.nbytes
        if name == "model.layers.3.post_attention_layernorm.weight" or name == "lm_head.weight":
            file = names[0] if name != "lm_head.weight" else names[1]
            save_file(shard, os.fspath(src / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in shard})
            shard = {}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    assert total == MODEL_BYTES
    return src


def _peak_rss_bytes(args: list[str]) -> int:
    """ru_maxrss of one child process (run in a fresh interpreter, so only that child counts)."""
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1]) * 1024  # Linux: KiB


def _restore(out: Path, shapes: dict) -> dict:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32, sharding=device), shapes,
                            is_leaf=lambda x: isinstance(x, tuple))
    return jax.tree.map(np.asarray, restore_params_only(os.fspath(out), abstract))


def test_wide_model_imports_under_a_memory_budget_with_exact_values(wide, tmp_path):
    out = tmp_path / "imported"
    baseline = _peak_rss_bytes([sys.executable, "-c", "import jaxtrain.hf.importer, jax"])
    peak = _peak_rss_bytes([sys.executable, "-m", "jaxtrain", "import-hf", os.fspath(wide), "--output", os.fspath(out)])
    print(f"model {MODEL_BYTES / 2**20:.0f} MiB, import peak RSS {peak / 2**20:.0f} MiB, "
          f"baseline {baseline / 2**20:.0f} MiB, difference {(peak - baseline) / 2**20:.0f} MiB")
    assert MODEL_BYTES > 3.5 * BUDGET_BYTES
    assert peak - baseline < BUDGET_BYTES

    shapes = {"embed": (V, D), "final_norm": {"scale": (D,)}, "head": (D, V),
              "blocks": {"attn": {"wq": (L, D, N, H), "wk": (L, D, K, H), "wv": (L, D, K, H), "wo": (L, N, H, D)},
                         "mlp": {"w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)},
                         "attn_norm": {"scale": (L, D)}, "mlp_norm": {"scale": (L, D)}}}
    got = _restore(out, shapes)
    # Expected values from the files, converted here with numpy alone (HF Linear weights are [out, in]).
    heads = {"q": N, "k": K, "v": K}
    for name, t in _tensors(np.random.default_rng(0)):
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            pairs = [(got["embed"], t)]
        elif name == "lm_head.weight":
            pairs = [(got["head"], t.T)]
        elif name == "model.norm.weight":
            pairs = [(got["final_norm"]["scale"], t)]
        else:
            i, kind, b = int(parts[2]), parts[4], got["blocks"]
            if parts[3] == "self_attn" and kind in ("q_proj", "k_proj", "v_proj"):
                a, want = b["attn"]["w" + kind[0]][i], t.reshape(heads[kind[0]], H, D).transpose(2, 0, 1)
            elif kind == "o_proj":
                a, want = b["attn"]["wo"][i], t.reshape(D, N, H).transpose(1, 2, 0)
            elif parts[3] == "mlp":
                a, want = b["mlp"]["w_" + kind.split("_")[0]][i], t.T
            else:
                a, want = b["attn_norm" if parts[3] == "input_layernorm" else "mlp_norm"]["scale"][i], t
            pairs = [(a, want)]
        for a, want in pairs:
            assert a.dtype == np.float32 and np.array_equal(a, want), name


@pytest.mark.parametrize("kind", ["llama-bf16", "qwen3-moe", "mixtral"])
def test_pieces_split_finely_give_the_in_memory_import_bitwise(kind, tmp_path, monkeypatch):
    """Pieces of a few hundred bytes (q/k/v by heads, o_proj / MLP / router / expert matrices and
    the embedding by rows) assemble into exactly the parameters the in-memory import builds."""
    src = tmp_path / "src"
    if kind == "llama-bf16":
        make_hf(src, dtype=torch.bfloat16)
    elif kind == "qwen3-moe":
        make_qwen3(src, VARIANTS["qwen3-moe-dense-first-norm"][0])
    else:
        make_mixtral(src)
    monkeypatch.setattr(streaming, "PIECE_BYTES", 300)
    _, model, params, _, _ = read_hf(os.fspath(src))
    plans = param_plan(model_only_config(model).model, 300)
    split = {p.path for p in plans if len(p.pieces) > len({q.name for q in p.pieces})}  # > 1 piece per tensor
    assert ("blocks", "attn", "wq") in split and ("embed",) in split  # really split, not just per layer
    import_hf(os.fspath(src), os.fspath(tmp_path / "out"))
    got = _restore(tmp_path / "out", jax.tree.map(lambda a: a.shape, params))
    flat_want, flat_got = jax.tree_util.tree_leaves_with_path(params), dict(jax.tree_util.tree_leaves_with_path(got))
    assert len(flat_want) == len(flat_got)
    for path, want in flat_want:
        assert np.array_equal(flat_got[path], want), jax.tree_util.keystr(path)
    with safe_open(os.fspath(next(src.glob("*.safetensors"))), framework="numpy") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == (ml_dtypes.bfloat16 if kind == "llama-bf16" else np.float32)
    assert np.array_equal(got["embed"], embed.astype(np.float32))


def test_non_finite_weights_found_while_writing_leave_nothing(tmp_path):
    src = make_hf(tmp_path / "src")
    path = src / "model.safetensors"
    with safe_open(os.fspath(path), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan  # late in the write order
    save_file(tensors, os.fspath(path), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="NaN or Inf.*down_proj"):
        import_hf(os.fspath(src), os.fspath(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temporary folder


def test_interrupted_import_leaves_no_output(wide, tmp_path):
    """Ctrl-C while the checkpoint's arrays are being written (Orbax's temporary folders): neither
    the output nor the temporary folder is left. (Waiting for a file under the committed `state/`
    raced the import's end: that name appears only at the final rename.)"""
    out = tmp_path / "imported"
    proc = subprocess.Popen([sys.executable, "-m", "jaxtrain", "import-hf", os.fspath(wide), "--output", os.fspath(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".imported.partial-*/checkpoints/*.orbax-checkpoint-tmp/state*/ocdbt.process_0/d")):
        assert proc.poll() is None and time.monotonic() < deadline, "the import never started writing arrays"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, err[-2000:]
    assert list(tmp_path.iterdir()) == [], err[-2000:]
