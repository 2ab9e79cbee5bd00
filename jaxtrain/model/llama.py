"""Llama-style decoder in Flax NNX, in reading order: norm -> rotary -> attention -> MLP -> block -> decoder.

Shape suffixes: B batch, L length, D d_model, N q-heads, K kv-heads, H head_dim, F mlp, V vocab.

Every parameter carries logical axis names (`out_sharding` metadata); `jaxtrain.parallel.sharding` maps
them to mesh axes through the config's rules table. Activations are constrained by logical name
through the `Partitioning` each call receives (mesh, rules, pipeline schedule; the default places
nothing), never through ambient state. Layers are created stacked (leading `layers` axis) and run with
`lax.scan`, so compile time does not grow with depth; `scan_layers=False` unrolls the same
stacked parameters (used to test that both agree).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxtrain.config import ModelConfig
from jaxtrain.model.attention import attend, attend_cached, write_cache
from jaxtrain.model.mla import MLA, yarn_mscale
from jaxtrain.model.mla import matmul_params as mla_matmul_params
from jaxtrain.model import mtp
from jaxtrain.model.moe import MoE, finish_stats
from jaxtrain.model.projection import project
from jaxtrain.parallel import pipeline
from jaxtrain.parallel.experts import swiglu_product
from jaxtrain.parallel.sharding import Partitioning

# Parameters get logical names as metadata only; shardings are decided by jaxtrain.parallel.sharding.
nnx.use_eager_sharding(False)

LOGIT_STD = 0.5  # std of the initial logits (see Transformer.__init__)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std, out_sharding=names)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale; `plus_one` (model.norm_plus_one, Gemma): * (1 + scale), scale starting at 0."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(init((dim,), jnp.float32), out_sharding=("norm",))
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        x32 = x_BLD.astype(jnp.float32)  # statistics in fp32 whatever the compute dtype
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = 1.0 + self.scale[...] if self.plus_one else self.scale[...]
        return (y * scale).astype(x_BLD.dtype)


def add_bias(y: jax.Array, b: jax.Array) -> jax.Array:
    """y + b (an fp32 parameter), added in fp32 and cast back to y's dtype: the bias's gradient is
    then a sum of fp32 values before any cross-device reduction (as `project` keeps weight gradients)."""
    return (y.astype(jnp.float32) + b).astype(y.dtype)


def rotary(x_BLnH: jax.Array, positions_BL: jax.Array, theta: float,
           llama3: tuple[float, float, float, int] | None = None) -> jax.Array:
    """Rotate channel pairs (i, i + H/2) by position-dependent angles (Llama's layout).

    `llama3` = (factor, low_freq_factor, high_freq_factor, original_max_len) applies Llama 3.1's
    long-context scaling: wavelengths longer than original_max_len / low_freq_factor are
    stretched by `factor`, those shorter than original_max_len / high_freq_factor are kept, and
    the band between is interpolated (as transformers' `_compute_llama3_parameters`).
    """
    return rotate(x_BLnH, positions_BL, inv_frequencies(x_BLnH.shape[-1], theta, llama3))


def inv_frequencies(H: int, theta: float, llama3: tuple[float, float, float, int] | None = None,
                    linear: float = 1.0, yarn: tuple[float, int, float, float, bool] | None = None) -> jax.Array:
    """The rotary frequencies [H/2] of `rotary`; `linear` (rope_scaling=linear) divides them by the
    factor, as transformers' `_compute_linear_scaling_rope_parameters` (positions / factor);
    `yarn` (`yarn_parameters`) interpolates them as `yarn_frequencies`."""
    if yarn is not None:
        return yarn_frequencies(H, theta, *yarn)
    # 1 / theta^(i/H), spelled as transformers does: bit-identical frequencies (theta^(-i/H) is
    # off by an ulp, which at position 1e5 is 1e-2 rad).
    inv_freq = 1.0 / theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)  # [H/2]
    if llama3 is not None:
        factor, low, high, original_len = llama3
        wavelen = 2 * jnp.pi / inv_freq
        smooth = jnp.clip((original_len / wavelen - low) / (high - low), 0.0, 1.0)  # 0 above the band, 1 below
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq / linear if linear != 1.0 else inv_freq


def yarn_parameters(cfg: ModelConfig) -> tuple[float, int, float, float, bool] | None:
    """`inv_frequencies`' `yarn` argument for model.rope_scaling=yarn: (factor, original_max_len,
    beta_fast, beta_slow, truncate); None for any other rope_scaling."""
    if cfg.rope_scaling != "yarn":
        return None
    return (cfg.rope_scaling_factor, cfg.rope_original_max_len, cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow,
            cfg.rope_yarn_truncate)


def yarn_frequencies(H: int, theta: float, factor: float, original_len: int, beta_fast: float, beta_slow: float,
                     truncate: bool = True) -> jax.Array:
    """YaRN's rotary frequencies [H/2] (transformers' `_compute_yarn_parameters`, bit for bit).

    Dimensions that turn fewer than beta_slow times over original_len positions are interpolated
    (frequency / factor), those turning more than beta_fast times are kept, with a linear ramp
    between (the range rounded out to whole dimensions when `truncate`; gpt-oss: not). Every step
    is spelled, and grouped, as transformers does: the correction range in Python floats, the
    rest in fp32; the frequencies depend on the config only, so they are computed when traced.
    """
    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (H * math.log(original_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, H - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    # The ramp in numpy fp32: XLA turns a division by a constant into a multiplication by its
    # reciprocal, an ulp away from transformers' division.
    ramp = np.clip((np.arange(H // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = 1 - ramp  # 1: the frequency as it is (fast dims), 0: interpolated (slow dims)
    # Op by op, also inside a jit: the traced form is constant-folded by XLA, which rounds
    # differently. (XLA's pow and torch's vectorised pow round a few values differently for some
    # theta, e.g. gpt-oss's 150000: those frequencies differ from transformers' by an ulp.)
    with jax.ensure_compile_time_eval():
        pos_freqs = theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        return interpolation * (1 - keep) + extrapolation * keep


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' `attention_factor`): with DeepSeek's
    rope_yarn_mscale and _mscale_all_dim both set, mscale(factor, mscale) / mscale(factor,
    mscale_all_dim), else mscale(factor) = 0.1 ln(factor) + 1. 1.0 for any other rope_scaling."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    factor, mscale, mscale_all_dim = cfg.rope_scaling_factor, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def global_rotary(cfg: ModelConfig, x_BLnH: jax.Array, positions_BL: jax.Array) -> jax.Array:
    """x rotated as a global layer's Attention rotates q and k: rope_theta, rope_scaling's
    frequencies and YaRN's attention factor (multi-head latent attention's rope channels)."""
    llama3 = ((cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len)
              if cfg.rope_scaling == "llama3" else None)
    linear = cfg.rope_scaling_factor if cfg.rope_scaling == "linear" else 1.0
    inv_freq = inv_frequencies(x_BLnH.shape[-1], cfg.rope_theta, llama3, linear, yarn_parameters(cfg))
    return rotate(x_BLnH, positions_BL, inv_freq, yarn_attention_factor(cfg))


def rotate(x_BLnH: jax.Array, positions_BL: jax.Array, inv_freq: jax.Array, scale: float | jax.Array = 1.0) -> jax.Array:
    """x with channel pairs (i, i + H/2) rotated by positions * inv_freq [H/2]; cos and sin times
    `scale` (YaRN's attention factor; 1.0 leaves them, bit for bit, as they are)."""
    angle_BLh = positions_BL[..., None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angle_BLh)[:, :, None, :], jnp.cos(angle_BLh)[:, :, None, :]
    if not (isinstance(scale, float) and scale == 1.0):
        sin, cos = sin * scale, cos * scale
    x1, x2 = jnp.split(x_BLnH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLnH.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: N query heads share K key/value heads.

    `model.qk_norm` (Qwen3): q and k are RMS-normalised over each head's H channels right after
    their projections, before rotary (q_norm(q_proj(x)), then rope), with one [H] scale each.

    Sliding windows (model.sliding_window): a local layer attends within the window with its own
    rotary base (rope_local_theta), a global one causally with rope_theta and rope_scaling. `local`
    is a Python bool (the same in every layer, or a decode step's unrolled layer), or a traced bool
    (the scanned stack with local and global layers: the kernel runs under `lax.cond`, one branch
    each, so only the chosen attention is computed).

    gpt-oss: `model.attention_bias` adds biases `bq` [N, H], `bk`, `bv` [K, H] and `bo` [D] (zeros at
    init) to the projections; `model.attention_sinks` a learned logit per query head, `sinks` [N]
    (normal(init_std) at init, as transformers), in every softmax's denominator.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        # Output projection scaled down with depth (GPT-2/Llama practice) to keep residuals stable.
        self.wo = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        if cfg.attention_bias:
            zeros = lambda shape, names: nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=names)
            self.bq = zeros((N, H), ("heads", "head_dim"))
            self.bk = zeros((K, H), ("kv_heads", "head_dim"))
            self.bv = zeros((K, H), ("kv_heads", "head_dim"))
            self.bo = zeros((D,), ("embed",))
        if cfg.attention_sinks:
            self.sinks = _param(rngs, (N,), ("heads",), cfg.init_std)
        self.theta, self.implementation = cfg.rope_theta, cfg.attention
        self.llama3 = ((cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                        cfg.rope_original_max_len) if cfg.rope_scaling == "llama3" else None)
        self.linear = cfg.rope_scaling_factor if cfg.rope_scaling == "linear" else 1.0
        # rope_scaling=yarn: its frequencies, and the attention factor cos and sin are multiplied by
        self.yarn, self.rope_factor = yarn_parameters(cfg), yarn_attention_factor(cfg)
        self.window = cfg.sliding_window or None
        self.local_theta = cfg.rope_local_theta or cfg.rope_theta
        # gpt-oss: with yarn and no rope_local_theta of their own, local layers rotate as global ones
        self.local_rope_is_global = cfg.rope_scaling == "yarn" and not cfg.rope_local_theta
        self.all_local = cfg.sliding_window > 0 and cfg.sliding_window_pattern == 0
        # scores q.k / sqrt(H) in the kernels; q * sqrt(H / s) makes them q.k / sqrt(s)
        s = cfg.query_pre_attn_scalar
        self.q_scale = (H / s) ** 0.5 if s and s != H else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.norm_eps, cfg.norm_plus_one)
            self.k_norm = RMSNorm(H, cfg.norm_eps, cfg.norm_plus_one)

    def _bias(self, name: str, y):
        """y + the projection's bias (model.attention_bias), else y."""
        return add_bias(y, getattr(self, name)[...]) if hasattr(self, name) else y

    def _sinks(self):
        """The sink logits [N] fp32 (model.attention_sinks), else None."""
        return self.sinks[...] if hasattr(self, "sinks") else None

    def _qk_norm(self, q_BLNH, k_BLKH):
        """q and k per-head RMS-normalised (model.qk_norm), else as they are."""
        if not hasattr(self, "q_norm"):
            return q_BLNH, k_BLKH
        return self.q_norm(q_BLNH), self.k_norm(k_BLKH)

    def _rope(self, q_BLNH, k_BLKH, positions_BL, local):
        """q and k rotated with the layer's frequencies (local or global), q scaled for
        model.query_pre_attn_scalar."""
        H = q_BLNH.shape[-1]
        inv_freq = inv_frequencies(H, self.theta, self.llama3, self.linear, self.yarn)
        scale = self.rope_factor
        if self.window is not None and local is not False and not self.local_rope_is_global:
            local_freq = inv_frequencies(H, self.local_theta)
            inv_freq = local_freq if local is True else jnp.where(local, local_freq, inv_freq)
            if scale != 1.0:  # a local layer's own rope has no YaRN factor
                scale = 1.0 if local is True else jnp.where(local, 1.0, scale)
        q_BLNH, k_BLKH = rotate(q_BLNH, positions_BL, inv_freq, scale), rotate(k_BLKH, positions_BL, inv_freq, scale)
        if self.q_scale is not None:
            q_BLNH = q_BLNH * jnp.asarray(self.q_scale, q_BLNH.dtype)
        return q_BLNH, k_BLKH

    def __call__(self, x_BLD, positions_BL, segment_ids_BL, dtype, part: Partitioning, local=None):
        local = self.all_local if local is None else local
        # Each projection's output carries a checkpoint name (see REMAT_POLICIES).
        q_BLNH = checkpoint_name(self._bias("bq", project("bld,dnh->blnh", x_BLD, self.wq[...], dtype)), "query_proj")
        k_BLKH = checkpoint_name(self._bias("bk", project("bld,dkh->blkh", x_BLD, self.wk[...], dtype)), "key_proj")
        v_BLKH = checkpoint_name(self._bias("bv", project("bld,dkh->blkh", x_BLD, self.wv[...], dtype)), "value_proj")
        q_BLNH, k_BLKH = self._rope(*self._qk_norm(q_BLNH, k_BLKH), positions_BL, local)
        q_BLNH = part.constrain(q_BLNH, ("batch", "length", "heads", "head_dim"))
        k_BLKH = part.constrain(k_BLKH, ("batch", "length", "kv_heads", "head_dim"))
        v_BLKH = part.constrain(v_BLKH, ("batch", "length", "kv_heads", "head_dim"))

        sinks_N = self._sinks()

        def run(window, q, k, v, seg):
            return attend(q, k, v, seg, self.implementation, part, window=window, sinks=sinks_N)
        if self.window is None or local is False:
            o_BLNH = run(None, q_BLNH, k_BLKH, v_BLKH, segment_ids_BL)
        elif local is True:
            o_BLNH = run(self.window, q_BLNH, k_BLKH, v_BLKH, segment_ids_BL)
        else:  # this layer's flag, traced: one kernel call per branch, only the chosen one runs
            o_BLNH = jax.lax.cond(local, functools.partial(run, self.window), functools.partial(run, None),
                                  q_BLNH, k_BLKH, v_BLKH, segment_ids_BL)
        return checkpoint_name(self._bias("bo", project("blnh,nhd->bld", o_BLNH, self.wo[...], dtype)), "out_proj")

    def decode(self, x_BLD, positions_BL, cache: dict, dtype, part: Partitioning,
               local: bool | None = None) -> tuple[jax.Array, dict]:
        """New tokens (contiguous positions per row) attend over the KV cache they are written into.

        `cache` = {"k", "v"}: [B, S, K, H], slot s = position s; a local layer (`local`, a Python
        bool here) reads only the slots inside its window. -> (out_BLD, the updated cache)."""
        local = self.all_local if local is None else local
        q_BLNH, k_BLKH = self._qk_norm(self._bias("bq", project("bld,dnh->blnh", x_BLD, self.wq[...], dtype)),
                                       self._bias("bk", project("bld,dkh->blkh", x_BLD, self.wk[...], dtype)))
        q_BLNH, k_BLKH = self._rope(q_BLNH, k_BLKH, positions_BL, local)
        v_BLKH = self._bias("bv", project("bld,dkh->blkh", x_BLD, self.wv[...], dtype))
        names = ("batch", None, "kv_heads", "head_dim")
        cache = {name: part.constrain(write_cache(cache[name], new, positions_BL[:, 0]), names)
                 for name, new in (("k", k_BLKH), ("v", v_BLKH))}
        q_BLNH = part.constrain(q_BLNH, ("batch", "length", "heads", "head_dim"))
        o_BLNH = attend_cached(q_BLNH, cache["k"], cache["v"], positions_BL, window=self.window if local else None,
                               sinks=self._sinks())
        return self._bias("bo", project("blnh,nhd->bld", o_BLNH, self.wo[...], dtype)), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU with model.mlp_activation=gelu_tanh (Gemma);
    gpt-oss's clamped SwiGLU with clamped_swiglu (`swiglu_product`). `model.mlp_bias`: biases
    `b_gate`, `b_up` [F] and `b_down` [D] (zeros at init) on the three projections."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.mlp_dim
        self.w_gate = _param(rngs, (D, F), ("embed", "mlp"), cfg.init_std)
        self.w_up = _param(rngs, (D, F), ("embed", "mlp"), cfg.init_std)
        self.w_down = _param(rngs, (F, D), ("mlp", "embed"), cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        if cfg.mlp_bias:
            self.b_gate = nnx.Param(jnp.zeros((F,), jnp.float32), out_sharding=("mlp",))
            self.b_up = nnx.Param(jnp.zeros((F,), jnp.float32), out_sharding=("mlp",))
            self.b_down = nnx.Param(jnp.zeros((D,), jnp.float32), out_sharding=("embed",))
        self.activation = cfg.mlp_activation
        self.clamp = (cfg.swiglu_limit, cfg.swiglu_alpha)

    def _bias(self, name: str, y):
        return add_bias(y, getattr(self, name)[...]) if hasattr(self, name) else y

    def __call__(self, x_BLD, dtype, part: Partitioning):
        gate_BLF = checkpoint_name(self._bias("b_gate", project("bld,df->blf", x_BLD, self.w_gate[...], dtype)),
                                   "mlpwi_0")
        up_BLF = checkpoint_name(self._bias("b_up", project("bld,df->blf", x_BLD, self.w_up[...], dtype)), "mlpwi_1")
        if self.activation == "clamped_swiglu":
            h_BLF = swiglu_product(gate_BLF, up_BLF, self.clamp)
        else:
            act = jax.nn.silu if self.activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
            h_BLF = act(gate_BLF) * up_BLF
        h_BLF = part.constrain(h_BLF, ("batch", "length", "mlp"))
        return checkpoint_name(self._bias("b_down", project("blf,fd->bld", h_BLF, self.w_down[...], dtype)), "mlpwo")


class Block(nnx.Module):
    """Attention and an MLP: dense, or (`moe`) routed experts (jaxtrain/model/moe.py). With
    model.post_norms (Gemma) each one's output is RMS-normalised again before the residual add."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        norm = lambda: RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one)
        self.attn_norm = norm()
        if cfg.mla:  # multi-head latent attention (jaxtrain/model/mla.py): llama's norm and rotary handed in
            self.attn = MLA(cfg, rngs, norm=functools.partial(RMSNorm, eps=cfg.norm_eps, plus_one=cfg.norm_plus_one),
                            rope=functools.partial(global_rotary, cfg))
        else:
            self.attn = Attention(cfg, rngs)
        self.mlp_norm = norm()
        self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, rngs)
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        self.moe = moe

    def _post(self, name: str, y_BLD):
        return getattr(self, name)(y_BLD) if hasattr(self, name) else y_BLD

    def __call__(self, x_BLD, positions_BL, segment_ids_BL, dtype, part: Partitioning, bias_E=None, local=None):
        """x_BLD -> x_BLD; an MoE block returns (x_BLD, routing statistics). `local`: Attention's."""
        # The residual stream is laid out by `act_length` (= `length` by default; with mesh.rules
        # act_length: [context, tensor] Megatron's sequence parallelism: norms and residual adds run on
        # 1/tensor of the tokens, an all-gather before each block's projections and a reduce-scatter
        # after them replacing the all-reduce).
        a_BLD = self.attn(self.attn_norm(x_BLD), positions_BL, segment_ids_BL, dtype, part, local)
        x_BLD = x_BLD + self._post("post_attn_norm", a_BLD)
        x_BLD = part.constrain(x_BLD, ("batch", "act_length", "act_embed"))
        if not self.moe:
            x_BLD = x_BLD + self._post("post_mlp_norm", self.mlp(self.mlp_norm(x_BLD), dtype, part))
            return part.constrain(x_BLD, ("batch", "act_length", "act_embed"))
        y_BLD, stats = self.mlp(self.mlp_norm(x_BLD), dtype, part, bias_E)
        return part.constrain(x_BLD + self._post("post_mlp_norm", y_BLD), ("batch", "act_length", "act_embed")), stats

    def decode(self, x_BLD, positions_BL, cache: dict, dtype, part: Partitioning, bias_E=None,
               local: bool | None = None) -> tuple[jax.Array, dict]:
        """`__call__` for new tokens over this layer's KV cache -> (x_BLD, the updated cache)."""
        a_BLD, cache = self.attn.decode(self.attn_norm(x_BLD), positions_BL, cache, dtype, part, local)
        x_BLD = x_BLD + self._post("post_attn_norm", a_BLD)
        if self.moe:
            y_BLD, _ = self.mlp(self.mlp_norm(x_BLD), dtype, part, bias_E)
        else:
            y_BLD = self.mlp(self.mlp_norm(x_BLD), dtype, part)
        return x_BLD + self._post("post_mlp_norm", y_BLD), cache


# What the backward pass keeps of a layer's forward pass, by `model.remat` (MaxText's names). The
# layer's projections carry checkpoint names (MaxText's spelling): a policy saves named tensors and
# recomputes the rest. Names, unlike `dots_with_no_batch_dims_saveable`, survive the pipeline's
# vmap over stages, under which every matmul gains a batch dimension.
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
REMAT_POLICIES: dict[str, Any] = {
    "none": None,  # no checkpoint: keep everything (under a pipeline: see remat_policy)
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only the layer's input; recompute it all
    "minimal": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),  # keep every projection's output
    "dots": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),  # the earlier name of `minimal`
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj", "value_proj"),
    "save_out_proj": jax.checkpoint_policies.save_only_these_names("out_proj"),
}


def remat_policy(name: str) -> Any:
    """The `jax.checkpoint` policy of `model.remat=name`; `none` gives `nothing_saveable`.

    `none` means "no checkpoint" where the caller decides whether to checkpoint at all (per layer
    without a pipeline); the pipeline always checkpoints its iterations (`pipeline.remat_iterations`)
    and there `none` saves nothing inside them, like `full`.
    """
    return REMAT_POLICIES[name] or jax.checkpoint_policies.nothing_saveable


class Transformer(nnx.Module):
    """Decoder-only language model. `model(tokens_BL, positions_BL, segment_ids_BL) -> logits_BLV` (fp32).

    Every call takes an optional `part` (`Partitioning`: mesh, rules, pipeline schedule); without
    it nothing is constrained and the layers run as one plain scan.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.cfg, self.dtype = cfg, dtype
        # The output projection (the head, or the tied table) starts with std LOGIT_STD/sqrt(D):
        # the final norm gives unit-RMS features, so initial logits have std LOGIT_STD and the
        # initial loss is ~ln(vocab) + LOGIT_STD**2/2, whatever d_model is. An untied input table
        # can be large (it only feeds RMSNorm); a tied one is bounded by its role as the head.
        head_std = LOGIT_STD / cfg.d_model ** 0.5
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                            head_std if cfg.tie_embeddings else 1.0)

        def make_blocks(n: int, moe: bool, stacked: str = "layers") -> Block:
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: stacked})
            def make(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs, moe)
            return make(rngs)

        # A mixture of experts: the first `first_dense_layers` layers dense (`dense_blocks`), then
        # groups of `moe_every - 1` dense layers (`interleaved_dense_blocks`, stacked group after
        # group) and one MoE layer (`blocks`), the groups one scan.
        moe = cfg.num_experts > 0
        if moe and cfg.first_dense_layers:
            # Stacked on `dense_layers`, not `layers`: they run before any pipeline, not in its
            # stages, so the rules leave them whole over `stage` (no rule: replicated).
            self.dense_blocks = make_blocks(cfg.first_dense_layers, False, "dense_layers")
        if moe and cfg.moe_every > 1:
            self.interleaved_dense_blocks = make_blocks(cfg.num_moe_layers * (cfg.moe_every - 1), False)
        self.blocks = make_blocks(cfg.num_moe_layers if moe else cfg.num_layers, moe)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), head_std)
        if cfg.mtp_depth:  # last: the rest draws the same initial values with and without MTP
            self.mtp = mtp.make_mtp(cfg, rngs, Block, RMSNorm)

    def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, part: Partitioning = Partitioning()):
        x_BLD = self.hidden(tokens_BL, positions_BL, segment_ids_BL, part)
        head_DV = self.head_weight().astype(self.dtype)
        logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, head_DV, preferred_element_type=jnp.float32)
        return part.constrain(logits_BLV, ("batch", "length", "vocab"))

    def head_weight(self) -> jax.Array:
        """The output projection [D, V] in fp32: the head, or the transposed embedding when tied."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.head[...]

    def hidden(self, tokens_BL, positions_BL=None, segment_ids_BL=None, part: Partitioning = Partitioning()):
        """The final hidden states [B, L, D] (after the last norm), in the compute dtype.

        `__call__` projects them to logits; the training loss (`jaxtrain.model.loss.fused_loss`) takes
        them with `head_weight()` instead, so the full logits are never materialised.
        """
        return self.hidden_and_stats(tokens_BL, positions_BL, segment_ids_BL, part)[0]

    def hidden_and_stats(self, tokens_BL, positions_BL=None, segment_ids_BL=None, part: Partitioning = Partitioning(),
                         router_bias=None, final_norm: bool = True):
        """(`hidden`, the MoE layers' routing statistics stacked [moe layers, ...], or {} when dense).

        `router_bias` [moe layers, E]: the train state's `moe.router_bias` (zeros when None).
        `final_norm=False`: the hidden states before the final norm (what multi-token prediction takes).
        """
        norm = self.final_norm if final_norm else (lambda x: x)
        cfg, dtype = self.cfg, self.dtype
        if positions_BL is None:
            positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1], dtype=jnp.int32), tokens_BL.shape)
        x_BLD = part.constrain(self._embed(tokens_BL, part), ("batch", "act_length", "act_embed"))

        # Under a pipeline that rematerialises its iterations, model.remat's policy applies to each
        # iteration (MaxText's default), not to each layer too: nested checkpoints would run every
        # layer's forward pass three times (forward, the iteration's recompute, the layer's).
        iteration_remat = part.schedule is not None and part.schedule.remat_iterations
        per_layer_remat = cfg.remat != "none" and not iteration_remat

        def in_order(body, x_BLD, xs):
            """`body(x, one slice of xs) -> (x, y)` over the leading axis of `xs`: a scan, or unrolled
            (`model.scan_layers=false`). -> (x, ys stacked)."""
            if cfg.scan_layers:
                return jax.lax.scan(body, x_BLD, xs)
            outs = []
            for i in range(jax.tree_util.tree_leaves(xs)[0].shape[0]):
                x_BLD, y = body(x_BLD, jax.tree_util.tree_map(lambda a: a[i], xs))
                outs.append(y)
            return x_BLD, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)

        def runner(graphdef):
            def stack(x_BLD, positions_BL, segment_ids_BL, layers, part, biases=None, local=None):
                """Run `layers` (stacked on a leading axis) in order: all of them, or one pipeline stage's.
                With `biases` (MoE layers) -> (x, stacked statistics); else x. `local`: a bool per
                layer (local and global layers mixed), else None (Attention decides statically)."""
                def layer(x_BLD, xs):
                    one_layer, bias, is_local = xs
                    out = nnx.merge(graphdef, one_layer)(x_BLD, positions_BL, segment_ids_BL, dtype, part, bias,
                                                         is_local)
                    return out if biases is not None else (out, None)

                if per_layer_remat:
                    layer = jax.checkpoint(layer, policy=remat_policy(cfg.remat), prevent_cse=not cfg.scan_layers)
                x_BLD, stats = in_order(layer, x_BLD, (layers, biases, local))
                return x_BLD if biases is None else (x_BLD, stats)
            return stack

        graphdef, layers = nnx.split(self.blocks)
        if cfg.num_experts == 0:
            if part.schedule is None:
                # Local and global layers mixed (refused under a pipeline): each layer's flag is scanned.
                local = (jnp.array([cfg.layer_is_local(i) for i in range(cfg.num_layers)])
                         if cfg.mixed_windows else None)
                x_BLD = runner(graphdef)(x_BLD, positions_BL, segment_ids_BL, layers, part, None, local)
            else:  # mesh.stage > 1: the layers run as pipeline stages
                x_BLD = pipeline.run(runner(graphdef), nnx.to_pure_dict(layers), logical_axes(layers), x_BLD,
                                     positions_BL, segment_ids_BL, part, remat_policy=remat_policy(cfg.remat))
            return norm(x_BLD), {}

        # A mixture of experts. The first dense layers run before the MoE units (under a pipeline,
        # outside it: batch-parallel over the stage devices too, their weights gathered over `stage`).
        def flags(stack: str, n: int):
            """Each of the stack's layers' local flag [n] (local and global layers mixed), else None."""
            return (jnp.array([cfg.layer_is_local(layer_index(cfg, stack, i)) for i in range(n)])
                    if cfg.mixed_windows else None)

        if hasattr(self, "dense_blocks"):
            dense_graphdef, dense = nnx.split(self.dense_blocks)
            x_BLD = runner(dense_graphdef)(x_BLD, positions_BL, segment_ids_BL, dense, part, None,
                                           flags("dense_blocks", cfg.first_dense_layers))
        if router_bias is None:
            router_bias = jnp.zeros((cfg.num_moe_layers, cfg.num_experts), jnp.float32)
        # The stacked unit (one per MoE layer, what the scan or the pipeline stages run): the MoE
        # layer, with moe_every > 1 after its group's moe_every - 1 dense layers.
        run_moe = runner(graphdef)
        units, names = {"moe": layers, "bias": router_bias}, {"moe": logical_axes(layers), "bias": ("layers", None)}
        if cfg.mixed_windows:  # each unit's layers' local flags (refused under a pipeline)
            units["local"], names["local"] = flags("blocks", cfg.num_moe_layers), ("layers",)
        if hasattr(self, "interleaved_dense_blocks"):
            dense_graphdef, dense = nnx.split(self.interleaved_dense_blocks)
            # [groups * (k - 1), ...] -> [groups, k - 1, ...]: one group's dense layers per unit.
            units["dense"] = jax.tree_util.tree_map(lambda a: a.reshape(cfg.num_moe_layers, -1, *a.shape[1:]), dense)
            names["dense"] = jax.tree_util.tree_map(lambda n: ("layers", None, *n[1:]), logical_axes(dense),
                                                    is_leaf=lambda n: isinstance(n, tuple))
            run_dense = runner(dense_graphdef)
            if cfg.mixed_windows:
                units["dense_local"] = flags("interleaved_dense_blocks", cfg.num_moe_layers * (cfg.moe_every - 1)
                                             ).reshape(cfg.num_moe_layers, -1)
                names["dense_local"] = ("layers", None)

        def run_units(x_BLD, positions_BL, segment_ids_BL, units, part):
            """The stacked units in order -> (x, routing sums stacked per MoE layer)."""
            if "dense" not in units:
                return run_moe(x_BLD, positions_BL, segment_ids_BL, units["moe"], part, units["bias"],
                               units.get("local"))

            def group(x_BLD, unit):
                x_BLD = run_dense(x_BLD, positions_BL, segment_ids_BL, unit["dense"], part, None,
                                  unit.get("dense_local"))
                # a stack of one
                one = jax.tree_util.tree_map(lambda a: a[None], (unit["moe"], unit["bias"], unit.get("local")))
                x_BLD, s = run_moe(x_BLD, positions_BL, segment_ids_BL, one[0], part, one[1], one[2])
                return x_BLD, jax.tree_util.tree_map(lambda a: a[0], s)
            return in_order(group, x_BLD, units)

        if part.schedule is None:
            x_BLD, stats = run_units(x_BLD, positions_BL, segment_ids_BL, units, part)
        else:  # the units run as pipeline stages, their routing sums added over the microbatches
            pure = {k: v if k == "bias" else nnx.to_pure_dict(v) for k, v in units.items()}
            x_BLD, stats = pipeline.run(run_units, pure, names, x_BLD, positions_BL, segment_ids_BL, part,
                                        remat_policy=remat_policy(cfg.remat), with_stats=True)
        return norm(x_BLD), finish_stats(stats)

    def mtp_hidden(self, h_BLD, tokens_by_depth, positions_BL, segment_ids_BL,
                   part: Partitioning = Partitioning()) -> list:
        """Multi-token prediction (model.mtp_depth; jaxtrain/model/mtp.py): from the decoder's output
        before the final norm (`hidden_and_stats(..., final_norm=False)`) and the tokens each module
        embeds (token t + d for module d), each module's hidden states after the final norm [B, L, D]."""
        return mtp.mtp_hidden(self, h_BLD, tokens_by_depth, positions_BL, segment_ids_BL, part)


    def _embed(self, tokens_BL, part: Partitioning) -> jax.Array:
        """The tokens' embeddings in the compute dtype; * sqrt(d_model) with model.embed_scale (the
        factor in the compute dtype, as Gemma's transformers code casts it to the embedding's)."""
        x_BLD = embed_lookup(self.embed[...], tokens_BL, self.dtype, part)
        if self.cfg.embed_scale:
            x_BLD = x_BLD * jnp.asarray(self.cfg.d_model ** 0.5, self.dtype)
        return x_BLD

    # ------------------------------------------------------------------------- decoding

    def cache_stacks(self) -> dict[str, int]:
        """The model's layer stacks, in the order they run, and their layer counts."""
        cfg = self.cfg
        stacks = {}
        if hasattr(self, "dense_blocks"):
            stacks["dense_blocks"] = cfg.first_dense_layers
        if hasattr(self, "interleaved_dense_blocks"):
            stacks["interleaved_dense_blocks"] = cfg.num_moe_layers * (cfg.moe_every - 1)
        stacks["blocks"] = cfg.num_moe_layers if cfg.num_experts > 0 else cfg.num_layers
        return stacks

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> dict:
        """An empty KV cache: {stack: [{"k", "v"}: [batch, length, K, H] per layer]} (`decode` fills it).

        One buffer per layer, not a stacked array: a decode step updates each in place, where
        slicing a stacked cache (and stacked weights) would copy them at every token."""
        cfg, dtype = self.cfg, dtype or self.dtype
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        # MLA caches each head's expanded keys [.., N, Hn + Hr] and values [.., N, v_head_dim]
        shapes = {"k": shape, "v": (*shape[:3], cfg.v_head_dim) if cfg.mla else shape}
        return {name: [{kv: jnp.zeros(shapes[kv], dtype) for kv in ("k", "v")} for _ in range(n)]
                for name, n in self.cache_stacks().items()}

    def layer_params(self) -> dict[str, list]:
        """{stack: [one layer's parameters (a pure dict) per layer]}: the stacks cut into layers, for
        `decode` (done once outside the decode loop: slicing inside it copies every weight per token)."""
        out = {}
        for name, n in self.cache_stacks().items():
            stacked = nnx.to_pure_dict(nnx.split(getattr(self, name))[1])
            out[name] = [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked) for i in range(n)]
        return out

    def decode(self, tokens_BL, positions_BL, cache: dict, part: Partitioning = Partitioning(),
               router_bias=None, layers: dict | None = None) -> tuple[jax.Array, dict]:
        """New tokens at `positions_BL` (contiguous per row) through every layer with its KV cache.

        -> (the final hidden states [B, L, D] after the last norm, the updated cache). The prompt
        (prefill) and each generated token (decode) both come through here: no pipeline, no context
        split (`jaxtrain.infer` refuses those layouts); MoE layers route with `router_bias`. The
        layers run unrolled, each over its own weights (`layers`: `layer_params()`, made once by
        the caller; None: cut here) and its own cache buffer.
        """
        cfg, dtype = self.cfg, self.dtype
        layers = self.layer_params() if layers is None else layers
        x_BLD = part.constrain(self._embed(tokens_BL, part), ("batch", "length", "act_embed"))
        cache = {name: list(c) for name, c in cache.items()}
        graphdefs = {name: nnx.split(getattr(self, name))[0] for name in cache}

        def run(name: str, i: int, x_BLD, bias_E=None):
            block = nnx.merge(graphdefs[name], layers[name][i])
            # Local and global layers mixed: the layer's own flag (by its index in the model).
            local = cfg.layer_is_local(layer_index(cfg, name, i)) if cfg.mixed_windows else None
            x_BLD, cache[name][i] = block.decode(x_BLD, positions_BL, cache[name][i], dtype, part, bias_E, local)
            return x_BLD

        for i in range(len(cache.get("dense_blocks", []))):
            x_BLD = run("dense_blocks", i, x_BLD)
        if not cfg.num_experts:
            for i in range(cfg.num_layers):
                x_BLD = run("blocks", i, x_BLD)
            return self.final_norm(x_BLD), cache
        if router_bias is None:
            router_bias = jnp.zeros((cfg.num_moe_layers, cfg.num_experts), jnp.float32)
        per_group = cfg.moe_every - 1 if "interleaved_dense_blocks" in cache else 0
        for u in range(cfg.num_moe_layers):  # each unit: its group's moe_every - 1 dense layers, then the MoE layer
            for i in range(u * per_group, (u + 1) * per_group):
                x_BLD = run("interleaved_dense_blocks", i, x_BLD)
            x_BLD = run("blocks", u, x_BLD, router_bias[u])
        return self.final_norm(x_BLD), cache


def layer_index(cfg: ModelConfig, stack: str, i: int) -> int:
    """The model's layer index of layer i of `stack` (`Transformer.cache_stacks`): the first dense
    layers, then groups of moe_every - 1 interleaved dense layers and one MoE layer."""
    f, m = cfg.first_dense_layers if cfg.num_experts > 0 else 0, cfg.moe_every
    if stack == "dense_blocks" or (stack == "blocks" and cfg.num_experts == 0):
        return i
    if stack == "interleaved_dense_blocks":
        return f + (i // (m - 1)) * m + i % (m - 1)
    return f + i * m + m - 1  # the MoE layers


def model_logical_axes(m: ModelConfig) -> dict:
    """The logical axes of model `m`'s parameters (shapes only: nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))
    return logical_axes(nnx.split(abstract)[1])


def logical_axes(params_state: nnx.State) -> dict:
    """Nested dict of logical-name tuples, matching `nnx.to_pure_dict(params_state)`."""
    def walk(node):
        if isinstance(node, nnx.Variable):
            return tuple(node.get_metadata()["out_sharding"])
        return {k: walk(v) for k, v in node.items()}
    return walk(params_state)


def embed_lookup(table_VD: jax.Array, tokens_BL: jax.Array, dtype: Any, part: Partitioning = Partitioning()) -> jax.Array:
    """The rows `tokens_BL` of the embedding table, in `dtype`: [B, L, D], sharded like the tokens.

    The table stays sharded as its parameter is (vocab and embed over their mesh axes): no device
    holds more of it than its own shard, in any precision, and its gradient is a scatter-add into a
    shard-sized buffer, sharded like the parameter. Gathering the table first (as FSDP does for other
    weights) would put a whole [V, D] fp32 table and its fp32 gradient on every device, whatever the
    fsdp degree: ~4 GiB for Llama-3's 128k vocabulary at D = 4096.

    Per device (a shard_map): the tokens of every device that shares the table shard's embed columns
    are gathered (a few KiB of ids); each device looks them up in its own rows (ids outside its vocab
    shard give zeros) and casts them to `dtype`; then, in `dtype`, a reduction over the vocab shards
    and an all-to-all over the embed shards return each device its own tokens' full rows. What moves
    is activation-sized, [B, L, D] in the compute dtype, never table-sized.
    """
    mesh = part.mesh
    if mesh is None or mesh.size == 1:
        return jnp.take(table_VD, tokens_BL, axis=0).astype(dtype)

    def axes(entry) -> tuple[str, ...]:
        entries = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        return tuple(a for a in entries if mesh.shape[a] > 1)

    def spec(names) -> P:  # axes of size 1 left out: nothing to split, sum or gather over them
        return P(*(axes(entry) or None for entry in part.spec(names)))

    table_spec, token_spec = spec(("vocab", "embed")), spec(("batch", "length"))
    vocab_axes, embed_axes = axes(table_spec[0]), axes(table_spec[1])
    token_dim = {a: d for d, entry in enumerate(token_spec) for a in axes(entry)}  # mesh axis -> tokens dim
    # How each table axis is undone after the local lookup, in order: the vocab shards are summed
    # (in any order); the embed shards' columns are concatenated innermost axis first, so that
    # they land in the order the parameter's sharding gives them.
    steps = [("vocab", a) for a in vocab_axes] + [("embed", a) for a in reversed(embed_axes)]
    # A table axis that also splits the tokens: first gather the tokens over it, so the devices of a
    # table group look up each other's tokens; the last gathered is the first undone (outermost).
    gathers = [a for _, a in reversed(steps) if a in token_dim]

    def local(table, tokens):
        for a in gathers:
            tokens = jax.lax.all_gather(tokens, a, axis=token_dim[a], tiled=True)
        rows = table.shape[0]
        shard = 0  # this device's vocab shard: row-major over the vocab axes, as the sharding splits V
        for a in vocab_axes:
            shard = shard * mesh.shape[a] + jax.lax.axis_index(a)
        ids = tokens - shard * rows
        inside = (ids >= 0) & (ids < rows)
        x = jnp.take(table, jnp.where(inside, ids, 0), axis=0).astype(dtype)
        x = jnp.where(inside[..., None], x, jnp.zeros((), dtype))
        for kind, a in steps:
            dim = token_dim.get(a)
            if kind == "vocab":  # one shard holds each row, the others add zeros: exact in any dtype
                x = jax.lax.psum(x, a) if dim is None else jax.lax.psum_scatter(x, a, scatter_dimension=dim, tiled=True)
            elif dim is not None:  # my tokens' rows from each embed shard, their columns side by side
                x = jax.lax.all_to_all(x, a, dim, x.ndim - 1, tiled=True)
            else:  # tokens replicated over `a`: place my columns and sum (all_gather would stay device-varying)
                n, width = mesh.shape[a], x.shape[-1]
                full = jnp.zeros((*x.shape[:-1], n * width), dtype)
                x = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(full, x, jax.lax.axis_index(a) * width, x.ndim - 1), a)
        return x

    return jax.shard_map(local, mesh=mesh, in_specs=(table_spec, token_spec),
                         out_specs=P(*token_spec, None))(table_VD, tokens_BL)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in matmuls per token (all but the embedding lookup and norms).

    For a mixture of experts: the *active* ones, the router, the k chosen experts and the shared
    experts of each MoE layer (what a token's FLOPs count), not every expert's weights.
    """
    D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    attention = mla_matmul_params(cfg) if cfg.mla else D * H * (2 * N + 2 * K)
    # Each multi-token-prediction module: eh_proj [2D, D], a dense layer and the shared head again.
    mtp = cfg.mtp_depth * (2 * D * D + attention + 3 * D * F + D * cfg.vocab_size)
    if cfg.num_experts <= 0:
        return cfg.num_layers * (attention + 3 * D * F) + D * cfg.vocab_size + mtp
    Fe = cfg.moe_mlp_dim or F
    moe = cfg.num_moe_layers
    moe_mlp = D * cfg.num_experts + 3 * D * Fe * (cfg.experts_per_token + cfg.num_shared_experts)
    return ((cfg.num_layers - moe) * (attention + 3 * D * F) + moe * (attention + moe_mlp)
            + D * cfg.vocab_size + mtp)
