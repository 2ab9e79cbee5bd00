"""Text out of a jaxtrain model: prefill the prompts, then decode token by token over a KV cache.

    gen = Generator(cfg.model, params, mesh=mesh, rules=cfg.mesh.rules, router_bias=bias)
    [c] = gen.generate([prompt_ids], max_new_tokens=40, sampling=Sampling(temperature=0.8, top_p=0.9),
                       eos_id=tok.eod_id)
    c.tokens, c.finish_reason            # 'eos', 'stop' or 'length'

Shapes are bucketed so that compilation does not follow the prompts: the prompts of a request are
padded on the right to the next power of two (at least 16) and the cache holds the next power of
two past the longest prompt plus `max_new_tokens` (both capped at `model.max_seq_len`). The prefill
compiles once per (batch, prompt bucket, cache) and the decode loop once per (batch, cache); a
request of the same buckets compiles nothing. The loop runs `chunk` tokens per call on the device
(a `while_loop` that also stops when every row is done); between calls the host checks stop strings.

Parameters are sharded by the training rules over the mesh given (data splits the batch of
prompts, fsdp and tensor the weights); pipeline stages, a context split and expert parallelism
are refused by name. MoE layers route with the train state's router bias and never drop a token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.infer.sampling import Sampling, choose
from jaxtrain.model.llama import Transformer, logical_axes
from jaxtrain.parallel.sharding import Partitioning, param_shardings

# Mesh axes a decode step cannot use: what each would need that decoding does not have.
UNSERVED_AXES = {"stage": "pipeline stages (decoding runs every layer on each device)",
                 "context": "a sequence split (the KV cache is not split by length)",
                 "expert": "expert parallelism (decoding runs every expert on each device)"}
MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass
class Completion:
    """One prompt's continuation."""

    tokens: list[int]  # the new ids; the end-of-text id, when it ended the row, included
    finish_reason: str  # 'eos' (the end-of-text id), 'stop' (a stop string), 'length' (max_new_tokens or max_seq_len)
    text: Optional[str] = None  # decoded, without the end-of-text token, cut before a stop string
    logits: Optional[np.ndarray] = None  # [len(tokens), V] fp32, the logits each token was chosen from


def bucket(n: int, floor: int, cap: int) -> int:
    """The next power of two >= max(n, floor), at most `cap` (itself at least n)."""
    return min(max(floor, 1 << max(0, n - 1).bit_length()), cap)


def check_layout(mesh: Optional[Mesh]) -> None:
    """Refuse, by name, a mesh axis that decoding cannot serve."""
    if mesh is None:
        return
    for axis, what in UNSERVED_AXES.items():
        if mesh.shape.get(axis, 1) > 1:
            raise ConfigError(f"decoding cannot use mesh.{axis}={mesh.shape[axis]}: {what}; "
                              f"use data, fsdp and tensor (mesh.{axis}=1)")


class Generator:
    """Prefill + KV-cache decoding of one model's parameters on one mesh (or one device)."""

    def __init__(self, model_cfg: ModelConfig, params: Any, *, mesh: Optional[Mesh] = None,
                 rules: Optional[dict] = None, router_bias: Optional[jax.Array] = None,
                 dtype: Any = jnp.float32, chunk: int = 16):
        """
        Args:
          model_cfg: the model's config section.
          params: the parameters as a pure dict (`nnx.to_pure_dict`), e.g. a checkpoint's `params`.
          mesh, rules: where to run and the logical-axis rules (the training config's `mesh.rules`);
            None: the default device.
          router_bias: [MoE layers, E] the train state's `moe.router_bias` (None: zeros).
          dtype: the compute dtype and the cache's (the training policy's compute dtype).
          chunk: tokens decoded per device call between the host's stop-string checks.
        """
        check_layout(mesh)
        # Inference never drops a token: dropless dispatch whatever the training capacity factor.
        self.cfg = dataclasses.replace(model_cfg, capacity_factor=0.0)
        self.dtype, self.chunk = dtype, chunk
        self.part = Partitioning(mesh, rules) if mesh is not None else Partitioning()
        abstract = nnx.eval_shape(lambda: Transformer(self.cfg, rngs=nnx.Rngs(0), dtype=dtype))
        self.graphdef, abstract_params = nnx.split(abstract)
        self.batch_ways = self.part.ways("batch")
        self._shardings = (lambda p: param_shardings(logical_axes(abstract_params), p, mesh, rules)) if mesh else None
        self.params: Any = None  # the model without its layer stacks (placeholders), and each layer's own
        self.layers: Any = None
        if params is not None:  # (None: `set_params` before generating, as the training loop does)
            self.set_params(params)
        moe_layers = self.cfg.num_moe_layers if self.cfg.num_experts else 0
        self.router_bias = (None if not moe_layers else router_bias if router_bias is not None
                            else jnp.zeros((moe_layers, self.cfg.num_experts), jnp.float32))
        self._prefill = jax.jit(self._prefill_fn, static_argnums=(7,))
        self._decode = jax.jit(self._decode_fn, static_argnums=(6,), donate_argnums=(3,))
        self._scorer = None  # jaxtrain.infer.scoring's program, made on first use

    def set_params(self, params: Any) -> None:
        """Decode with `params` (a pure dict): placed by the rules on the mesh, and cut into layers
        once here (`Transformer.layer_params`), so that no decode step slices a stacked weight. The
        stacks themselves are kept as empty placeholders: the weights are held once."""
        if self._shardings is not None:
            params = jax.tree_util.tree_map(jax.device_put, params, self._shardings(params))
        model = nnx.merge(self.graphdef, params)
        self.layers = model.layer_params()
        self.params = {k: (jax.tree_util.tree_map(lambda a: jnp.zeros((0,), a.dtype), v) if k in self.layers else v)
                       for k, v in params.items()}

    # ------------------------------------------------------------------------- on the device

    def _logits(self, model: Transformer, hidden_BD: jax.Array) -> jax.Array:
        head_DV = model.head_weight().astype(self.dtype)
        return jnp.einsum("bd,dv->bv", hidden_BD, head_DV, preferred_element_type=jnp.float32)

    def _prefill_fn(self, params, layers, router_bias, tokens_BP, lengths_B, limit_B, eos, cache_len: int):
        """The prompts through the model into a new cache -> (cache, the decode loop's first carry).

        The carry is made here, not on the host, so that the decode loop always receives arrays
        laid out as it returns them (a host array would compile a second program)."""
        model = nnx.merge(self.graphdef, params)
        B, P = tokens_BP.shape
        cache = model.init_cache(B, cache_len, self.dtype)
        positions_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        hidden_BPD, cache = model.decode(tokens_BP, positions_BP, cache, self.part, router_bias, layers)
        last_BD = jnp.take_along_axis(hidden_BPD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        carry = {"logits": self._logits(model, last_BD), "position": lengths_B, "done": limit_B <= 0,
                 "count": jnp.zeros(B, jnp.int32), "limit": limit_B, "rows": jnp.arange(B, dtype=jnp.int32),
                 "eos": eos}
        return cache, carry

    def _decode_fn(self, params, layers, router_bias, cache, carry, settings, keep_logits: bool):
        """Up to `chunk` tokens per row; stops early when every row is done.

        carry: logits [B, V] (of each row's next token), position [B] (the slot it fills), done,
        count (tokens emitted), limit (tokens allowed), rows (the row's index in the request), eos.
        -> (cache, carry, tokens [B, chunk], emitted [B, chunk] (False past a row's end), logits)."""
        model = nnx.merge(self.graphdef, params)
        B, V = carry["logits"].shape
        S = jax.tree_util.tree_leaves(cache)[0].shape[1]
        C = self.chunk
        out = {"tokens": jnp.zeros((B, C), jnp.int32), "emitted": jnp.zeros((B, C), bool)}
        if keep_logits:
            out["logits"] = jnp.zeros((B, C, V), jnp.float32)

        def body(loop):
            i, cache, carry, out = loop
            token_B = choose(carry["logits"], settings, carry["rows"], carry["position"])
            active_B = ~carry["done"]
            out = dict(out, tokens=out["tokens"].at[:, i].set(token_B), emitted=out["emitted"].at[:, i].set(active_B))
            if keep_logits:
                out["logits"] = out["logits"].at[:, i].set(carry["logits"])
            count_B = carry["count"] + active_B
            done_B = carry["done"] | (active_B & ((token_B == carry["eos"]) | (count_B >= carry["limit"])))
            # A finished row still runs (the batch is one computation); its writes land past its end.
            slot_B = jnp.minimum(carry["position"], S - 1)
            hidden_B1D, cache = model.decode(token_B[:, None], slot_B[:, None], cache, self.part, router_bias, layers)
            carry = dict(carry, logits=self._logits(model, hidden_B1D[:, 0]), position=carry["position"] + active_B,
                         count=count_B, done=done_B)
            return i + 1, cache, carry, out

        def more(loop):
            i, _, carry, _ = loop
            return (i < C) & ~jnp.all(carry["done"])

        _, cache, carry, out = jax.lax.while_loop(more, body, (0, cache, carry, out))
        return cache, carry, out

    # ------------------------------------------------------------------------- on the host

    def compilations(self) -> int:
        """How many programs the prefill, the decode loop and scoring have compiled so far."""
        return sum(f._cache_size() for f in (self._prefill, self._decode, self._scorer) if f is not None)

    def scorer(self) -> Callable:
        """The jitted scoring program over this model (jaxtrain.infer.scoring.make_scorer), made once."""
        if self._scorer is None:
            from jaxtrain.infer.scoring import make_scorer
            self._scorer = make_scorer(self)
        return self._scorer

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy) per (context ids, continuation ids): jaxtrain.infer.scoring.score."""
        from jaxtrain.infer.scoring import score
        return score(self, requests, batch_size)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
                 eos_id: Optional[int] = None, stop: Sequence[str] = (), detokenize: Optional[Callable] = None,
                 return_logits: bool = False) -> list[Completion]:
        """Continue each prompt (token ids) by up to `max_new_tokens` tokens.

        Args:
          eos_id: a row ends after emitting this id (None: only at the length limit).
          stop: strings that end a row once its decoded text contains one (needs `detokenize`).
          detokenize: ids -> text; with it each completion carries its `text`.
          return_logits: keep the logits each token was chosen from (Completion.logits).
        Raises:
          ConfigError: an empty prompt, one longer than `model.max_seq_len`, an id outside the
            vocabulary, or max_new_tokens < 1.
        """
        max_len = self.cfg.max_seq_len
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        if stop and detokenize is None:
            raise ConfigError("stop strings need a tokenizer to read the text")
        lengths = [len(p) for p in prompts]
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            if n == 0:
                raise ConfigError(f"prompt {i} is empty: a prompt needs at least one token")
            if n > max_len:
                raise ConfigError(f"prompt {i} has {n} tokens, more than the model's max_seq_len {max_len}")
            if min(p) < 0 or max(p) >= self.cfg.vocab_size:
                raise ConfigError(f"prompt {i} has token id {max(p) if max(p) >= 0 else min(p)} outside the "
                                  f"model's vocabulary (0..{self.cfg.vocab_size - 1}): a tokenizer of another model?")
        rows = len(prompts)
        B = -(-rows // self.batch_ways) * self.batch_ways  # padded with one-token prompts to split evenly
        P = bucket(max(lengths), MIN_PROMPT_BUCKET, max_len)
        S = bucket(max(lengths) + max_new_tokens, P, max_len)
        tokens = np.zeros((B, P), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths_B = np.array(lengths + [1] * (B - rows), np.int32)
        limit_B = np.minimum(max_new_tokens, S - lengths_B).astype(np.int32)
        limit_B[rows:] = 0

        if self.params is None:
            raise ValueError("Generator.generate before set_params")
        cache, carry = self._prefill(self.params, self.layers, self.router_bias, tokens, lengths_B, limit_B,
                                     np.int32(-1 if eos_id is None else eos_id), S)
        settings = sampling.arrays()
        new: list[list[int]] = [[] for _ in range(rows)]
        kept: list[list[np.ndarray]] = [[] for _ in range(rows)]
        stopped = np.zeros(B, bool)
        while True:
            cache, carry, out = self._decode(self.params, self.layers, self.router_bias, cache, carry, settings,
                                             return_logits)
            host = jax.device_get(out)
            for r in range(rows):
                emitted = host["emitted"][r]
                new[r] += host["tokens"][r][emitted].tolist()
                if return_logits:
                    kept[r].append(host["logits"][r][emitted])
            done = np.asarray(jax.device_get(carry["done"]))
            if stop:
                for r in range(rows):
                    if not done[r] and any(s in detokenize(new[r]) for s in stop):
                        stopped[r] = True
                if stopped[~done].any():
                    done = done | stopped
                    carry = dict(carry, done=jax.device_put(done, carry["done"].sharding))
            if done.all():
                break
        return [self._completion(new[r], stopped[r], eos_id, stop, detokenize,
                                 np.concatenate(kept[r]) if return_logits else None) for r in range(rows)]

    @staticmethod
    def _completion(tokens: list[int], stopped: bool, eos_id: Optional[int], stop: Sequence[str],
                    detokenize: Optional[Callable], logits: Optional[np.ndarray]) -> Completion:
        ended = eos_id is not None and tokens and tokens[-1] == eos_id
        reason = "eos" if ended else "stop" if stopped else "length"
        text = None
        if detokenize is not None:
            text = detokenize(tokens[:-1] if ended else tokens)
            cuts = [text.index(s) for s in stop if s in text]
            if cuts:
                text, reason = text[:min(cuts)], "stop"
        return Completion(tokens=tokens, finish_reason=reason, text=text, logits=logits)
