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


def inspected(config: str, overrides: tuple[str, ...]) -> tuple[dict, object]:
    """(`jaxtrain inspect --json` of configs/<config>.yaml on 8 simulated devices, the config), with
    the checks every preset shares: the parameters counted from shapes, memory reported."""
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "inspect", "--config", str(REPO / f"configs/{config}.yaml"),
                        "--json", "--cpu-devices", "8", *overrides], capture_output=True, text=True, timeout=900,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    cfg = load_config(REPO / f"configs/{config}.yaml", list(overrides))
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    assert report["params"] == sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param)))
    assert report["peak_memory_bytes_per_device"] > report["memory_bytes_per_device"]["arguments"] > 0
    return report, cfg


@pytest.mark.parametrize("config, overrides", [
    ("qwen3-0.6b", ("model.num_layers=2", "data.seq_len=256", "data.global_batch_size=8")),
    ("gemma3-1b", ("model.num_layers=6", "data.seq_len=1024", "data.global_batch_size=8")),
])
def test_family_preset_compiles_from_shapes(config, overrides):
    report, _ = inspected(config, overrides)
    assert report["devices"] == 8 and report["flops_per_step"] > 0


# gpt-oss: (published total, published active) parameters (OpenAI's model card: 20.91B / 3.61B and
# 116.83B / 5.13B; active = per token, the unembedding included, the embedding lookup not).
GPT_OSS = {"gpt-oss-20b": (20.91e9, 3.61e9), "gpt-oss-120b": (116.83e9, 5.13e9)}


@pytest.mark.parametrize("config", sorted(GPT_OSS))
def test_gpt_oss_preset_has_the_published_counts_and_compiles_from_shapes(config):
    """The full-depth preset's parameters, total and active (`matmul_params`), within 0.5% of the
    published counts; `jaxtrain inspect` (2 layers, experts 8 ways over the 8 simulated devices in
    place of the preset's FSDP x cross-host experts) counts the same parameters, holds each
    device's 1/8 of the experts (weights and biases) and measures the all-to-all its theory gives."""
    from jaxtrain.model.llama import matmul_params

    total, active = GPT_OSS[config]
    full = load_config(REPO / f"configs/{config}.yaml")
    abstract = nnx.eval_shape(lambda: Transformer(full.model, rngs=nnx.Rngs(0)))
    assert abs(sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param))) / total - 1) < 0.005
    assert abs(matmul_params(full.model) / active - 1) < 0.005
    overrides = ("model.num_layers=2", "mesh.fsdp=1", "mesh.expert=8", "mesh.dcn_expert=1", "data.seq_len=256",
                 "data.global_batch_size=8", "precision.policy=fp32")
    report, cfg = inspected(config, overrides)
    moe, D, E = report["moe"], 2880, cfg.model.num_experts
    assert moe["expert_ways"] == 8
    # 2 layers x E/8 experts x (3 matrices of 2880 x 2880 + b_gate, b_up, b_down of 2880), fp32.
    assert moe["expert_weight_bytes_per_device"] == 2 * E // 8 * (3 * D * D + 3 * D) * 4
    assert moe["all_to_all_bytes"] > 0 and moe["all_to_all_ratio"] == pytest.approx(1.0, rel=0.01), moe
    # Active per token (inspect's count: every parameter but the E - k experts a token skips, per layer).
    k = cfg.model.experts_per_token
    assert report["active_params"] == report["params"] - 2 * (E - k) * (3 * D * D + 3 * D)


# DeepSeek-V3 (arXiv 2412.19437): 671B parameters in the main model, 37B active per token. The MTP
# module is not counted (DeepSeek's 685B adds its 14B MoE module; jaxtrain's MTP block is dense, 0.69B).
DEEPSEEK_V3 = (671e9, 37e9)


def test_deepseek_v3_preset_has_the_published_counts_and_compiles_from_shapes():
    """configs/deepseek-v3-671b.yaml without its MTP module: total parameters within 0.5% of 671B and
    active ones (`matmul_params`: the head included, the embedding lookup not) within 2% of the published,
    rounded 37B; `jaxtrain inspect` (4 layers: the 3 dense and 1 MoE, MTP on, experts 8 ways over the 8
    simulated devices in place of the preset's FSDP x cross-host experts) counts the same parameters,
    holds each device's 1/8 of the experts and measures the all-to-all its theory gives."""
    from jaxtrain.model.llama import matmul_params

    total, active = DEEPSEEK_V3
    full = load_config(REPO / "configs/deepseek-v3-671b.yaml", ["model.mtp_depth=0"])
    abstract = nnx.eval_shape(lambda: Transformer(full.model, rngs=nnx.Rngs(0)))
    assert abs(sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param))) / total - 1) < 0.005
    assert abs(matmul_params(full.model) / active - 1) < 0.02
    overrides = ("model.num_layers=4", "mesh.fsdp=1", "mesh.dcn_fsdp=1", "mesh.expert=8", "mesh.dcn_expert=1",
                 "data.seq_len=256", "data.global_batch_size=8", "precision.policy=fp32")
    report, cfg = inspected("deepseek-v3-671b", overrides)
    moe, D, F, E, k = report["moe"], 7168, 2048, cfg.model.num_experts, cfg.model.experts_per_token
    assert moe["expert_ways"] == 8
    assert moe["expert_weight_bytes_per_device"] == E // 8 * 3 * D * F * 4  # 1 MoE layer, fp32
    assert moe["all_to_all_bytes"] > 0 and moe["all_to_all_ratio"] == pytest.approx(1.0, rel=0.01), moe
    assert report["active_params"] == report["params"] - (E - k) * 3 * D * F
