"""Hugging Face Llama, Mixtral, Qwen3, Qwen3-MoE and Gemma 3 (text) <-> jaxtrain: config fields and weight layout,
as pure functions on dicts and numpy arrays (no files, no JAX).

Which family a jaxtrain model is written as (`hf_model_type`): dense -> Llama, or Qwen3 with
`model.qk_norm`; a mixture of experts -> Mixtral, or Qwen3-MoE with `model.qk_norm`; Gemma 3
(Gemma3ForCausalLM) with `model.post_norms`.

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
    Qwen3 and Qwen3-MoE also:
    model.layers.i.self_attn.q_norm [H]          blocks.attn.q_norm.scale [L, H]
    model.layers.i.self_attn.k_norm [H]          blocks.attn.k_norm.scale [L, H]
    Gemma 3 (norm weights w of (1 + w), stored as they are) instead of Llama's post_attention_layernorm:
    model.layers.i.post_attention_layernorm [D]  blocks.post_attn_norm.scale [L, D]
    model.layers.i.pre_feedforward_layernorm [D] blocks.mlp_norm.scale    [L, D]
    model.layers.i.post_feedforward_layernorm [D] blocks.post_mlp_norm.scale [L, D]
    MoE layers (Mixtral's files: block_sparse_moe.gate, experts.j.w1/w3/w2; Qwen3-MoE's: mlp.gate,
    mlp.experts.j.gate_proj/up_proj/down_proj):
    ...gate.weight                  [E, D]       blocks.mlp.router        [L, D, E]
    ...experts.j.{w1,gate_proj}     [F, D]       blocks.mlp.w_gate        [L, E, D, F]  (w3/up_proj: w_up)
    ...experts.j.{w2,down_proj}     [D, F]       blocks.mlp.w_down        [L, E, F, D]

With dense layers among the MoE ones (Qwen3-MoE's decoder_sparse_step / mlp_only_layers as
model.first_dense_layers / model.moe_every) HF layer i lands in the stack `layer_slots` names:
`dense_blocks`, `interleaved_dense_blocks` or `blocks` (the MoE layers), as the model runs them.

q/k rows need no permutation: both sides rotate channel pairs (i, i + H/2) ("rotate_half").
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np

from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.hf.common import (_CARRIED_FIELDS, _LAYER, HF_DTYPE_NAMES, _aux_loss_from_hf, _Convert, _flag,
                                 _float_field, _int_field, rope_params)
from jaxtrain.hf import deepseek_v3, gpt_oss  # the families beyond Llama's layout (they build on hf.common)

# ----------------------------------------------------------------------------- config mapping



def _rope_from_hf(hf: dict) -> dict:
    """The model keys for rotary embeddings, from either config layout.

    transformers 4.x: top-level `rope_theta` and `rope_scaling: {rope_type (or type), factor, ...}`.
    transformers 5.x: `rope_parameters: {rope_theta, rope_type, factor, ...}`.
    """
    params, where = rope_params(hf)
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
    elif rope_type == "linear":  # positions / factor (transformers: every frequency / factor)
        if "factor" not in params:
            raise ConfigError(f"config.json field '{where}' (rope_type linear) lacks factor")
        out.update(rope_scaling="linear", rope_scaling_factor=_float_field(hf, f"{where}.factor", params["factor"]))
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
                          "(jaxtrain implements 'default', 'linear' and 'llama3')")
    return out


def _gemma3_rope_from_hf(hf: dict) -> dict:
    """Gemma 3's two rotary settings: `full_attention` (the global layers: rope_theta and its
    scaling) and `sliding_attention` (the local layers: rope_local_theta, no scaling), from
    transformers 5's `rope_parameters` per layer type or 4.x's rope_theta / rope_local_base_freq /
    rope_scaling."""
    params = hf.get("rope_parameters")
    if params is None:
        full = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 1_000_000.0), **(hf.get("rope_scaling") or {})}
        sliding = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    else:
        if not isinstance(params, dict) or set(params) - {"full_attention", "sliding_attention"} or not all(
                isinstance(v, dict) for v in params.values()):
            raise ConfigError(f"config.json field 'rope_parameters'={params!r} is not supported (Gemma 3: one "
                              "mapping per layer type, full_attention and sliding_attention)")
        full = {"rope_theta": 1_000_000.0, **params.get("full_attention", {})}
        sliding = {"rope_theta": 10_000.0, **params.get("sliding_attention", {})}
    out = _rope_from_hf({"rope_parameters": full, "max_position_embeddings": hf.get("max_position_embeddings")})
    if sliding.get("rope_type", sliding.get("type", "default")) != "default" or set(sliding) - {
            "rope_type", "type", "rope_theta"}:
        raise ConfigError(f"config.json field 'rope_parameters.sliding_attention'={sliding!r} is not supported "
                          "(jaxtrain's local layers use the default rope: rope_theta only)")
    out["rope_local_theta"] = _float_field(hf, "rope_parameters.sliding_attention.rope_theta", sliding["rope_theta"])
    return out


def _gemma3_from_hf(hf: dict, num_layers: int) -> dict:
    """The Gemma 3 keys (norm_plus_one, embed_scale, post_norms, GeGLU, qk_norm, the attention scale,
    the windows) of a Gemma3ForCausalLM config.json; softcapping and bidirectional attention refused."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(name) is not None:
            raise ConfigError(f"config.json field '{name}'={hf[name]!r} is not supported (jaxtrain has no tanh "
                              "softcapping; null, as Gemma 3 sets it)")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("config.json field 'use_bidirectional_attention'=true is not supported (jaxtrain's "
                          "attention is causal)")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"config.json field 'hidden_activation'={hf['hidden_activation']!r} is not supported "
                          "(jaxtrain's GeGLU is gelu with the tanh approximation: gelu_pytorch_tanh)")
    kinds = hf.get("layer_types")
    if kinds is None:  # older configs: every pattern-th layer global
        pattern = _int_field(hf, "sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if (not isinstance(kinds, list) or len(kinds) != num_layers
            or set(kinds) - {"full_attention", "sliding_attention"}):
        raise ConfigError(f"config.json field 'layer_types'={kinds!r} is not supported (one of full_attention, "
                          f"sliding_attention per layer, {num_layers} layers)")
    local = [k == "sliding_attention" for k in kinds]
    window, pattern = 0, 0
    if any(local):
        window = _int_field(hf, "sliding_window")
        if not all(local):
            pattern = local.index(False) + 1  # the first global layer is the pattern-th
            if any(local[i] != ((i + 1) % pattern != 0) for i in range(num_layers)):
                raise ConfigError(f"config.json field 'layer_types'={kinds!r} is not supported (jaxtrain's layer i is "
                                  "global iff (i + 1) % model.sliding_window_pattern == 0)")
    return {"qk_norm": True, "norm_plus_one": True, "embed_scale": True, "post_norms": True,
            "mlp_activation": "gelu_tanh", "sliding_window": window, "sliding_window_pattern": pattern,
            "query_pre_attn_scalar": _int_field(hf, "query_pre_attn_scalar", 256)}


# model_type -> the one architecture jaxtrain reads and writes for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 gpt_oss.MODEL_TYPE: gpt_oss.ARCHITECTURE, deepseek_v3.MODEL_TYPE: deepseek_v3.ARCHITECTURE}


def hf_model_type(m: ModelConfig) -> str:
    """The Hugging Face family a jaxtrain model is written as: Qwen3 (dense) or Qwen3-MoE with
    `model.qk_norm`, else Llama (dense) or Mixtral; Gemma 3 (text) with `model.post_norms`."""
    if m.attention_sinks:  # gpt-oss (jaxtrain.hf.gpt_oss)
        return gpt_oss.MODEL_TYPE
    if m.mla:  # multi-head latent attention: DeepSeek-V3 (jaxtrain.hf.deepseek_v3)
        return deepseek_v3.MODEL_TYPE
    if m.post_norms:
        return "gemma3_text"
    if m.num_experts > 0:
        return "qwen3_moe" if m.qk_norm else "mixtral"
    return "qwen3" if m.qk_norm else "llama"


def model_section_from_hf(hf: dict) -> dict:
    """The jaxtrain `model` section for a Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE `config.json`.

    Args:
      hf: the parsed config.json (transformers 4.x or 5.x layout).
    Returns:
      A dict of `model.*` keys (vocab_size, d_model, ..., rope_*, tie_embeddings).
    Raises:
      ConfigError: a field the jaxtrain model cannot represent, named (model_type, hidden_act,
        attention_bias, mlp_bias, attention_dropout, rope type, quantization, sliding windows, ...).
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"config.json field 'model_type'={model_type!r} is not supported "
                          f"(only {', '.join(repr(t) for t in ARCHITECTURES)} checkpoints can be imported)")
    arch = ARCHITECTURES[model_type]
    archs = hf.get("architectures") or [arch]
    if list(archs) != [arch]:
        raise ConfigError(f"config.json field 'architectures'={archs!r} is not supported (model_type "
                          f"{model_type!r}: only {arch})")
    if model_type == gpt_oss.MODEL_TYPE:
        return gpt_oss.model_section_from_hf(hf)
    gemma = model_type == "gemma3_text"
    if not gemma and hf.get("hidden_act", "silu") not in ("silu", "swish"):
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
    if model_type == deepseek_v3.MODEL_TYPE:
        return deepseek_v3.model_section(hf)
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
        "tie_embeddings": bool(hf.get("tie_word_embeddings", gemma)),  # transformers' defaults
        **(_gemma3_rope_from_hf(hf) if gemma else _rope_from_hf(hf)),
    }
    if isinstance(hf.get("initializer_range"), (int, float)) and hf["initializer_range"] > 0:
        section["init_std"] = float(hf["initializer_range"])
    if model_type == "mixtral":
        section.update(_moe_from_hf(hf, section["mlp_dim"]))
    if model_type in ("qwen3", "qwen3_moe"):
        _refuse_qwen3_windows(hf, section["num_layers"])
        section["qk_norm"] = True
    if model_type == "qwen3_moe":
        section.update(_qwen3_moe_from_hf(hf, section["num_layers"]))
    if gemma:
        section.update(_gemma3_from_hf(hf, section["num_layers"]))
    return section


def _refuse_qwen3_windows(hf: dict, num_layers: int) -> None:
    """Qwen3's sliding-window attention (`use_sliding_window: true`, or a `layer_types` entry other
    than full_attention) is refused: jaxtrain's attention is full causal. `sliding_window` alone is
    inert (transformers ignores it without use_sliding_window)."""
    if hf.get("use_sliding_window"):
        raise ConfigError("config.json field 'use_sliding_window'=true is not supported (jaxtrain's attention is "
                          "full causal; false)")
    kinds = hf.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or set(kinds) - {"full_attention"}):
        raise ConfigError(f"config.json field 'layer_types'={kinds!r} is not supported (jaxtrain's attention is full "
                          "causal in every layer: full_attention only)")


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
    out.update(_aux_loss_from_hf(hf))
    return out


def moe_layer_pattern(num_layers: int, moe_layers: set[int]) -> Optional[tuple[int, int]]:
    """(first_dense_layers, moe_every) that place MoE layers exactly at `moe_layers` (0-based), or
    None when no such pair does. jaxtrain's layout: `first` dense layers, then groups of
    `every - 1` dense layers and one MoE layer, so the last layer is MoE and the MoE layers are
    evenly spaced; one MoE layer alone is the last, after num_layers - 1 dense ones."""
    ordered = sorted(moe_layers)
    if not ordered or ordered[-1] != num_layers - 1:
        return None
    every = ordered[1] - ordered[0] if len(ordered) > 1 else 1
    first = num_layers - len(ordered) * every
    if first < 0 or {first + u * every + every - 1 for u in range(len(ordered))} != moe_layers:
        return None
    return first, every


def _qwen3_moe_from_hf(hf: dict, num_layers: int) -> dict:
    """The MoE keys of a Qwen3-MoE config.json: softmax top-k, renormalised or not (`norm_topk_prob`),
    MoE layers where `decoder_sparse_step` and `mlp_only_layers` put them (as transformers does:
    layer i is MoE unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0)."""
    k = _int_field(hf, "num_experts_per_tok")
    norm = _flag(hf, "norm_topk_prob", False)  # transformers' default
    if k == 1 and norm:
        raise ConfigError("config.json field 'norm_topk_prob'=true with num_experts_per_tok=1 is not supported: "
                          "it renormalises a single gate to 1, jaxtrain's top-1 keeps the probability (Switch)")
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 saves the latter
    step = _int_field(hf, "decoder_sparse_step", 1)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"config.json field 'mlp_only_layers'={dense!r} must be a list of layer indices")
    moe_layers = {i for i in range(num_layers) if i not in dense and (i + 1) % step == 0}
    pattern = moe_layer_pattern(num_layers, moe_layers)
    if pattern is None:
        raise ConfigError(f"config.json fields 'decoder_sparse_step'={step} and 'mlp_only_layers'={dense} put MoE "
                          f"layers at {sorted(moe_layers)} of {num_layers}: jaxtrain places them as "
                          "model.first_dense_layers dense layers, then one MoE layer in every model.moe_every, "
                          "ending with an MoE layer")
    out = {"num_experts": _int_field({"num_experts": experts}, "num_experts"), "experts_per_token": k,
           "moe_mlp_dim": _int_field(hf, "moe_intermediate_size"), "moe_router": "softmax",
           "moe_norm_topk_prob": norm, "capacity_factor": 0.0,
           "first_dense_layers": pattern[0], "moe_every": pattern[1]}
    out.update(_aux_loss_from_hf(hf))
    return out


def hf_config_from_model(m: ModelConfig, dtype: str, carried: Optional[dict] = None) -> dict:
    """A transformers `config.json` for a jaxtrain model, of the family `hf_model_type` names.

    Rope settings are written in both layouts: `rope_parameters` (transformers 5) and top-level
    `rope_theta` / `rope_scaling` (transformers 4.x reads only those and would otherwise fall back
    to theta 10000 without a word).

    Args:
      m: the model section.
      dtype: 'fp32', 'bf16' or 'fp16': the dtype of the written tensors.
      carried: source fields to keep (bos/eos/pad token ids), from the imported config.json.
    """
    rope: dict = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": m.rope_theta, "factor": m.rope_scaling_factor}
    if m.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": m.rope_theta, "factor": m.rope_scaling_factor,
                "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                "original_max_position_embeddings": m.rope_original_max_len}
    model_type = hf_model_type(m)
    if model_type == gpt_oss.MODEL_TYPE:
        return gpt_oss.hf_config_from_model(m, dtype, carried)
    if model_type == deepseek_v3.MODEL_TYPE:
        carried_ids = {k: carried[k] for k in _CARRIED_FIELDS if carried and k in carried}
        return {**deepseek_v3.hf_config(m, dtype), **carried_ids}
    out = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.mlp_dim,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope, "rope_theta": m.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling != "none" else None,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": m.init_std, "use_cache": True,
        "dtype": HF_DTYPE_NAMES[dtype], "torch_dtype": HF_DTYPE_NAMES[dtype],
    }
    if model_type == "gemma3_text":
        out.update(_gemma3_to_hf(m, rope))
        out.pop("hidden_act"), out.pop("mlp_bias")  # Gemma's activation key is hidden_activation
    else:
        gemma_keys = {"model.norm_plus_one": m.norm_plus_one, "model.embed_scale": m.embed_scale,
                      "model.mlp_activation=gelu_tanh": m.mlp_activation != "silu",
                      "model.query_pre_attn_scalar": m.query_pre_attn_scalar not in (0, m.head_dim),
                      "model.sliding_window": m.sliding_window > 0}
        named = [k for k, v in gemma_keys.items() if v]
        if named:
            raise ConfigError(f"export-hf: {ARCHITECTURES[model_type]} cannot represent {', '.join(named)} (Gemma 3's "
                              "keys: Gemma3ForCausalLM is written with model.post_norms=true)")
    if model_type == "mixtral":
        refused = {"model.moe_router": m.moe_router != "softmax", "model.num_shared_experts": m.num_shared_experts,
                   "model.first_dense_layers": m.first_dense_layers, "model.moe_every": m.moe_every != 1,
                   "model.experts_per_token=1": m.experts_per_token == 1,
                   "model.moe_norm_topk_prob=false": not m.moe_norm_topk_prob}
        named = [k for k, v in refused.items() if v]
        if named:
            raise ConfigError(f"export-hf: MixtralForCausalLM cannot represent {', '.join(named)} "
                              "(softmax top-k > 1 routed experts in every layer, renormalised, no shared experts)")
        out.update({"intermediate_size": m.moe_mlp_dim or m.mlp_dim, "num_local_experts": m.num_experts,
                    "num_experts_per_tok": m.experts_per_token, "router_aux_loss_coef": m.moe_aux_loss,
                    "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False})
        out.pop("mlp_bias")
    if model_type in ("qwen3", "qwen3_moe"):  # full causal attention in every layer
        out.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.num_layers})
        out.pop("mlp_bias")
    if model_type == "qwen3_moe":
        refused = {"model.moe_router": m.moe_router != "softmax", "model.num_shared_experts": m.num_shared_experts,
                   "model.experts_per_token=1 with model.moe_norm_topk_prob=true":
                       m.experts_per_token == 1 and m.moe_norm_topk_prob}
        named = [k for k, v in refused.items() if v]
        if named:
            raise ConfigError(f"export-hf: Qwen3MoeForCausalLM cannot represent {', '.join(named)} "
                              "(softmax top-k routed experts, no shared experts)")
        # The MoE layers: every moe_every-th from the start, or the dense ones listed when some come first.
        moe_layers = {i for i, (_, _, moe) in enumerate(layer_slots(m)) if moe}
        step, dense = ((m.moe_every, []) if not m.first_dense_layers else
                       (1, [i for i in range(m.num_layers) if i not in moe_layers]))
        out.update({"moe_intermediate_size": m.moe_mlp_dim or m.mlp_dim, "num_experts": m.num_experts,
                    "num_experts_per_tok": m.experts_per_token, "norm_topk_prob": m.moe_norm_topk_prob,
                    "decoder_sparse_step": step, "mlp_only_layers": dense, "router_aux_loss_coef": m.moe_aux_loss,
                    "output_router_logits": False})
    for k in _CARRIED_FIELDS:
        if carried and k in carried:
            out[k] = carried[k]
    return out


def _gemma3_to_hf(m: ModelConfig, rope: dict) -> dict:
    """The Gemma3ForCausalLM fields (replacing Llama's) of a model with model.post_norms; what
    Gemma 3 cannot represent is refused by name."""
    refused = {"model.num_experts": m.num_experts > 0, "model.norm_plus_one=false": not m.norm_plus_one,
               "model.embed_scale=false": not m.embed_scale, "model.qk_norm=false": not m.qk_norm,
               "model.mlp_activation=silu": m.mlp_activation != "gelu_tanh"}
    named = [k for k, v in refused.items() if v]
    if named:
        raise ConfigError(f"export-hf: Gemma3ForCausalLM (model.post_norms=true) cannot represent {', '.join(named)} "
                          "(Gemma 3: (1 + w) norms, scaled embeddings, QK-norm, GeGLU, dense)")
    kinds = ["sliding_attention" if m.layer_is_local(i) else "full_attention" for i in range(m.num_layers)]
    local = {"rope_type": "default", "rope_theta": m.rope_local_theta or m.rope_theta}
    return {"hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {"full_attention": rope, "sliding_attention": local},
            "rope_local_base_freq": local["rope_theta"],  # transformers 4.x's name
            "query_pre_attn_scalar": m.query_pre_attn_scalar or m.head_dim,
            "sliding_window": m.sliding_window or None, "layer_types": kinds,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False}


# ----------------------------------------------------------------------------- weight mapping

# Top-level parameters: jaxtrain key -> (HF name, HF -> jaxtrain, back).
_TOP: dict[str, tuple[str, _Convert, _Convert]] = {
    "embed": ("model.embed_tokens.weight", lambda t, m: t, lambda a, m: a),
    "final_norm": ("model.norm.weight", lambda t, m: t, lambda a, m: a),
    "head": ("lm_head.weight", lambda t, m: t.T, lambda a, m: a.T),
}
# Parameters the streaming import may build from row blocks of their HF tensor: key (a `_LAYER` /
# `_TOP` path, or an expert leaf) -> (the axis of the jaxtrain tensor, without the layer axis, that HF
# rows become, the ModelConfig field giving HF rows per step along it, or None: one row). Others are
# read whole.
_ROWS: dict[tuple[str, ...], tuple[int, Optional[str]]] = {
    ("attn", "wq"): (1, "head_dim"), ("attn", "wk"): (1, "head_dim"), ("attn", "wv"): (1, "head_dim"),
    ("attn", "wo"): (2, None), ("mlp", "w_gate"): (1, None), ("mlp", "w_up"): (1, None),
    ("mlp", "w_down"): (1, None), ("mlp", "router"): (1, None), ("embed",): (0, None), ("head",): (1, None),
}


# Qwen3's per-head norms (model.qk_norm), in transformers' order after o_proj.
_QK_NORM: dict[tuple[str, ...], tuple[str, _Convert, _Convert]] = {
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", lambda t, m: t, lambda a, m: a),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", lambda t, m: t, lambda a, m: a),
}

# Gemma 3's four norms per layer (model.post_norms): the MLP's input norm is pre_feedforward_layernorm.
_POST_NORMS: dict[tuple[str, ...], tuple[str, _Convert, _Convert]] = {
    ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", lambda t, m: t, lambda a, m: a),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", lambda t, m: t, lambda a, m: a),
    ("post_mlp_norm", "scale"): ("post_feedforward_layernorm.weight", lambda t, m: t, lambda a, m: a),
}

MOE = "block_sparse_moe"  # Mixtral's module name in its checkpoint files (transformers 4 and 5 alike)
# jaxtrain [E, D, F] / [E, F, D] <- HF [out, in] per expert: Mixtral's names, Qwen3-MoE's.
_EXPERTS = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
_QWEN3_EXPERTS = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def _moe_names(m: ModelConfig) -> tuple[str, dict[str, str]]:
    """(the MoE module's name in a layer, jaxtrain expert leaf -> the expert's tensor name)."""
    if m.mla:  # DeepSeek-V3: Qwen3-MoE's names
        return "mlp", _QWEN3_EXPERTS
    return ("mlp", _QWEN3_EXPERTS) if m.qk_norm else (MOE, _EXPERTS)


def layer_slots(m: ModelConfig) -> list[tuple[str, int, bool]]:
    """Where each HF layer i lives in jaxtrain: (stack, index in that stack, is an MoE layer), in
    the order the model runs them (`Transformer.cache_stacks`): the first dense layers, then each
    group's moe_every - 1 interleaved dense layers and its MoE layer."""
    if m.num_experts <= 0:
        return [("blocks", i, False) for i in range(m.num_layers)]
    slots = [("dense_blocks", i, False) for i in range(m.first_dense_layers)]
    per = m.moe_every - 1
    for u in range(m.num_moe_layers):
        slots += [("interleaved_dense_blocks", u * per + j, False) for j in range(per)]
        slots.append(("blocks", u, True))
    return slots


def _layer_entries(m: ModelConfig, moe: bool,
                   interleave: bool = True) -> dict[tuple[str, ...], tuple[str, _Convert, _Convert]]:
    """The `_LAYER`-style entries of one layer kind (an MoE layer's experts are handled apart), in
    transformers' order: attention (with Qwen3's q/k norms), the dense MLP, the two norms.
    gpt-oss: every tensor of the layer, router and fused experts included (`gpt_oss.layer_entries`)."""
    if hf_model_type(m) == gpt_oss.MODEL_TYPE:
        return gpt_oss.layer_entries(m)
    if m.mla:  # DeepSeek-V3 (`interleave`: the source's rope_interleave)
        return deepseek_v3.layer_entries(m, moe, _LAYER, interleave)
    entries = {}
    for key, value in _LAYER.items():
        if moe and key[0] == "mlp":
            continue
        entries[key] = value
        if key == ("attn", "wo") and m.qk_norm:
            entries.update(_QK_NORM)
    if m.post_norms:  # Gemma 3: post_attention_layernorm is the attention's output norm
        entries.update(_POST_NORMS)
    return entries


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of this model's family (`hf_model_type`) and shape holds, with
    its shape, in transformers' order (embedding, layers, final norm, head)."""
    if hf_model_type(m) == gpt_oss.MODEL_TYPE:
        return gpt_oss.hf_shapes(m)
    D, N, K, H, F, V = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
    shapes_of = {"self_attn.q_proj.weight": (N * H, D), "self_attn.k_proj.weight": (K * H, D),
                 "self_attn.v_proj.weight": (K * H, D), "self_attn.o_proj.weight": (D, N * H),
                 "self_attn.q_norm.weight": (H,), "self_attn.k_norm.weight": (H,),
                 "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F),
                 "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
                 "pre_feedforward_layernorm.weight": (D,), "post_feedforward_layernorm.weight": (D,)}
    if m.mla:
        shapes_of.update(deepseek_v3.layer_shapes(m))
    module, experts = _moe_names(m)
    Fe = m.moe_mlp_dim or F
    expert_shapes = {"w_gate": (Fe, D), "w_up": (Fe, D), "w_down": (D, Fe)}
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i, (_, _, moe) in enumerate(layer_slots(m)):
        for key, (suffix, _, _) in _layer_entries(m, moe).items():
            if moe and key == ("attn_norm", "scale"):  # the router and experts before the norms
                shapes[f"model.layers.{i}.{module}.gate.weight"] = (m.num_experts, D)
                if m.mla:  # DeepSeek-V3's routing bias (the train state's, `router_bias_plan`)
                    shapes[f"model.layers.{i}.{deepseek_v3.BIAS}"] = (m.num_experts,)
                for e in range(m.num_experts):
                    for leaf, w in sorted(experts.items(), key=lambda kv: kv[1]):
                        shapes[f"model.layers.{i}.{module}.experts.{e}.{w}.weight"] = expert_shapes[leaf]
            shapes[f"model.layers.{i}.{suffix}"] = shapes_of[suffix]
    shapes["model.norm.weight"] = (D,)
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


class Piece(NamedTuple):
    """One block of a jaxtrain parameter: where it lies in it, and the HF rows it is made of."""
    index: tuple[slice, ...]  # the block's place in the jaxtrain parameter
    name: str  # the HF tensor
    rows: tuple[int, int]  # [start, stop) of its first axis
    convert: Callable[[np.ndarray], np.ndarray]  # those rows (fp32) -> the block (reshape to `index`'s shape)


class LeafPlan(NamedTuple):
    """How one jaxtrain parameter is assembled from HF tensors, piece by piece."""
    path: tuple[str, ...]  # key path in the parameter tree, e.g. ("blocks", "attn", "wq")
    shape: tuple[int, ...]
    block: tuple[int, ...]  # every piece's shape (the last along a split axis may be shorter)
    pieces: list[Piece]


def param_plan(m: ModelConfig, piece_bytes: Optional[int] = None, interleave: bool = True) -> list[LeafPlan]:
    """Every jaxtrain parameter (fp32) of model `m` as pieces of HF tensors, in `params_from_hf`'s order.

    Args:
      m: the model section.
      piece_bytes: split the HF tensors that `_ROWS` names into row blocks of at most this many fp32
        bytes (at least one row step each); None: one piece per HF tensor (per layer, per expert).
      interleave: DeepSeek-V3's rope_interleave (its rope rows reordered; `jaxtrain.hf.deepseek_v3`).
    """
    shapes = hf_shapes(m)
    row_table = gpt_oss.ROWS if hf_model_type(m) == gpt_oss.MODEL_TYPE else _ROWS

    def split(key: tuple[str, ...], name: str, out: tuple[int, ...], lead: tuple[slice, ...],
              convert: Callable[[np.ndarray], np.ndarray]) -> tuple[tuple[int, ...], list[Piece]]:
        """(block, pieces) of HF tensor `name`, whose jaxtrain form has shape `out`, at `lead` of the stack."""
        rows = shapes[name][0]
        axis, unit_field = row_table.get(key, (0, None))
        unit = getattr(m, unit_field) if unit_field else 1
        per = rows
        if piece_bytes is not None and key in row_table:
            row_bytes = 4 * int(np.prod(shapes[name][1:], dtype=np.int64))
            per = min(rows, max(1, piece_bytes // max(1, row_bytes * unit)) * unit)
        pieces = []
        for a in range(0, rows, per):
            b = min(a + per, rows)
            index = [slice(None)] * len(out)
            if per < rows:
                index[axis] = slice(a // unit, b // unit)
            pieces.append(Piece(lead + tuple(index), name, (a, b), convert))
        block = tuple(per // unit if per < rows and i == axis else n for i, n in enumerate(out))
        return (1,) * len(lead) + block, pieces

    def stacked(path: tuple[str, ...], key: tuple[str, ...], names: list[list[str]], out: tuple[int, ...],
                convert: Callable[[np.ndarray], np.ndarray]) -> LeafPlan:
        """A parameter with leading axes over `names` (layers, or layers x experts) of HF tensors."""
        lead_shape = (len(names),) if isinstance(names[0], str) else (len(names), len(names[0]))
        pieces: list[Piece] = []
        block: tuple[int, ...] = ()
        for n, row in enumerate(names):
            for e, name in ([(None, row)] if isinstance(row, str) else enumerate(row)):
                lead = (slice(n, n + 1),) if e is None else (slice(n, n + 1), slice(e, e + 1))
                block, more = split(key, name, out, lead, convert)
                pieces += more
        return LeafPlan(path, lead_shape + out, block, pieces)

    layers_of: dict[str, list[int]] = {}  # stack -> its HF layers, in stack order
    for i, (stack, _, _) in enumerate(layer_slots(m)):
        layers_of.setdefault(stack, []).append(i)
    plans: list[LeafPlan] = []
    module, experts = _moe_names(m)
    for stack, hf_layers in layers_of.items():
        moe = stack == "blocks" and m.num_experts > 0
        entries = _layer_entries(m, moe, interleave)
        for path, (suffix, from_hf, _) in entries.items():
            names = [f"model.layers.{i}.{suffix}" for i in hf_layers]
            # Only to learn the converted shape: views of an untouched buffer take no memory.
            out_shape = from_hf(np.empty(shapes[names[0]], np.float32), m).shape
            plans.append(stacked((stack, *path), path, names, out_shape, functools.partial(from_hf, m=m)))
        if moe and ("mlp", "router") not in entries:  # else the family's entries hold the experts (gpt-oss)
            gate = [f"model.layers.{i}.{module}.gate.weight" for i in hf_layers]
            plans.append(stacked((stack, "mlp", "router"), ("mlp", "router"), gate, shapes[gate[0]][::-1], _t))
            for leaf, w in experts.items():
                names = [[f"model.layers.{i}.{module}.experts.{e}.{w}.weight" for e in range(m.num_experts)]
                         for i in hf_layers]
                plans.append(stacked((stack, "mlp", leaf), ("mlp", leaf), names, shapes[names[0][0]][::-1], _t))
    tops = ["embed", "final_norm"] + ([] if m.tie_embeddings else ["head"])
    for key in tops:
        name, from_hf, _ = _TOP[key]
        shape = shapes[name][::-1] if key == "head" else shapes[name]
        block, pieces = split((key,), name, shape, (), functools.partial(from_hf, m=m))
        plans.append(LeafPlan((key, "scale") if key == "final_norm" else (key,), shape, block, pieces))
    return plans


def _t(t: np.ndarray) -> np.ndarray:
    return t.T


def ignored_tensors(hf: dict, names: list[str]) -> list[str]:
    """The tensors of a source that import skips on purpose (DeepSeek-V3's multi-token prediction
    layers, which transformers does not run); any other tensor without a place is refused."""
    return deepseek_v3.ignored_tensors(hf, names) if hf.get("model_type") == deepseek_v3.MODEL_TYPE else []


def router_bias_plan(m: ModelConfig) -> Optional[LeafPlan]:
    """The train state's routing bias `moe.router_bias` [MoE layers, E] from the checkpoint's
    per-layer bias tensors (DeepSeek-V3's `mlp.gate.e_score_correction_bias`), one piece per layer;
    None for a family whose checkpoints hold none. Its path is under the state's `moe` entry."""
    if not (m.mla and m.num_experts):
        return None
    hf_layers = [i for i, (_, _, moe) in enumerate(layer_slots(m)) if moe]
    E = m.num_experts
    pieces = [Piece((slice(n, n + 1), slice(None)), f"model.layers.{i}.{deepseek_v3.BIAS}", (0, E), _same)
              for n, i in enumerate(hf_layers)]
    return LeafPlan(("router_bias",), (len(hf_layers), E), (1, E), pieces)


def _same(t: np.ndarray) -> np.ndarray:
    return t


def params_from_hf(get: Callable[[str], np.ndarray], m: ModelConfig, interleave: bool = True) -> dict:
    """jaxtrain's parameter tree (fp32 numpy, `nnx.to_pure_dict` layout) from HF tensors, in memory
    (the streaming import, `jaxtrain.hf.streaming`, writes the same pieces straight to a checkpoint).

    Args:
      get: returns the HF tensor of a name (any float dtype; upcast to fp32 here, exactly).
      m: the model section the tensors belong to.
    """
    params: dict = {}
    for leaf in param_plan(m, interleave=interleave):
        # Filled piece by piece: the peak is the fp32 model plus one source tensor, not twice the model.
        a = np.empty(leaf.shape, np.float32)
        for p in leaf.pieces:
            a[p.index] = p.convert(get(p.name).astype(np.float32)).reshape(a[p.index].shape)
        node = params
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        node[leaf.path[-1]] = a
    return params


def hf_tensors_from_params(params: dict, m: ModelConfig,
                           router_bias: Optional[Any] = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, fp32 [out, in] tensor) pairs for jaxtrain parameters, in transformers' order.

    `router_bias` [MoE layers, E]: the train state's `moe.router_bias`, written where the family holds
    one (DeepSeek-V3's e_score_correction_bias; zeros when None); other families have no such tensor.
    Parameters the family has no tensor for (multi-token prediction's `mtp`) are not written."""
    def host(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    yield "model.embed_tokens.weight", host(params["embed"])
    module, experts = _moe_names(m)
    model_type = hf_model_type(m)
    stacks: dict[str, dict] = {}  # stack -> {(part, leaf): [layers, ...] fp32}, converted once
    for i, (stack, j, moe) in enumerate(layer_slots(m)):
        if stack not in stacks:
            tree = params[stack]
            stacks[stack] = {path: host(functools.reduce(lambda node, k: node[k], path, tree))
                             for path in _layer_entries(m, moe)}
            if moe and ("mlp", "router") not in stacks[stack]:
                stacks[stack].update({("mlp", leaf): host(tree["mlp"][leaf]) for leaf in ("router", *experts)})
        arrays = stacks[stack]
        if model_type == gpt_oss.MODEL_TYPE:  # fused tensors: gate_up_proj joins two leaves
            for suffix, t in gpt_oss.layer_tensors({key: a[j] for key, a in arrays.items()}, m):
                yield f"model.layers.{i}.{suffix}", np.ascontiguousarray(t)
            continue
        for key, (suffix, _, to_hf) in _layer_entries(m, moe).items():
            if moe and key == ("attn_norm", "scale"):  # Mixtral's order: attention, router, experts, norms
                yield f"model.layers.{i}.{module}.gate.weight", np.ascontiguousarray(arrays[("mlp", "router")][j].T)
                if m.mla:
                    yield f"model.layers.{i}.{deepseek_v3.BIAS}", deepseek_v3.router_bias_rows(router_bias, m)[j].copy()
                for e in range(m.num_experts):
                    for leaf, w in sorted(experts.items(), key=lambda kv: kv[1]):
                        yield (f"model.layers.{i}.{module}.experts.{e}.{w}.weight",
                               np.ascontiguousarray(arrays[("mlp", leaf)][j, e].T))
            yield f"model.layers.{i}.{suffix}", np.ascontiguousarray(to_hf(arrays[key][j], m))
    yield "model.norm.weight", host(params["final_norm"]["scale"])
    if not m.tie_embeddings:
        yield "lm_head.weight", np.ascontiguousarray(host(params["head"]).T)
