"""Hugging Face gpt-oss (GptOssForCausalLM) <-> jaxtrain: config fields and weight layout, as pure
functions on dicts and numpy arrays; `jaxtrain.hf.mapping` dispatches here for model_type gpt_oss
(and for a jaxtrain model with `model.attention_sinks`).

gpt-oss is a mixture of experts in every layer (softmax top-k on the logits, the chosen k
renormalised: jaxtrain's softmax router with moe_norm_topk_prob), alternating sliding-window and
full attention (layer_types; HF's default puts the window on even layers, jaxtrain's
sliding_window_pattern=2 likewise makes layer i global iff (i + 1) % 2 == 0), attention sinks,
biases on q/k/v/o (attention_bias), on the router and on the experts, the clamped SwiGLU, one
(YaRN) rope for every layer.

Weight layout (layer i; HF's experts are fused per layer, gate and up interleaved on the last axis):

    HF (model.layers.i.)                          jaxtrain (blocks.)
    self_attn.{q,k,v,o}_proj.weight               attn.wq / wk / wv / wo   (as Llama's)
    self_attn.q_proj.bias       [N*H]             attn.bq                  [L, N, H]
    self_attn.k_proj.bias       [K*H]             attn.bk                  [L, K, H]  (v_proj: bv)
    self_attn.o_proj.bias       [D]               attn.bo                  [L, D]
    self_attn.sinks             [N]               attn.sinks               [L, N]
    mlp.router.weight           [E, D]            mlp.router               [L, D, E]
    mlp.router.bias             [E]               mlp.router_b             [L, E]
    mlp.experts.gate_up_proj    [E, D, 2F]        mlp.w_gate = [..., ::2]  [L, E, D, F]  (w_up = [..., 1::2])
    mlp.experts.gate_up_proj_bias [E, 2F]         mlp.b_gate = [:, ::2]    [L, E, F]     (b_up = [:, 1::2])
    mlp.experts.down_proj       [E, F, D]         mlp.w_down               [L, E, F, D]  (no transpose)
    mlp.experts.down_proj_bias  [E, D]            mlp.b_down               [L, E, D]
    input_layernorm / post_attention_layernorm    attn_norm / mlp_norm     (as Llama's)

The streaming import reads the expert tensors one expert (one HF row) at a time (`ROWS`): the
de-interleaving slices the last axis, so it applies to any block of experts.

The published checkpoints store the experts in MXFP4 (quantization_config quant_method mxfp4,
`*_blocks` / `*_scales` tensors): refused with the way to dequantize them first (`_refuse_quantized`).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import numpy as np

from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.hf import common

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
_THETA = 150_000.0  # transformers' GptOssConfig.default_theta
_KINDS = ("sliding_attention", "full_attention")

# ----------------------------------------------------------------------------- config mapping


def _refuse_quantized(hf: dict) -> None:
    q = hf.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "mxfp4":
        raise ConfigError("config.json field 'quantization_config' (quant_method mxfp4: the experts as *_blocks/"
                          "*_scales) cannot be imported; dequantize first: AutoModelForCausalLM.from_pretrained(SRC, "
                          "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(DST)")
    raise ConfigError(f"config.json field 'quantization_config' (quant_method {method!r}) is set: quantized "
                      "checkpoints cannot be imported")


def yarn_from_hf(params: dict, hf: dict, where: str) -> dict:
    """The model keys of a `rope_type: yarn` mapping (transformers' `_compute_yarn_parameters`:
    factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, mscale, mscale_all_dim;
    an explicit attention_factor is refused, jaxtrain derives it)."""
    if params.get("attention_factor") is not None:
        raise ConfigError(f"config.json field '{where}.attention_factor'={params['attention_factor']!r} is not "
                          "supported (jaxtrain derives YaRN's attention factor from factor and mscale)")
    original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    original = common._int_field({"original_max_position_embeddings": original}, "original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:  # transformers: the ratio of the two lengths
        factor = common._int_field(hf, "max_position_embeddings") / original
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"config.json field '{where}.truncate'={truncate!r} must be true or false")
    out = {"rope_scaling": "yarn", "rope_scaling_factor": common._float_field(hf, f"{where}.factor", factor),
           "rope_original_max_len": original, "rope_yarn_truncate": truncate,
           # transformers: `or 32` / `or 1`: a null or 0 is the default
           "rope_yarn_beta_fast": common._float_field(hf, f"{where}.beta_fast", params.get("beta_fast") or 32.0),
           "rope_yarn_beta_slow": common._float_field(hf, f"{where}.beta_slow", params.get("beta_slow") or 1.0)}
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key):
            out[f"rope_yarn_{key}"] = common._float_field(hf, f"{where}.{key}", params[key])
    return out


def _rope_from_hf(hf: dict) -> dict:
    """gpt-oss's one rope (every layer): default or yarn, rope_theta 150000 unless given."""
    params, where = common.rope_params(hf)
    theta = common._float_field(hf, f"{where}.rope_theta", params.get("rope_theta", hf.get("rope_theta", _THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        raise ConfigError("config.json field 'partial_rotary_factor' is not supported (jaxtrain rotates the whole head)")
    if rope_type == "default":
        return {"rope_theta": theta, "rope_scaling": "none"}
    if rope_type == "yarn":
        return {"rope_theta": theta, **yarn_from_hf(params, hf, where)}
    # linear / llama3 would scale the local layers too (one rope in HF); jaxtrain's local layers keep theta.
    raise ConfigError(f"config.json field '{where}.rope_type'={rope_type!r} is not supported (gpt-oss: 'yarn' or "
                      "'default')")


def _windows_from_hf(hf: dict, num_layers: int) -> dict:
    """model.sliding_window / _pattern from `layer_types` (default: sliding on even layers, as
    transformers' GptOssConfig) and `sliding_window`."""
    kinds = hf.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - set(_KINDS):
        raise ConfigError(f"config.json field 'layer_types'={kinds!r} is not supported (one of full_attention, "
                          f"sliding_attention per layer, {num_layers} layers)")
    local = [k == "sliding_attention" for k in kinds]
    if not any(local):
        return {"sliding_window": 0, "sliding_window_pattern": 0}
    window = common._int_field(hf, "sliding_window")
    pattern = 0
    if not all(local):
        pattern = local.index(False) + 1
        if any(local[i] != ((i + 1) % pattern != 0) for i in range(num_layers)):
            raise ConfigError(f"config.json field 'layer_types'={kinds!r} is not supported (jaxtrain's layer i is "
                              "global iff (i + 1) % model.sliding_window_pattern == 0)")
    return {"sliding_window": window, "sliding_window_pattern": pattern}


def model_section_from_hf(hf: dict) -> dict:
    """The jaxtrain `model` section of a GptOssForCausalLM config.json (architecture already checked).

    Raises:
      ConfigError: a field jaxtrain cannot represent, named (quantization_config (MXFP4: with how to
        dequantize), attention_dropout, rope type, layer_types, num_experts_per_tok=1, ...).
    """
    _refuse_quantized(hf)
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise ConfigError(f"config.json field 'attention_dropout'={hf['attention_dropout']!r} is not supported "
                          "(jaxtrain has no dropout; set it to 0.0)")
    d_model = common._int_field(hf, "hidden_size")
    heads = common._int_field(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or d_model // heads
    layers = common._int_field(hf, "num_hidden_layers")
    k = common._int_field(hf, "num_experts_per_tok", hf.get("experts_per_token"))
    if k == 1:
        raise ConfigError("config.json field 'num_experts_per_tok'=1 is not supported: gpt-oss renormalises a single "
                          "gate to 1, jaxtrain's top-1 keeps the probability (Switch)")
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    section = {
        "vocab_size": common._int_field(hf, "vocab_size"),
        "d_model": d_model, "num_layers": layers, "num_heads": heads,
        "num_kv_heads": common._int_field(hf, "num_key_value_heads", heads),
        "head_dim": common._int_field({"head_dim": head_dim}, "head_dim"),
        # Every layer is MoE: mlp_dim (a dense layer's) is unused; kept equal to the experts'.
        "mlp_dim": common._int_field(hf, "intermediate_size"),
        "max_seq_len": common._int_field(hf, "max_position_embeddings", 131072),  # GptOssConfig's default
        "norm_eps": common._float_field(hf, "rms_norm_eps", hf.get("rms_norm_eps", 1e-5)),
        "tie_embeddings": common._flag(hf, "tie_word_embeddings", False),
        **_rope_from_hf(hf),
        **_windows_from_hf(hf, layers),
        "attention_sinks": True, "attention_bias": common._flag(hf, "attention_bias", True), "mlp_bias": True,
        "mlp_activation": "clamped_swiglu",
        "swiglu_limit": common._float_field(hf, "swiglu_limit", hf.get("swiglu_limit", 7.0)),
        "swiglu_alpha": common._float_field(hf, "swiglu_alpha", hf.get("swiglu_alpha", 1.702)),
        "num_experts": common._int_field({"num_local_experts": experts}, "num_local_experts"),
        "experts_per_token": k, "moe_mlp_dim": common._int_field(hf, "intermediate_size"),
        "moe_router": "softmax", "moe_norm_topk_prob": True, "capacity_factor": 0.0,
    }
    if isinstance(hf.get("initializer_range"), (int, float)) and hf["initializer_range"] > 0:
        section["init_std"] = float(hf["initializer_range"])
    section.update(common._aux_loss_from_hf(hf))
    return section


def hf_config_from_model(m: ModelConfig, dtype: str, carried: Optional[dict] = None) -> dict:
    """A GptOssForCausalLM config.json for a jaxtrain model with model.attention_sinks; what gpt-oss
    cannot represent is refused by name (ConfigError)."""
    refused = {
        "model.num_experts=0": m.num_experts <= 0, "model.first_dense_layers": m.first_dense_layers,
        "model.moe_every": m.moe_every != 1, "model.num_shared_experts": m.num_shared_experts,
        "model.moe_router": m.moe_router != "softmax", "model.moe_norm_topk_prob=false": not m.moe_norm_topk_prob,
        "model.experts_per_token=1": m.experts_per_token == 1, "model.moe_n_group": m.moe_n_group != 1,
        "model.moe_routed_scaling_factor": m.moe_routed_scaling_factor != 1.0,
        "model.mlp_bias=false": not m.mlp_bias, "model.mlp_activation": m.mlp_activation != "clamped_swiglu",
        "model.kv_lora_rank": m.mla, "model.qk_norm": m.qk_norm, "model.post_norms": m.post_norms,
        "model.norm_plus_one": m.norm_plus_one, "model.embed_scale": m.embed_scale,
        "model.query_pre_attn_scalar": m.query_pre_attn_scalar not in (0, m.head_dim),
        "model.rope_local_theta": m.rope_local_theta not in (0.0, m.rope_theta),
        "model.rope_scaling": m.rope_scaling not in ("none", "yarn"),
    }
    named = [k for k, v in refused.items() if v]
    if named:
        raise ConfigError(f"export-hf: GptOssForCausalLM (model.attention_sinks=true) cannot represent "
                          f"{', '.join(named)} (gpt-oss: biased softmax top-k > 1 experts with the clamped SwiGLU in "
                          "every layer, one default or yarn rope)")
    rope: dict = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": m.rope_scaling_factor,
                "original_max_position_embeddings": m.rope_original_max_len, "beta_fast": m.rope_yarn_beta_fast,
                "beta_slow": m.rope_yarn_beta_slow, "truncate": m.rope_yarn_truncate}
        rope.update({k: v for k, v in (("mscale", m.rope_yarn_mscale), ("mscale_all_dim", m.rope_yarn_mscale_all_dim))
                     if v})
    kinds = [_KINDS[0] if m.layer_is_local(i) else _KINDS[1] for i in range(m.num_layers)]
    out = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.moe_mlp_dim or m.mlp_dim,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope, "rope_theta": m.rope_theta,  # transformers 4.x: rope_theta and rope_scaling
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling != "none" else None,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": m.attention_bias, "attention_dropout": 0.0,
        "sliding_window": m.sliding_window or None, "layer_types": kinds,
        "num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
        "experts_per_token": m.experts_per_token,  # the published configs' second name
        "router_aux_loss_coef": m.moe_aux_loss, "output_router_logits": False,
        "swiglu_limit": m.swiglu_limit, "swiglu_alpha": m.swiglu_alpha,
        "initializer_range": m.init_std, "use_cache": True,
        "dtype": common.HF_DTYPE_NAMES[dtype], "torch_dtype": common.HF_DTYPE_NAMES[dtype],
    }
    for k in common._CARRIED_FIELDS:
        if carried and k in carried:
            out[k] = carried[k]
    return out


# ----------------------------------------------------------------------------- weight mapping

_Convert = Callable[[np.ndarray, ModelConfig], np.ndarray]
_ATTN_BIASES: dict[tuple[str, ...], tuple[str, _Convert, _Convert]] = {
    ("attn", "bq"): ("self_attn.q_proj.bias", lambda t, m: t.reshape(-1, m.head_dim), lambda a, m: a.reshape(-1)),
    ("attn", "bk"): ("self_attn.k_proj.bias", lambda t, m: t.reshape(-1, m.head_dim), lambda a, m: a.reshape(-1)),
    ("attn", "bv"): ("self_attn.v_proj.bias", lambda t, m: t.reshape(-1, m.head_dim), lambda a, m: a.reshape(-1)),
    ("attn", "bo"): ("self_attn.o_proj.bias", lambda t, m: t, lambda a, m: a),
}
# The MoE's tensors. The export of the interleaved pairs (`_PAIRS`) is `layer_tensors`'s; the
# `to_hf` here is never called for them.
_MOE: dict[tuple[str, ...], tuple[str, _Convert, _Convert]] = {
    ("mlp", "router"): ("mlp.router.weight", lambda t, m: t.T, lambda a, m: a.T),
    ("mlp", "router_b"): ("mlp.router.bias", lambda t, m: t, lambda a, m: a),
    ("mlp", "w_gate"): ("mlp.experts.gate_up_proj", lambda t, m: t[..., ::2], None),
    ("mlp", "w_up"): ("mlp.experts.gate_up_proj", lambda t, m: t[..., 1::2], None),
    ("mlp", "b_gate"): ("mlp.experts.gate_up_proj_bias", lambda t, m: t[..., ::2], None),
    ("mlp", "b_up"): ("mlp.experts.gate_up_proj_bias", lambda t, m: t[..., 1::2], None),
    ("mlp", "w_down"): ("mlp.experts.down_proj", lambda t, m: t, lambda a, m: a),
    ("mlp", "b_down"): ("mlp.experts.down_proj_bias", lambda t, m: t, lambda a, m: a),
}
_PAIRS = {"mlp.experts.gate_up_proj": (("mlp", "w_gate"), ("mlp", "w_up")),
          "mlp.experts.gate_up_proj_bias": (("mlp", "b_gate"), ("mlp", "b_up"))}
# The streaming import's row blocks (`mapping._ROWS`' form): attention as Llama's; the experts one
# HF row (one expert: axis 0 of the jaxtrain tensor) at a time; the rest (biases, sinks, norms) whole.
ROWS: dict[tuple[str, ...], tuple[int, Optional[str]]] = {
    ("attn", "wq"): (1, "head_dim"), ("attn", "wk"): (1, "head_dim"), ("attn", "wv"): (1, "head_dim"),
    ("attn", "wo"): (2, None), ("mlp", "router"): (1, None), ("mlp", "w_gate"): (0, None),
    ("mlp", "w_up"): (0, None), ("mlp", "w_down"): (0, None), ("embed",): (0, None), ("head",): (1, None),
}


def layer_entries(m: ModelConfig) -> dict[tuple[str, ...], tuple[str, _Convert, Optional[_Convert]]]:
    """Every tensor of a gpt-oss layer as `common._LAYER`-style entries (path -> (HF name under
    model.layers.i., HF -> jaxtrain, back)), in transformers' order: attention (+ biases, sinks),
    router, experts, the two norms."""
    entries: dict = {}
    for key, value in common._LAYER.items():
        if key[0] == "mlp" or key[0].endswith("_norm"):
            continue
        entries[key] = value
    if m.attention_bias:
        entries.update(_ATTN_BIASES)
    entries[("attn", "sinks")] = ("self_attn.sinks", lambda t, m: t, lambda a, m: a)
    entries.update(_MOE)
    entries[("attn_norm", "scale")] = common._LAYER[("attn_norm", "scale")]
    entries[("mlp_norm", "scale")] = common._LAYER[("mlp_norm", "scale")]
    return entries


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a GptOssForCausalLM checkpoint of this shape, with its shape."""
    D, N, K, H, V, E = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size, m.num_experts
    F = m.moe_mlp_dim or m.mlp_dim
    of = {"self_attn.q_proj.weight": (N * H, D), "self_attn.k_proj.weight": (K * H, D),
          "self_attn.v_proj.weight": (K * H, D), "self_attn.o_proj.weight": (D, N * H),
          "self_attn.q_proj.bias": (N * H,), "self_attn.k_proj.bias": (K * H,), "self_attn.v_proj.bias": (K * H,),
          "self_attn.o_proj.bias": (D,), "self_attn.sinks": (N,), "mlp.router.weight": (E, D), "mlp.router.bias": (E,),
          "mlp.experts.gate_up_proj": (E, D, 2 * F), "mlp.experts.gate_up_proj_bias": (E, 2 * F),
          "mlp.experts.down_proj": (E, F, D), "mlp.experts.down_proj_bias": (E, D),
          "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(m.num_layers):
        for suffix, _, _ in layer_entries(m).values():
            shapes[f"model.layers.{i}.{suffix}"] = of[suffix]
    shapes["model.norm.weight"] = (D,)
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def _interleave(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """[..., F] and [..., F] -> [..., 2F] with first at the even and second at the odd places."""
    out = np.empty((*first.shape[:-1], 2 * first.shape[-1]), np.float32)
    out[..., ::2], out[..., 1::2] = first, second
    return out


def layer_tensors(arrays: dict[tuple[str, ...], np.ndarray], m: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name under model.layers.i., fp32 tensor) of one layer from its jaxtrain leaves (`arrays`:
    path -> that layer's array), in `layer_entries`' order; gate and up interleaved back."""
    done = set()
    for key, (suffix, _, to_hf) in layer_entries(m).items():
        if suffix in done:
            continue
        done.add(suffix)
        if suffix in _PAIRS:
            gate, up = _PAIRS[suffix]
            yield suffix, _interleave(arrays[gate], arrays[up])
        else:
            yield suffix, to_hf(arrays[key], m)
