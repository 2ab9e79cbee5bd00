"""The MoE presets checked from shapes: parameter counts (total and active), `jaxtrain inspect`'s
expert weight memory per device and all-to-all bytes beside the theory for the layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from jaxtrain.config import load_config
from jaxtrain.model.llama import Transformer, matmul_params
from jaxtrain.observe.throughput import flops_per_step

REPO = Path(__file__).resolve().parents[2]


def count(cfg) -> int:
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    return sum(x.size for x in __import__("jax").tree_util.tree_leaves(nnx.state(abstract)))


def test_mixtral_preset_has_mixtrals_parameter_counts():
    cfg = load_config(REPO / "configs/mixtral-8x7b.yaml")
    assert count(cfg) == 46_702_792_704  # MixtralForCausalLM's 8x7B
    D, F, L = 4096, 14336, 32
    attention = D * 128 * (2 * 32 + 2 * 8)
    active = L * (attention + D * 8 + 2 * 3 * D * F) + D * 32000  # top-2 + the router; the head, not the table
    assert matmul_params(cfg.model) == active
    tokens = 512 * 4096
    dense_like = load_config(REPO / "configs/mixtral-8x7b.yaml", ["model.num_experts=0", "model.mlp_dim=28672", "mesh.expert=1"])
    # MFU counts active FLOPs: a dense model with the two experts' width, plus the router.
    assert flops_per_step(cfg) - flops_per_step(dense_like) == pytest.approx(6 * L * D * 8 * tokens)


def test_deepseek_preset_counts_shared_and_dense_layers():
    cfg = load_config(REPO / "configs/deepseek-moe-16b.yaml")
    D, E, Fe, V = 2048, 64, 1408, 102400
    attention = D * 128 * 64
    moe = attention + D * E + 3 * D * Fe * (E + 2) + 2 * D
    dense = attention + 3 * D * 10944 + 2 * D
    assert count(cfg) == dense + 27 * moe + 2 * V * D + D
    assert matmul_params(cfg.model) == (attention + 3 * D * 10944) + 27 * (attention + D * E + 3 * D * Fe * 8) + D * V


def inspect(config: str, *overrides: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "inspect", "--config", str(REPO / config), "--json",
                        "--cpu-devices", "8", *overrides], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_inspect_mixtral_reports_expert_memory_and_all_to_all_against_theory():
    # fp32: under bf16 XLA:CPU's compiled all-to-alls measure 2x the bf16 theory (they move 4-byte elements).
    report = inspect("configs/mixtral-8x7b.yaml", "model.num_layers=2", "data.seq_len=256", "data.global_batch_size=8",
                     "precision.policy=fp32")
    moe = report["moe"]
    assert report["mesh"]["expert"] == 8 and moe["dispatch"] == "capacity" and moe["expert_ways"] == 8
    # One expert per device: 2 layers x 3 matrices of 4096 x 14336, fp32.
    assert moe["expert_weight_bytes_per_device"] == 2 * 3 * 4096 * 14336 * 4
    # Group: 8 x 256 / 8 devices = 256 tokens; C = ceil(1.25 x 256 x 2 / 8) = 80.
    assert moe["group_tokens"] == 256 and moe["capacity_per_expert"] == 80
    # 2 layers x (2 forward + 2 remat recompute + 2 backward) all-to-alls of [8, 80, 4096] fp32, 7/8 on the wire.
    assert moe["all_to_all_bytes_theory"] == 2 * 6 * 8 * 80 * 4096 * 4 * 7 / 8
    assert moe["all_to_all_ratio"] == pytest.approx(1.0, rel=0.01), moe


def test_inspect_deepseek_preset_compiles_from_shapes():
    report = inspect("configs/deepseek-moe-16b.yaml", "model.num_layers=3", "data.seq_len=256",
                     "data.global_batch_size=8", "precision.policy=fp32")
    moe = report["moe"]
    assert moe["dispatch"] == "dropless-dense-all_to_all" and moe["capacity_per_expert"] == 256
    # 8 of the 64 experts per device: 2 MoE layers x 3 matrices of 2048 x 1408 x 8, fp32.
    assert moe["expert_weight_bytes_per_device"] == 2 * 3 * 2048 * 1408 * 8 * 4
    assert moe["all_to_all_ratio"] == pytest.approx(1.0, rel=0.01), moe


def test_qwen3_presets_have_qwen3s_parameter_counts():
    dense, moe = (load_config(REPO / f"configs/{name}.yaml") for name in ("qwen3-0.6b", "qwen3-30b-a3b"))
    assert count(dense) == 596_049_920  # Qwen3-0.6B: tied, q/k norms included
    assert count(moe) == 30_532_122_624  # Qwen3-30B-A3B
    D, L, V = 2048, 48, 151936
    attention = D * 128 * (2 * 32 + 2 * 4)
    assert matmul_params(moe.model) == L * (attention + D * 128 + 3 * D * 768 * 8) + D * V  # top-8 + the router


def test_inspect_qwen3_moe_preset_compiles_from_shapes():
    report = inspect("configs/qwen3-30b-a3b.yaml", "model.num_layers=2", "data.seq_len=256",
                     "data.global_batch_size=8", "precision.policy=fp32")
    moe = report["moe"]
    assert report["mesh"]["expert"] == 8 and moe["dispatch"] == "capacity" and moe["expert_ways"] == 8
    # 16 of the 128 experts per device: 2 layers x 3 matrices of 2048 x 768 x 16, fp32.
    assert moe["expert_weight_bytes_per_device"] == 2 * 3 * 2048 * 768 * 16 * 4
    # Group: 8 x 256 / 8 devices = 256 tokens; C = ceil(1.25 x 256 x 8 / 128) = 20.
    assert moe["group_tokens"] == 256 and moe["capacity_per_expert"] == 20
    assert moe["all_to_all_ratio"] == pytest.approx(1.0, rel=0.01), moe
