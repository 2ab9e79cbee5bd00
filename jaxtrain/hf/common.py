"""What every Hugging Face family's mapping shares (jaxtrain/hf/mapping.py and the family modules
gpt_oss.py, deepseek_v3.py, which mapping dispatches to): config.json field readers, the dtype names,
the carried token-id fields, and Llama's layer layout that the other families start from."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from jaxtrain.config import ConfigError, ModelConfig

HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Token ids and similar fields that mean nothing to jaxtrain's model but that export carries back.
_CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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


def rope_params(hf: dict) -> tuple[dict, str]:
    """(the rope settings, the field they came from) in either config layout: transformers 5's
    `rope_parameters`, or 4.x's `rope_scaling` (with `rope_theta` at the top level)."""
    params, where = hf.get("rope_parameters"), "rope_parameters"
    if params is None:
        params, where = hf.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"config.json field '{where}' must be a mapping, got {params!r}")
    return dict(params or {}), where


def _flag(hf: dict, name: str, default: bool) -> bool:
    value = hf.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config.json field '{name}'={value!r} must be true or false")
    return value


def _aux_loss_from_hf(hf: dict) -> dict:
    """`router_aux_loss_coef` -> model.moe_aux_loss, as it is (transformers applies it once to the
    balance of all layers' tokens together; jaxtrain to each MoE layer's, summed)."""
    coef = hf.get("router_aux_loss_coef")
    if isinstance(coef, (int, float)) and not isinstance(coef, bool) and coef >= 0:
        return {"moe_aux_loss": float(coef)}
    return {}


# jaxtrain path under `blocks` -> (HF name under `model.layers.{i}.`, HF [out, in] -> jaxtrain, back).
# `m` is the ModelConfig; the reshapes split/join the head dimension of the [out, in] matrices.
# A conversion takes a block of whole rows (heads, for q/k/v) as well as the whole tensor (`_ROWS`).
_Convert = Callable[[np.ndarray, ModelConfig], np.ndarray]
_LAYER: dict[tuple[str, ...], tuple[str, _Convert, _Convert]] = {
    ("attn", "wq"): ("self_attn.q_proj.weight",
                     lambda t, m: t.reshape(-1, m.head_dim, m.d_model).transpose(2, 0, 1),
                     lambda a, m: a.transpose(1, 2, 0).reshape(m.num_heads * m.head_dim, m.d_model)),
    ("attn", "wk"): ("self_attn.k_proj.weight",
                     lambda t, m: t.reshape(-1, m.head_dim, m.d_model).transpose(2, 0, 1),
                     lambda a, m: a.transpose(1, 2, 0).reshape(m.num_kv_heads * m.head_dim, m.d_model)),
    ("attn", "wv"): ("self_attn.v_proj.weight",
                     lambda t, m: t.reshape(-1, m.head_dim, m.d_model).transpose(2, 0, 1),
                     lambda a, m: a.transpose(1, 2, 0).reshape(m.num_kv_heads * m.head_dim, m.d_model)),
    ("attn", "wo"): ("self_attn.o_proj.weight",
                     lambda t, m: t.reshape(-1, m.num_heads, m.head_dim).transpose(1, 2, 0),
                     lambda a, m: a.transpose(2, 0, 1).reshape(m.d_model, m.num_heads * m.head_dim)),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", lambda t, m: t.T, lambda a, m: a.T),
    ("mlp", "w_up"): ("mlp.up_proj.weight", lambda t, m: t.T, lambda a, m: a.T),
    ("mlp", "w_down"): ("mlp.down_proj.weight", lambda t, m: t.T, lambda a, m: a.T),
    ("attn_norm", "scale"): ("input_layernorm.weight", lambda t, m: t, lambda a, m: a),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", lambda t, m: t, lambda a, m: a),
}
