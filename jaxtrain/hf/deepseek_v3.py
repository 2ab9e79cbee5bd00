"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type deepseek_v3) <-> jaxtrain: the
config fields and the per-layer weight entries `jaxtrain.hf.mapping` dispatches to for a model with
multi-head latent attention (`model.kv_lora_rank` > 0; jaxtrain/model/mla.py).

Weight layout (HF Linear weights are [out, in]; jaxtrain stacks layers on a leading axis L; Hqk = Hn + Hr):

    HF (model.layers.i.)                              jaxtrain (blocks / dense_blocks)
    self_attn.q_proj                 [N*Hqk, D]        attn.wq                [L, D, N, Hqk]   (q_lora_rank null)
    self_attn.q_a_proj               [Rq, D]           attn.wq_a              [L, D, Rq]
    self_attn.q_a_layernorm          [Rq]              attn.q_a_norm.scale    [L, Rq]
    self_attn.q_b_proj               [N*Hqk, Rq]       attn.wq_b              [L, Rq, N, Hqk]
    self_attn.kv_a_proj_with_mqa     [Rkv+Hr, D]       attn.wkv_a             [L, D, Rkv+Hr]
    self_attn.kv_a_layernorm         [Rkv]             attn.kv_a_norm.scale   [L, Rkv]
    self_attn.kv_b_proj              [N*(Hn+Hv), Rkv]  attn.wkv_b             [L, Rkv, N, Hn+Hv]
    self_attn.o_proj                 [D, N*Hv]         attn.wo                [L, N, Hv, D]
    mlp.{gate,up,down}_proj (the first_k_dense_replace dense layers, as Llama's)
    mlp.gate.weight                  [E, D]            mlp.router             [L, D, E]
    mlp.gate.e_score_correction_bias [E]               the train state's moe.router_bias [L, E] (not a parameter)
    mlp.experts.j.{gate,up,down}_proj                  mlp.w_gate / w_up / w_down [L, E, ...] (as Qwen3-MoE's)
    mlp.shared_experts.gate_proj     [S, D]            mlp.shared_gate        [L, D, S]   (S = n_shared x moe F)
    mlp.shared_experts.up_proj       [S, D]            mlp.shared_up          [L, D, S]
    mlp.shared_experts.down_proj     [D, S]            mlp.shared_down        [L, S, D]

Rotary layout: jaxtrain rotates the Hr rope channels of q and k in pairs (i, i + Hr/2); DeepSeek's
checkpoints (config `rope_interleave: true`, transformers' default) in pairs (2i, 2i + 1). transformers'
interleaved rotation equals rotate-half on the channels reordered [0, 2, 4, ..., 1, 3, 5, ...], so the
import reorders the rope rows of q_proj / q_b_proj (each head's last Hr rows) and of kv_a_proj_with_mqa
(its last Hr rows) that way, and export writes `rope_interleave: true` with the order undone. A source
with `rope_interleave: false` is read without reordering (and exported interleaved).

Multi-token prediction: DeepSeek-V3's checkpoints hold their MTP module as layers num_hidden_layers..
(transformers builds no such layer and ignores them): import skips those tensors (named in its summary)
and sets model.mtp_depth=0; export writes no MTP (`num_nextn_predict_layers: 0`) and says it dropped
the run's `mtp` parameters.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import numpy as np

from jaxtrain.config import ConfigError, ModelConfig

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
BIAS = "mlp.gate.e_score_correction_bias"  # per MoE layer: the routing bias (train state moe.router_bias)
_Convert = Callable[[np.ndarray, ModelConfig], np.ndarray]
_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "truncate"}


# ----------------------------------------------------------------------------- config mapping


def model_section(hf: dict) -> dict:
    """The jaxtrain `model` section of a DeepseekV3ForCausalLM config.json (after `mapping.model_section_from_hf`'s
    checks common to every family).

    Raises:
      ConfigError: a field jaxtrain's MLA / sigmoid group routing cannot represent, named (topk_method,
        scoring_func, norm_topk_prob, num_key_value_heads, first_k_dense_replace, moe_layer_freq, rope type, ...).
    """
    from jaxtrain.hf.common import _float_field, _int_field

    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"config.json field 'topk_method'={hf['topk_method']!r} is not supported (jaxtrain's "
                          "DeepSeek-V3 routing is noaux_tc: group-limited top-k on sigmoid scores + bias)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"config.json field 'scoring_func'={hf['scoring_func']!r} is not supported (jaxtrain's "
                          "DeepSeek-V3 routing scores experts with sigmoid)")
    if hf.get("norm_topk_prob", True) is not True:
        raise ConfigError(f"config.json field 'norm_topk_prob'={hf['norm_topk_prob']!r} is not supported (jaxtrain's "
                          "sigmoid routing always normalises the chosen scores: true)")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"config.json field 'moe_layer_freq'={hf['moe_layer_freq']!r} is not supported (every "
                          "layer after first_k_dense_replace is MoE: 1)")
    if hf.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise ConfigError(f"config.json field 'partial_rotary_factor'={hf['partial_rotary_factor']!r} is not "
                          "supported (MLA rotates the qk_rope_head_dim channels whole)")
    if not isinstance(hf.get("rope_interleave", True), bool):
        raise ConfigError(f"config.json field 'rope_interleave'={hf['rope_interleave']!r} must be true or false")
    layers, heads = _int_field(hf, "num_hidden_layers"), _int_field(hf, "num_attention_heads")
    if hf.get("num_key_value_heads", heads) not in (None, heads):
        raise ConfigError(f"config.json field 'num_key_value_heads'={hf['num_key_value_heads']!r} is not supported "
                          f"(multi-head latent attention: every head has its own key and value, {heads})")
    nope, rope, v = (_int_field(hf, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_lora = 0 if hf.get("q_lora_rank") is None else _int_field(hf, "q_lora_rank")
    first = hf.get("first_k_dense_replace", 0)
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < layers:
        raise ConfigError(f"config.json field 'first_k_dense_replace'={first!r} is not supported (jaxtrain needs "
                          f"at least one MoE layer: 0 <= it < num_hidden_layers={layers})")
    experts = _int_field(hf, "n_routed_experts", hf.get("num_local_experts"))
    shared = hf.get("n_shared_experts") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"config.json field 'n_shared_experts'={shared!r} must be a non-negative integer")
    section = {
        "vocab_size": _int_field(hf, "vocab_size"),
        "d_model": _int_field(hf, "hidden_size"),
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": nope + rope,
        "mlp_dim": _int_field(hf, "intermediate_size"),
        "max_seq_len": _int_field(hf, "max_position_embeddings", 4096),  # DeepseekV3Config's default
        "norm_eps": _float_field(hf, "rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **_rope_from_hf(hf),
        "kv_lora_rank": _int_field(hf, "kv_lora_rank"), "q_lora_rank": q_lora,
        "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": v,
        "num_experts": experts, "experts_per_token": _int_field(hf, "num_experts_per_tok"),
        "moe_mlp_dim": _int_field(hf, "moe_intermediate_size"), "moe_router": "sigmoid", "moe_norm_topk_prob": True,
        "moe_n_group": _int_field(hf, "n_group", 1), "moe_topk_group": _int_field(hf, "topk_group", 1),
        "moe_routed_scaling_factor": _float_field(hf, "routed_scaling_factor", hf.get("routed_scaling_factor", 1.0)),
        "num_shared_experts": shared, "first_dense_layers": first, "moe_every": 1,
        "capacity_factor": 0.0,  # dropless, as transformers runs it
        "mtp_depth": 0,  # transformers runs no MTP module; the import skips its tensors (module doc)
    }
    if isinstance(hf.get("initializer_range"), (int, float)) and hf["initializer_range"] > 0:
        section["init_std"] = float(hf["initializer_range"])
    return section


def _rope_from_hf(hf: dict) -> dict:
    """The rotary keys: the default rope, or YaRN with DeepSeek's mscale / mscale_all_dim (transformers
    5's `rope_parameters` or 4.x's `rope_theta` + `rope_scaling`); any other rope type is refused."""
    from jaxtrain.hf.common import _float_field, _int_field, rope_params

    params, where = rope_params(hf)
    theta = _float_field(hf, f"{where}.rope_theta", params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": "none"}
    if kind != "yarn":
        raise ConfigError(f"config.json field '{where}.rope_type'={kind!r} is not supported (DeepSeek-V3 in "
                          "jaxtrain: 'default' or 'yarn')")
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:  # attention_factor above all: jaxtrain derives it from factor and the mscales
        raise ConfigError(f"config.json field '{where}.{unknown[0]}' is not supported (jaxtrain's YaRN takes "
                          f"{', '.join(sorted(_YARN_KEYS - {'type', 'rope_type'}))})")
    original = _int_field(params, "original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = _int_field(hf, "max_position_embeddings") / original
    out = {"rope_theta": theta, "rope_scaling": "yarn",
           "rope_scaling_factor": _float_field(hf, f"{where}.factor", factor),
           "rope_original_max_len": original,
           # transformers: a missing (or zero) beta falls back to 32 / 1
           "rope_yarn_beta_fast": _float_field(hf, f"{where}.beta_fast", params.get("beta_fast") or 32.0),
           "rope_yarn_beta_slow": _float_field(hf, f"{where}.beta_slow", params.get("beta_slow") or 1.0),
           "rope_yarn_mscale": _float_field(hf, f"{where}.mscale", params.get("mscale") or 0.0),
           "rope_yarn_mscale_all_dim": _float_field(hf, f"{where}.mscale_all_dim", params.get("mscale_all_dim") or 0.0)}
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"config.json field '{where}.truncate'={truncate!r} must be true or false")
    out["rope_yarn_truncate"] = truncate
    return out


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """A DeepseekV3ForCausalLM config.json for a model with MLA; what it cannot represent is refused by name."""
    from jaxtrain.hf.common import HF_DTYPE_NAMES

    refused = {"model.num_experts=0": m.num_experts == 0, "model.moe_router=softmax": m.moe_router != "sigmoid",
               "model.moe_every": m.moe_every != 1, "model.qk_norm": m.qk_norm, "model.post_norms": m.post_norms,
               "model.norm_plus_one": m.norm_plus_one, "model.embed_scale": m.embed_scale,
               "model.mlp_activation": m.mlp_activation != "silu", "model.mlp_bias": m.mlp_bias,
               "model.attention_bias": m.attention_bias, "model.attention_sinks": m.attention_sinks,
               "model.sliding_window": m.sliding_window > 0,
               f"model.rope_scaling={m.rope_scaling}": m.rope_scaling not in ("none", "yarn")}
    named = [k for k, v in refused.items() if v]
    if named:
        raise ConfigError(f"export-hf: DeepseekV3ForCausalLM cannot represent {', '.join(named)} (MLA, sigmoid "
                          "group-limited routing in every layer after the dense ones, SwiGLU, default or YaRN rope)")
    rope: dict = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": m.rope_scaling_factor,
                "original_max_position_embeddings": m.rope_original_max_len, "beta_fast": m.rope_yarn_beta_fast,
                "beta_slow": m.rope_yarn_beta_slow}
        rope.update({k: v for k, v in (("mscale", m.rope_yarn_mscale), ("mscale_all_dim", m.rope_yarn_mscale_all_dim))
                     if v})
        if not m.rope_yarn_truncate:
            rope["truncate"] = False
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.mlp_dim,
        "moe_intermediate_size": m.moe_mlp_dim or m.mlp_dim, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "n_shared_experts": m.num_shared_experts, "n_routed_experts": m.num_experts,
        "routed_scaling_factor": m.moe_routed_scaling_factor, "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank or None, "qk_rope_head_dim": m.qk_rope_head_dim,
        "qk_nope_head_dim": m.qk_nope_head_dim, "v_head_dim": m.v_head_dim, "n_group": m.moe_n_group,
        "topk_group": m.moe_topk_group, "num_experts_per_tok": m.experts_per_token,
        "first_k_dense_replace": m.first_dense_layers, "norm_topk_prob": True,
        # The original DeepSeek code (trust_remote_code, vLLM) reads these; transformers ignores them.
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
        "hidden_act": "silu", "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope, "rope_theta": m.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling != "none" else None,
        "rope_interleave": True, "tie_word_embeddings": m.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": m.init_std, "use_cache": True,
        "num_nextn_predict_layers": 0,  # no MTP layers written (module doc)
        "dtype": HF_DTYPE_NAMES[dtype], "torch_dtype": HF_DTYPE_NAMES[dtype],
    }


def ignored_tensors(hf: dict, names: list[str]) -> list[str]:
    """The tensors of DeepSeek-V3's multi-token prediction module (layers num_hidden_layers and beyond),
    which transformers does not build and import skips."""
    layers = hf.get("num_hidden_layers")
    if not isinstance(layers, int):
        return []
    found = (re.match(r"model\.layers\.(\d+)\.", n) for n in names)
    return sorted(n for n, f in zip(names, found) if f and int(f.group(1)) >= layers)


# ----------------------------------------------------------------------------- weight entries


def rope_order(Hr: int) -> np.ndarray:
    """jaxtrain's rope channel c is HF's interleaved channel rope_order(Hr)[c]: [0, 2, ..., 1, 3, ...]."""
    return np.concatenate([np.arange(0, Hr, 2), np.arange(1, Hr, 2)])


def _heads(interleave: bool) -> tuple[_Convert, _Convert]:
    """q_proj / q_b_proj [N*Hqk, in] <-> [in, N, Hqk], each head's rope rows reordered (`interleave`).
    Works on a block of whole heads (the streaming import's row blocks)."""
    def order(m: ModelConfig) -> np.ndarray:
        Hn, Hr = m.qk_nope_head_dim, m.qk_rope_head_dim
        return np.concatenate([np.arange(Hn), Hn + (rope_order(Hr) if interleave else np.arange(Hr))])

    def from_hf(t: np.ndarray, m: ModelConfig) -> np.ndarray:
        return t.reshape(-1, m.head_dim, t.shape[-1])[:, order(m)].transpose(2, 0, 1)

    def to_hf(a: np.ndarray, m: ModelConfig) -> np.ndarray:
        back = np.argsort(order(m))
        return a.transpose(1, 2, 0)[:, back].reshape(m.num_heads * m.head_dim, a.shape[0])

    return from_hf, to_hf


def _kv_a(interleave: bool) -> tuple[_Convert, _Convert]:
    """kv_a_proj_with_mqa [Rkv + Hr, D] <-> [D, Rkv + Hr], the rope rows reordered (`interleave`)."""
    def order(m: ModelConfig) -> np.ndarray:
        Hr, Rkv = m.qk_rope_head_dim, m.kv_lora_rank
        return np.concatenate([np.arange(Rkv), Rkv + (rope_order(Hr) if interleave else np.arange(Hr))])

    return (lambda t, m: t[order(m)].T), (lambda a, m: a.T[np.argsort(order(m))])


def _same(t: np.ndarray, m: ModelConfig) -> np.ndarray:
    return t


def _t(t: np.ndarray, m: ModelConfig) -> np.ndarray:
    return t.T


def attention_entries(m: ModelConfig, interleave: bool = True) -> dict[tuple[str, ...], tuple[str, _Convert, _Convert]]:
    """jaxtrain path under a block -> (HF name under `model.layers.{i}.`, HF -> jaxtrain, back) of the MLA weights,
    in transformers' order. `interleave`: the source's rope_interleave (export always writes true)."""
    entries: dict[tuple[str, ...], tuple[str, _Convert, _Convert]] = {}
    if m.q_lora_rank:
        entries[("attn", "wq_a")] = ("self_attn.q_a_proj.weight", _t, _t)
        entries[("attn", "q_a_norm", "scale")] = ("self_attn.q_a_layernorm.weight", _same, _same)
        entries[("attn", "wq_b")] = ("self_attn.q_b_proj.weight", *_heads(interleave))
    else:
        entries[("attn", "wq")] = ("self_attn.q_proj.weight", *_heads(interleave))
    entries[("attn", "wkv_a")] = ("self_attn.kv_a_proj_with_mqa.weight", *_kv_a(interleave))
    entries[("attn", "kv_a_norm", "scale")] = ("self_attn.kv_a_layernorm.weight", _same, _same)
    entries[("attn", "wkv_b")] = ("self_attn.kv_b_proj.weight",
                                  lambda t, m: t.reshape(m.num_heads, -1, t.shape[-1]).transpose(2, 0, 1),
                                  lambda a, m: a.transpose(1, 2, 0).reshape(-1, a.shape[0]))
    entries[("attn", "wo")] = ("self_attn.o_proj.weight",
                               lambda t, m: t.reshape(-1, m.num_heads, m.v_head_dim).transpose(1, 2, 0),
                               lambda a, m: a.transpose(2, 0, 1).reshape(a.shape[2], -1))
    return entries


# The shared experts of an MoE layer (model.num_shared_experts), as a dense SwiGLU.
SHARED: dict[tuple[str, ...], tuple[str, _Convert, _Convert]] = {
    ("mlp", "shared_gate"): ("mlp.shared_experts.gate_proj.weight", _t, _t),
    ("mlp", "shared_up"): ("mlp.shared_experts.up_proj.weight", _t, _t),
    ("mlp", "shared_down"): ("mlp.shared_experts.down_proj.weight", _t, _t),
}


def layer_entries(m: ModelConfig, moe: bool, llama: dict, interleave: bool = True) -> dict:
    """One layer's `common._LAYER`-style entries (an MoE layer's router and routed experts apart), in
    transformers' order: MLA, the dense MLP (`llama`'s) or the shared experts, the two norms."""
    entries = dict(attention_entries(m, interleave))
    for key, value in llama.items():
        if key[0] == "mlp" and not moe:
            entries[key] = value
    if moe and m.num_shared_experts:
        entries.update(SHARED)
    entries.update({k: v for k, v in llama.items() if k[0] != "attn" and k[0] != "mlp"})
    return entries


def layer_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name under `model.layers.{i}.` -> shape, of the tensors `layer_entries` adds to Llama's."""
    D, N, Hqk, Hn, Hr, Hv = m.d_model, m.num_heads, m.head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    Rq, Rkv, S = m.q_lora_rank, m.kv_lora_rank, m.num_shared_experts * (m.moe_mlp_dim or m.mlp_dim)
    return {"self_attn.q_proj.weight": (N * Hqk, D), "self_attn.q_a_proj.weight": (Rq, D),
            "self_attn.q_a_layernorm.weight": (Rq,), "self_attn.q_b_proj.weight": (N * Hqk, Rq),
            "self_attn.kv_a_proj_with_mqa.weight": (Rkv + Hr, D), "self_attn.kv_a_layernorm.weight": (Rkv,),
            "self_attn.kv_b_proj.weight": (N * (Hn + Hv), Rkv), "self_attn.o_proj.weight": (D, N * Hv),
            "mlp.shared_experts.gate_proj.weight": (S, D), "mlp.shared_experts.up_proj.weight": (S, D),
            "mlp.shared_experts.down_proj.weight": (D, S)}


def router_bias_rows(router_bias: Optional[Any], m: ModelConfig) -> np.ndarray:
    """The routing bias [MoE layers, E] fp32 to export: the run's (train state moe.router_bias), or zeros."""
    if router_bias is None:
        return np.zeros((m.num_moe_layers, m.num_experts), np.float32)
    return np.asarray(router_bias, dtype=np.float32)
