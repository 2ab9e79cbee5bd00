"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p.

The settings are traced values, not static ones, so changing them never recompiles a decode step.
The order is transformers' (`generate`'s logits warpers): divide by the temperature, keep the k
largest, then the smallest set whose probability reaches p. A row's draw depends only on the seed,
the row's index in the request and the position it fills, so a request is reproducible whatever
else shares its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxtrain.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0: greedy (argmax), the other settings unused."""

    temperature: float = 0.0
    top_k: int = 0  # keep the k most likely tokens; 0: all
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p; 1: all
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")

    def arrays(self) -> dict[str, jax.Array]:
        """The settings as scalars for a jitted step (traced: no recompilation per setting)."""
        return {"temperature": jnp.float32(self.temperature), "top_k": jnp.int32(self.top_k),
                "top_p": jnp.float32(self.top_p), "key": jax.random.key(self.seed)}


def filter_logits(logits_BV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Logits with every token outside the top-k and then outside the top-p set at -inf."""
    V = logits_BV.shape[-1]
    descending = -jnp.sort(-logits_BV, axis=-1)
    kth = jnp.take(descending, jnp.clip(top_k - 1, 0, V - 1), axis=-1)[:, None]
    logits_BV = jnp.where((top_k > 0) & (logits_BV < kth), -jnp.inf, logits_BV)
    descending = jnp.where((top_k > 0) & (descending < kth), -jnp.inf, descending)
    probs = jax.nn.softmax(descending, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above each one
    kept = (before < top_p).at[:, 0].set(True)  # the most likely token always stays
    smallest_kept = jnp.min(jnp.where(kept, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_BV < smallest_kept, -jnp.inf, logits_BV)


def choose(logits_BV: jax.Array, settings: dict[str, jax.Array], rows_B: jax.Array, positions_B: jax.Array) -> jax.Array:
    """The next token of each row [B] (int32): argmax at temperature 0, else a draw from the
    filtered distribution with the key of (seed, row, position)."""
    temperature = settings["temperature"]

    def drawn() -> jax.Array:
        filtered = filter_logits(logits_BV / temperature, settings["top_k"], settings["top_p"])
        keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(settings["key"], r), p))(rows_B, positions_B)
        return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)

    # A branch, not a select: greedy decoding skips the sort over the vocabulary that filtering needs.
    return jax.lax.cond(temperature > 0, drawn, lambda: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32))
