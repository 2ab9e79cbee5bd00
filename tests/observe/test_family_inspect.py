"""The dense family presets answered by `jaxtrain inspect` from shapes (8 simulated devices, fewer layers):
Qwen3-0.6B and Gemma 3 1B (one whole local/global pattern, rows longer than the 512-token window)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.model.llama import Transformer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config, overrides", [
    ("qwen3-0.6b", ("model.num_layers=2", "data.seq_len=256", "data.global_batch_size=8")),
    ("gemma3-1b", ("model.num_layers=6", "data.seq_len=1024", "data.global_batch_size=8")),
])
def test_family_preset_compiles_from_shapes(config, overrides):
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "inspect", "--config", str(REPO / f"configs/{config}.yaml"),
                        "--json", "--cpu-devices", "8", *overrides], capture_output=True, text=True, timeout=900,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    cfg = load_config(REPO / f"configs/{config}.yaml", list(overrides))
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    assert report["params"] == sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param)))
    assert report["devices"] == 8 and report["peak_memory_bytes_per_device"] > report["memory_bytes_per_device"]["arguments"] > 0 and report["flops_per_step"] > 0
