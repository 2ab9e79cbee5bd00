"""The train state: its shapes and shardings from the config alone, its initialisation, its step.

`StateLayout` is everything about the state that is known before any array exists: the model's
graph definition, every parameter's logical axes and sharding, the optimizer, and the abstract
state (`jax.ShapeDtypeStruct`s carrying their shardings). The trainer restores or initialises
into it; `jaxtrain inspect` compiles the step from it without allocating or reading data.

The state is a plain dict `{"step", "params", "opt_state", "rng", "loss_scale", "stability"}`:
`params` is the model's pure dict (the NNX graph is split once, here, and merged inside the jitted
step); `loss_scale` is fp16's dynamic scaler (`precision.py`); `stability` the running loss and
gradient-norm statistics of spike detection (`stability.py`). All of it is checkpointed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.config import Config
from jaxtrain.model.llama import Transformer, logical_axes
from jaxtrain.parallel.sharding import Partitioning, batch_sharding, param_shardings
from jaxtrain.train.optim import make_optimizer
from jaxtrain.train.precision import compute_dtype, init_loss_scale
from jaxtrain.train.stability import init_statistics
from jaxtrain.train.step import BATCH_KEYS, make_train_step, reads_chaos
from jaxtrain.runtime.xla_cpu import lean_compile_options

State = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Shapes and shardings of the train state and its batches, for one config on one mesh."""

    cfg: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    logical: dict  # logical axis names per parameter, same tree as params
    param_shardings: Any
    state_shardings: dict
    batch_sharding: NamedSharding
    optimizer: optax.GradientTransformation
    num_params: int

    @property
    def rules(self) -> dict:
        return self.cfg.mesh.rules

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def init_fn(self) -> State:
        """A fresh state (unsharded function; `init` jits it into the shardings)."""
        cfg = self.cfg
        model = Transformer(cfg.model, rngs=nnx.Rngs(cfg.run.seed), dtype=compute_dtype(cfg))
        params = nnx.to_pure_dict(nnx.state(model))
        state = {"step": jnp.int32(0), "params": params, "opt_state": self.optimizer.init(params),
                 "rng": jax.random.key_data(jax.random.key(cfg.run.seed)),
                 "loss_scale": init_loss_scale(cfg), "stability": init_statistics(cfg.stability.window)}
        if cfg.model.num_experts > 0:
            state["moe"] = init_moe_state(cfg)
        return state

    def compiled_init(self) -> jax.stages.Compiled:
        """The initialisation, compiled lean: it runs once, so on the CPU without the YNNPACK fusions
        that trade memory for speed (jaxtrain/runtime/xla_cpu.py: 7x the temporaries on a wide model)."""
        platform = self.mesh.devices.flat[0].platform
        return jax.jit(self.init_fn, out_shardings=self.state_shardings).lower().compile(
            compiler_options=lean_compile_options(platform) or None)

    def init(self) -> State:
        """A fresh state built directly in its shardings: no device ever holds the whole model."""
        return self.compiled_init()()

    def abstract_state(self) -> State:
        """Shapes, dtypes and shardings of the train state, without allocating it."""
        return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      jax.eval_shape(self.init_fn), self.state_shardings)

    @property
    def chaos_drills(self) -> bool:
        """Whether the step reads its `chaos` factor (chaos.nan_at_steps / spike_at_steps configured)."""
        return reads_chaos(self.cfg)

    def batch_shardings(self) -> dict[str, NamedSharding]:
        """Shardings of a global batch's entries: [batch, length] arrays."""
        return {k: self.batch_sharding for k in BATCH_KEYS}

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes of one global batch (tokens, targets, segment_ids, positions, loss_mask)."""
        d = self.cfg.data
        shape = (d.global_batch_size, d.seq_len)
        out = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                       sharding=self.batch_sharding) for k in BATCH_KEYS}
        return out

    def abstract_chaos(self) -> jax.ShapeDtypeStruct:
        """The step's third input: the numerics drills' loss factor, a replicated float32 scalar."""
        return jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)

    def chaos_factor(self, factor: float = 1.0) -> jax.Array:
        """`factor` as the step's `chaos` input (a global array: every process passes the same)."""
        return jax.make_array_from_process_local_data(self.replicated, np.asarray(factor, np.float32))

    def jit_train_step(self, return_grads: bool = False, wrap: Callable | None = None) -> Callable:
        """The train step jitted with explicit in/out shardings and the state donated.

        `return_grads` adds the applied gradients as a third output (sharded like the parameters).
        `wrap(step_fn)`: a step function around the pure one, same signature (the watchdog's step
        marks, jaxtrain/fault/step_marks.py).
        """
        step_fn = make_train_step(self.cfg, self.graphdef, self.optimizer, self.mesh, self.rules,
                                  return_grads=return_grads)
        if wrap is not None:
            step_fn = wrap(step_fn)
        out = (self.state_shardings, self.replicated) + ((self.param_shardings,) if return_grads else ())
        return jax.jit(step_fn, in_shardings=(self.state_shardings, self.batch_shardings(), self.replicated),
                       out_shardings=out, donate_argnums=0)

    def lower_train_step(self, wrap: Callable | None = None) -> jax.stages.Lowered:
        """The train step lowered from shapes alone (no arrays, no data); `wrap` as in jit_train_step."""
        return self.jit_train_step(wrap=wrap).lower(self.abstract_state(), self.abstract_batch(), self.abstract_chaos())


def init_moe_state(cfg: Config) -> dict:
    """The MoE routing bias [MoE layers, E], zero at the start: train state, not a parameter
    (no gradient, no optimizer state), checkpointed with the rest (jaxtrain/model/moe.py)."""
    m = cfg.model
    return {"router_bias": jnp.zeros((m.num_moe_layers, m.num_experts), jnp.float32)}


def build_layout(cfg: Config, mesh: Mesh) -> StateLayout:
    """Abstract model -> logical axes -> shardings. Nothing is allocated.

    Raises:
      ConfigError: a parameter dimension that does not divide its mesh axes (named).
    """
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(cfg.run.seed), dtype=compute_dtype(cfg)))
    graphdef, abstract_params = nnx.split(abstract)
    logical = logical_axes(abstract_params)
    abstract_params = nnx.to_pure_dict(abstract_params)
    shardings = param_shardings(logical, abstract_params, mesh, cfg.mesh.rules)
    optimizer = make_optimizer(cfg, Partitioning(mesh, cfg.mesh.rules))  # muon places its iteration by it
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    # Optimizer moments shard like their parameters; counters and the like are replicated, and so
    # are param-tree leaves of another shape (adafactor's factored row and column statistics).
    opt_shardings = optax.tree_map_params(optimizer, lambda x, s, p: s if x.shape == p.shape else replicated,
                                          abstract_opt, shardings, abstract_params,
                                          transform_non_params=lambda _: replicated)
    state_shardings = {"step": replicated, "params": shardings, "opt_state": opt_shardings, "rng": replicated,
                       "loss_scale": {"scale": replicated, "good_steps": replicated},
                       "stability": {k: replicated for k in init_statistics()}}
    if cfg.model.num_experts > 0:
        state_shardings["moe"] = {"router_bias": replicated}
    num_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract_params))
    return StateLayout(cfg=cfg, mesh=mesh, graphdef=graphdef, logical=logical, param_shardings=shardings,
                       state_shardings=state_shardings, batch_sharding=batch_sharding(mesh, cfg.mesh.rules),
                       optimizer=optimizer, num_params=num_params)
