"""Hugging Face Llama <-> jaxtrain: config fields and weight layout, as pure functions on dicts
and numpy arrays (no files, no JAX).

Weight layout (HF Linear weights are [out, in]; jaxtrain stacks layers on a leading axis L):

    HF (layer i)                                 jaxtrain
    model.embed_tokens.weight       [V, D]       embed                    [V, D]
    model.layers.i.self_attn.q_proj [N*H, D]     blocks.attn.wq           [L, D, N, H]
    model.layers.i.self_attn.k_proj [K*H, D]     blocks.attn.wk           [L, D, K, H]
    model.layers.i.self_attn.v_proj [K*H, D]     blocks.attn.wv           [L, D, K, H]
    model.layers.i.self_attn.o_proj [D, N*H]     blocks.attn.wo           [L, N, H, D]
    model.layers.i.mlp.gate_proj    [F, D]       blocks.mlp.w_gate        [L, D, F]
    model.layers.i.mlp.up_proj      [F, D]       blocks.mlp.w_up          [L, D, F]
    model.layers.i.mlp.down_proj    [D, F]       blocks.mlp.w_down        [L, F, D]
    model.layers.i.input_layernorm  [D]          blocks.attn_norm.scale   [L, D]
    model.layers.i.post_attention_layernorm [D]  blocks.mlp_norm.scale    [L, D]
    model.norm.weight               [D]          final_norm.scale         [D]
    lm_head.weight                  [V, D]       head                     [D, V]  (absent when tied)

q/k rows need no permutation: both sides rotate channel pairs (i, i + H/2) ("rotate_half").
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import numpy as np

from jaxtrain.config import ConfigError, ModelConfig

HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Token ids and similar fields that mean nothing to jaxtrain's model but that export carries back.
_CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# ----------------------------------------------------------------------------- config mapping


def _int_field(hf: dict, name: str, default: Optional[int] = None) -> int:
    value = hf.get(name, default)
    if value is None:
        raise ConfigError(f"config.json has no '{name}' (needed to build the model)")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json field '{name}'={value!r} must be a positive integer")
    return value


def _float_field(hf: dict, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.json field '{name}'={value!r} must be a number")
    return float(value)


def _rope_from_hf(hf: dict) -> dict:
    """The model keys for rotary embeddings, from either config layout.

    transformers 4.x: top-level `rope_theta` and `rope_scaling: {rope_type (or type), factor, ...}`.
    transformers 5.x: `rope_parameters: {rope_theta, rope_type, factor, ...}`.
    """
    params = hf.get("rope_parameters")
    where = "rope_parameters"
    if params is None:
        params, where = hf.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"config.json field '{where}' must be a mapping, got {params!r}")
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per-layer-type rope (not Llama)
        raise ConfigError(f"config.json field '{where}' holds one rope setting per layer type "
                          f"({', '.join(params)}); jaxtrain's Llama uses one rope for all layers")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    out: dict = {"rope_theta": _float_field(hf, f"{where}.rope_theta", theta)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"config.json field 'partial_rotary_factor'={partial!r} is not supported "
                          "(jaxtrain rotates the whole head)")
    if rope_type == "default":
        out["rope_scaling"] = "none"
    elif rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
        if missing:
            raise ConfigError(f"config.json field '{where}' (rope_type llama3) lacks {', '.join(missing)}")
        # transformers falls back to max_position_embeddings when the original length is absent.
        original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        out.update(rope_scaling="llama3",
                   rope_scaling_factor=_float_field(hf, f"{where}.factor", params["factor"]),
                   rope_low_freq_factor=_float_field(hf, f"{where}.low_freq_factor", params["low_freq_factor"]),
                   rope_high_freq_factor=_float_field(hf, f"{where}.high_freq_factor", params["high_freq_factor"]),
                   rope_original_max_len=_int_field({"original_max_position_embeddings": original},
                                                    "original_max_position_embeddings"))
    else:
        raise ConfigError(f"config.json field '{where}.rope_type'={rope_type!r} is not supported "
                          "(jaxtrain implements 'default' and 'llama3')")
    return out


def model_section_from_hf(hf: dict) -> dict:
    """The jaxtrain `model` section for a Hugging Face Llama `config.json`.

    Args:
      hf: the parsed config.json (transformers 4.x or 5.x layout).
    Returns:
      A dict of `model.*` keys (vocab_size, d_model, ..., rope_*, tie_embeddings).
    Raises:
      ConfigError: a field the jaxtrain model cannot represent, named (model_type, hidden_act,
        attention_bias, mlp_bias, attention_dropout, rope type, quantization, ...).
    """
    mixtral = hf.get("model_type") == "mixtral"
    if hf.get("model_type") not in ("llama", "mixtral"):
        raise ConfigError(f"config.json field 'model_type'={hf.get('model_type')!r} is not supported "
                          "(only 'llama' and 'mixtral' checkpoints can be imported)")
    arch = "MixtralForCausalLM" if mixtral else "LlamaForCausalLM"
    archs = hf.get("architectures") or [arch]
    if list(archs) != [arch]:
        raise ConfigError(f"config.json field 'architectures'={archs!r} is not supported (model_type "
                          f"{hf.get('model_type')!r}: only {arch})")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"config.json field 'hidden_act'={hf.get('hidden_act')!r} is not supported "
                          "(jaxtrain's MLP is SwiGLU: silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"config.json field '{flag}'=true is not supported (jaxtrain's layers have no biases)")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise ConfigError(f"config.json field 'attention_dropout'={hf['attention_dropout']!r} is not supported "
                          "(jaxtrain has no dropout; set it to 0.0)")
    if hf.get("quantization_config"):
        raise ConfigError("config.json field 'quantization_config' is set: quantized checkpoints cannot be imported")
    d_model = _int_field(hf, "hidden_size")
    heads = _int_field(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if d_model % heads:
            raise ConfigError(f"config.json has no 'head_dim' and hidden_size={d_model} is not a multiple of "
                              f"num_attention_heads={heads}")
        head_dim = d_model // heads
    section = {
        "vocab_size": _int_field(hf, "vocab_size"),
        "d_model": d_model,
        "num_layers": _int_field(hf, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": _int_field(hf, "num_key_value_heads", heads),
        "head_dim": _int_field({"head_dim": head_dim}, "head_dim"),
        "mlp_dim": _int_field(hf, "intermediate_size"),
        "max_seq_len": _int_field(hf, "max_position_embeddings", 2048),  # transformers' default
        "norm_eps": _float_field(hf, "rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),  # transformers' default
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **_rope_from_hf(hf),
    }
    if isinstance(hf.get("initializer_range"), (int, float)) and hf["initializer_range"] > 0:
        section["init_std"] = float(hf["initializer_range"])
    if mixtral:
        section.update(_moe_from_hf(hf, section["mlp_dim"]))
    return section


def _moe_from_hf(hf: dict, mlp_dim: int) -> dict:
    """The MoE keys of a Mixtral config.json (softmax top-k, renormalised over the k)."""
    if hf.get("sliding_window") is not None:
        raise ConfigError(f"config.json field 'sliding_window'={hf['sliding_window']!r} is not supported "
                          "(jaxtrain's attention is full causal; null)")
    if hf.get("router_jitter_noise") not in (None, 0, 0.0):
        raise ConfigError(f"config.json field 'router_jitter_noise'={hf['router_jitter_noise']!r} is not "
                          "supported (jaxtrain's router has no jitter; 0.0)")
    k = _int_field(hf, "num_experts_per_tok")
    if k == 1:
        raise ConfigError("config.json field 'num_experts_per_tok'=1 is not supported: Mixtral renormalises a "
                          "single gate to 1, jaxtrain's top-1 keeps the probability (Switch)")
    out = {"num_experts": _int_field(hf, "num_local_experts"), "experts_per_token": k,
           "moe_mlp_dim": mlp_dim, "moe_router": "softmax", "capacity_factor": 0.0}
    coef = hf.get("router_aux_loss_coef")
    if isinstance(coef, (int, float)) and not isinstance(coef, bool) and coef >= 0:
        out["moe_aux_loss"] = float(coef)
    return out


def hf_config_from_model(m: ModelConfig, dtype: str, carried: Optional[dict] = None) -> dict:
    """A transformers `config.json` for a jaxtrain model.

    Rope settings are written in both layouts: `rope_parameters` (transformers 5) and top-level
    `rope_theta` / `rope_scaling` (transformers 4.x reads only those and would otherwise fall back
    to theta 10000 without a word).

    Args:
      m: the model section.
      dtype: 'fp32', 'bf16' or 'fp16': the dtype of the written tensors.
      carried: source fields to keep (bos/eos/pad token ids), from the imported config.json.
    """
    rope: dict = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": m.rope_theta, "factor": m.rope_scaling_factor,
                "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                "original_max_position_embeddings": m.rope_original_max_len}
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.mlp_dim,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope, "rope_theta": m.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling == "llama3" else None,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": m.init_std, "use_cache": True,
        "dtype": HF_DTYPE_NAMES[dtype], "torch_dtype": HF_DTYPE_NAMES[dtype],
    }
    if m.num_experts > 0:
        refused = {"model.moe_router": m.moe_router != "softmax", "model.num_shared_experts": m.num_shared_experts,
                   "model.first_dense_layers": m.first_dense_layers, "model.moe_every": m.moe_every != 1,
                   "model.experts_per_token=1": m.experts_per_token == 1}
        named = [k for k, v in refused.items() if v]
        if named:
            raise ConfigError(f"export-hf: MixtralForCausalLM cannot represent {', '.join(named)} "
                              "(softmax top-k > 1 routed experts in every layer, no shared experts)")
        out.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "intermediate_size": m.moe_mlp_dim or m.mlp_dim, "num_local_experts": m.num_experts,
                    "num_experts_per_tok": m.experts_per_token, "router_aux_loss_coef": m.moe_aux_loss,
                    "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False})
        out.pop("mlp_bias")
    for k in _CARRIED_FIELDS:
        if carried and k in carried:
            out[k] = carried[k]
    return out


# ----------------------------------------------------------------------------- weight mapping

# jaxtrain path under `blocks` -> (HF name under `model.layers.{i}.`, HF [out, in] -> jaxtrain, back).
# `m` is the ModelConfig; the reshapes split/join the head dimension of the [out, in] matrices.
_Convert = Callable[[np.ndarray, ModelConfig], np.ndarray]
_LAYER: dict[tuple[str, str], tuple[str, _Convert, _Convert]] = {
    ("attn", "wq"): ("self_attn.q_proj.weight",
                     lambda t, m: t.reshape(m.num_heads, m.head_dim, m.d_model).transpose(2, 0, 1),
                     lambda a, m: a.transpose(1, 2, 0).reshape(m.num_heads * m.head_dim, m.d_model)),
    ("attn", "wk"): ("self_attn.k_proj.weight",
                     lambda t, m: t.reshape(m.num_kv_heads, m.head_dim, m.d_model).transpose(2, 0, 1),
                     lambda a, m: a.transpose(1, 2, 0).reshape(m.num_kv_heads * m.head_dim, m.d_model)),
    ("attn", "wv"): ("self_attn.v_proj.weight",
                     lambda t, m: t.reshape(m.num_kv_heads, m.head_dim, m.d_model).transpose(2, 0, 1),
                     lambda a, m: a.transpose(1, 2, 0).reshape(m.num_kv_heads * m.head_dim, m.d_model)),
    ("attn", "wo"): ("self_attn.o_proj.weight",
                     lambda t, m: t.reshape(m.d_model, m.num_heads, m.head_dim).transpose(1, 2, 0),
                     lambda a, m: a.transpose(2, 0, 1).reshape(m.d_model, m.num_heads * m.head_dim)),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", lambda t, m: t.T, lambda a, m: a.T),
    ("mlp", "w_up"): ("mlp.up_proj.weight", lambda t, m: t.T, lambda a, m: a.T),
    ("mlp", "w_down"): ("mlp.down_proj.weight", lambda t, m: t.T, lambda a, m: a.T),
    ("attn_norm", "scale"): ("input_layernorm.weight", lambda t, m: t, lambda a, m: a),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", lambda t, m: t, lambda a, m: a),
}
# Top-level parameters: jaxtrain key -> (HF name, HF -> jaxtrain, back).
_TOP: dict[str, tuple[str, _Convert, _Convert]] = {
    "embed": ("model.embed_tokens.weight", lambda t, m: t, lambda a, m: a),
    "final_norm": ("model.norm.weight", lambda t, m: t, lambda a, m: a),
    "head": ("lm_head.weight", lambda t, m: t.T, lambda a, m: a.T),
}


MOE = "block_sparse_moe"  # Mixtral's module name in its checkpoint files (transformers 4 and 5 alike)
_EXPERTS = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}  # jaxtrain [E, D, F] / [E, F, D] <- HF [out, in] per expert


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a LlamaForCausalLM checkpoint of this shape holds, with its shape, in
    transformers' order (embedding, layers, final norm, head)."""
    D, N, K, H, F, V = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
    per_layer = {"self_attn.q_proj.weight": (N * H, D), "self_attn.k_proj.weight": (K * H, D),
                 "self_attn.v_proj.weight": (K * H, D), "self_attn.o_proj.weight": (D, N * H),
                 "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F),
                 "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
    if m.num_experts > 0:  # Mixtral's files: block_sparse_moe.gate [E, D], experts.j.w1/w3 [F, D], w2 [D, F]
        Fe = m.moe_mlp_dim or F
        mlp = {k: per_layer.pop(k) for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
        del mlp
        norms = {k: per_layer.pop(k) for k in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        per_layer[f"{MOE}.gate.weight"] = (m.num_experts, D)
        for e in range(m.num_experts):
            per_layer.update({f"{MOE}.experts.{e}.w1.weight": (Fe, D), f"{MOE}.experts.{e}.w2.weight": (D, Fe),
                              f"{MOE}.experts.{e}.w3.weight": (Fe, D)})
        per_layer.update(norms)
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(m.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    shapes["model.norm.weight"] = (D,)
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def params_from_hf(get: Callable[[str], np.ndarray], m: ModelConfig) -> dict:
    """jaxtrain's parameter tree (fp32 numpy, `nnx.to_pure_dict` layout) from HF tensors.

    Args:
      get: returns the HF tensor of a name (any float dtype; upcast to fp32 here, exactly).
      m: the model section the tensors belong to.
    """
    def top(key: str) -> np.ndarray:
        name, from_hf, _ = _TOP[key]
        return np.ascontiguousarray(from_hf(get(name).astype(np.float32), m))

    blocks: dict = {}
    moe = m.num_experts > 0
    for (module, leaf), (suffix, from_hf, _) in _LAYER.items():
        if moe and module == "mlp":
            continue
        first = from_hf(get(f"model.layers.0.{suffix}").astype(np.float32), m)
        # Filled layer by layer: the peak is the fp32 model plus one source tensor, not twice the model.
        stacked = np.empty((m.num_layers, *first.shape), np.float32)
        stacked[0] = first
        for i in range(1, m.num_layers):
            stacked[i] = from_hf(get(f"model.layers.{i}.{suffix}").astype(np.float32), m)
        blocks.setdefault(module, {})[leaf] = stacked
    if moe:
        L, E = m.num_layers, m.num_experts
        mlp = blocks.setdefault("mlp", {})
        mlp["router"] = np.stack([get(f"model.layers.{i}.{MOE}.gate.weight").astype(np.float32).T for i in range(L)])
        for leaf, w in _EXPERTS.items():
            mlp[leaf] = np.stack([np.stack([get(f"model.layers.{i}.{MOE}.experts.{e}.{w}.weight").astype(np.float32).T
                                            for e in range(E)]) for i in range(L)])
        mlp.update({k: np.ascontiguousarray(v) for k, v in mlp.items()})
    params = {"blocks": blocks, "embed": top("embed"), "final_norm": {"scale": top("final_norm")}}
    if not m.tie_embeddings:
        params["head"] = top("head")
    return params


def hf_tensors_from_params(params: dict, m: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, fp32 [out, in] tensor) pairs for jaxtrain parameters, in transformers' order."""
    def host(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    yield "model.embed_tokens.weight", host(params["embed"])
    moe = m.num_experts > 0
    layer = {key: v for key, v in _LAYER.items() if not (moe and key[0] == "mlp")}
    blocks = {key: host(params["blocks"][key[0]][key[1]]) for key in layer}
    experts = {leaf: host(params["blocks"]["mlp"][leaf]) for leaf in (("router", *_EXPERTS) if moe else ())}
    for i in range(m.num_layers):
        for key, (suffix, _, to_hf) in layer.items():
            if moe and key == ("attn_norm", "scale"):  # Mixtral's order: attention, router, experts, norms
                yield f"model.layers.{i}.{MOE}.gate.weight", np.ascontiguousarray(experts["router"][i].T)
                for e in range(m.num_experts):
                    for leaf, w in sorted(_EXPERTS.items(), key=lambda kv: kv[1]):
                        yield (f"model.layers.{i}.{MOE}.experts.{e}.{w}.weight",
                               np.ascontiguousarray(experts[leaf][i, e].T))
            yield f"model.layers.{i}.{suffix}", np.ascontiguousarray(to_hf(blocks[key][i], m))
    yield "model.norm.weight", host(params["final_norm"]["scale"])
    if not m.tie_embeddings:
        yield "lm_head.weight", np.ascontiguousarray(host(params["head"]).T)
