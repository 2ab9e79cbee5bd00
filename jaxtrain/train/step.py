"""The train step: one pure function `train_step(state, batch, chaos) -> (state, metrics)`.

State is a plain pytree `{"step", "params", "opt_state", "rng", "loss_scale", "stability"}` (see
`jaxtrain.train.state`); params are the model's pure dict (the NNX graph is split once, outside the step,
and merged inside it). The trainer jits the step once with explicit in/out shardings and donates
the state. Metrics come back as device scalars; the host reads them later without stalling the
next step.

Inside the one step, with no extra host synchronisation: loss scaling (fp16, `precision.py`), the
guard that skips a step with non-finite gradients by keeping the old state, spike detection with
optional skipping (`stability.py`), gradient accumulation over `train.grad_accum` microbatches, and
the optimizer update (`optim.py`). The mesh, rules and pipeline schedule reach the model and the
loss as one `Partitioning` argument, built once here from the config (`partitioning`). `chaos` is
the numerics drills' loss factor (`chaos.nan_at_steps` / `spike_at_steps`, jaxtrain/fault/chaos.py):
a replicated float32 scalar input, so a new factor never recompiles (`reads_chaos`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.config import Config
from jaxtrain.model import mtp
from jaxtrain.model.loss import fused_loss
from jaxtrain.numerics import all_finite  # the step skips a non-finite update (tests import it from here too)
from jaxtrain.parallel import context, pipeline
from jaxtrain.parallel.sharding import Partitioning, Rules
from jaxtrain.train.optim import applied_learning_rate, keeps_state_on_skip, learning_rate_schedule
from jaxtrain.train.precision import update_loss_scale, uses_loss_scaling
from jaxtrain.train.stability import spike_check, update_statistics

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
Batch = dict[str, jax.Array]  # the BATCH_KEYS, each [B, L]
State = dict[str, Any]


def reads_chaos(cfg: Config) -> bool:
    """Whether the step reads its `chaos` input: only with numerics drills configured. Otherwise the
    factor is the constant 1 and jit drops the unused input, so such a run compiles the same step."""
    c = cfg.chaos
    return bool(c.nan_at_steps or c.spike_at_steps)


def partitioning(cfg: Config, mesh: Mesh | None, rules: Rules | None) -> Partitioning:
    """The step's `Partitioning`: the mesh, the rules and, when mesh.stage > 1, the pipeline schedule."""
    if mesh is None:
        return Partitioning()
    return Partitioning(mesh, rules if rules is not None else cfg.mesh.rules, pipeline.schedule_for(cfg, dict(mesh.shape)),
                        context.schedule_for(cfg, dict(mesh.shape)))


def loss_sum(params: Any, graphdef: nnx.GraphDef, batch: Batch, z_loss: float = 0.0,
             part: Partitioning = Partitioning(), grad_scale: jax.Array | float = 1.0
             ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    objective, (ce, z, count, _) = loss_terms(params, graphdef, batch, z_loss, part, grad_scale)
    return objective, (ce, z, count)


def loss_terms(params: Any, graphdef: nnx.GraphDef, batch: Batch, z_loss: float = 0.0,
               part: Partitioning = Partitioning(), grad_scale: jax.Array | float = 1.0, router_bias: Any = None,
               mtp_scales: jax.Array | None = None
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array, dict]]:
    """(objective sum, (cross-entropy sum, z-loss sum, counted tokens)) for one (micro)batch.

    The objective is the cross-entropy plus `z_loss` x logsumexp(logits)**2 (PaLM's z-loss, which
    keeps the log-partition near 0 and the softmax well conditioned), summed over counted tokens.
    The head and the loss run fused and chunked (`jaxtrain.model.loss.fused_loss`): the full [B, L, V]
    logits and their gradient are never materialised. `grad_scale`: the cotangent the caller will
    multiply the objective by (loss scale / token count), applied inside the loss before its
    softmax gradient is rounded to the compute dtype (see `fused_loss`); it changes no value.
    `mtp_scales` [mtp_depth] (multi-token prediction; `batch` a `mtp.shifted_batch`): the stats gain
    `mtp_objective` (already scaled: see `mtp.mtp_loss_terms`) and `mtp_ce` (sums per depth).
    """
    model = nnx.merge(graphdef, params)
    with_mtp = mtp_scales is not None
    x_BLD, moe_stats = model.hidden_and_stats(batch["tokens"], batch["positions"], batch["segment_ids"], part,
                                              router_bias, final_norm=not with_mtp)
    if with_mtp:  # the modules start from the decoder's output before the final norm
        h_BLD, x_BLD = x_BLD, model.final_norm(x_BLD)
        objective_mtp, ce_mtp = mtp.mtp_loss_terms(model, h_BLD, batch, mtp_scales, model.cfg.mtp_loss_weight, part)
        moe_stats = {**moe_stats, "mtp_objective": objective_mtp, "mtp_ce": ce_mtp}
    mask = batch["loss_mask"].astype(jnp.float32)
    objective, ce, z = fused_loss(x_BLD, model.head_weight(), batch["targets"], mask, z_loss, part=part,
                                  grad_scale=grad_scale)
    return objective, (ce, z, jnp.sum(mask), moe_stats)


def moe_losses(cfg: Config, stats: dict) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, router z-loss) of one (micro)batch: weight x the sum over MoE layers."""
    m = cfg.model
    return m.moe_aux_loss * jnp.sum(stats["balance"]), m.router_z_loss * jnp.sum(stats["z"])


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's aux-loss-free balancing: each expert's bias moves by `rate` toward balance,
    bias + rate x sign(mean load - load), per layer ([layers, E])."""
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def split_microbatches(batch: Batch, n: int, part: Partitioning = Partitioning()) -> Batch:
    """[B, L] -> [n, B/n, L], microbatch j taking rows j, j+n, j+2n, ...

    Strided rows keep every microbatch spread over all data-parallel devices, so the reshape
    moves no data between devices (each device's contiguous rows split evenly n ways).
    """
    def one(x):
        B = x.shape[0]
        x = x.reshape(B // n, n, *x.shape[1:]).swapaxes(0, 1)
        return part.constrain(x, (None, "batch", "length"))
    return {k: one(v) for k, v in batch.items()}


def advance_rng(rng: jax.Array, step: jax.Array) -> jax.Array:
    """The next step's RNG key data: this step's key folded with the step number.

    Randomness inside a step (dropout, ...) draws from the key it was given; the state carries
    the advanced key, so a resumed run continues the same stream bitwise.
    """
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(rng), step))


def global_norm(tree: Any, finite: jax.Array) -> jax.Array:
    """The global L2 norm of `tree`; finite whenever every element is (`finite`).

    The plain sum of squares overflows fp32 for large finite elements; only then (a `cond`, so the
    common case costs nothing extra) the norm is taken of the tree divided by its largest magnitude
    and multiplied back.
    """
    norm = optax.tree.norm(tree)

    def rescaled() -> jax.Array:
        peak = jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in jax.tree_util.tree_leaves(tree)]))
        peak = jnp.maximum(peak, jnp.finfo(jnp.float32).tiny)
        return peak * optax.tree.norm(jax.tree_util.tree_map(lambda x: x / peak, tree))

    return jax.lax.cond(finite & ~jnp.isfinite(norm), rescaled, lambda: norm)


def make_train_step(cfg: Config, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    mesh: Mesh | None = None, rules: Rules | None = None,
                    return_grads: bool = False) -> Callable[[State, Batch, jax.Array], tuple[State, dict]]:
    """Build the pure train step (not yet jitted: the trainer adds shardings and donation).

    Loss is the mean over all counted tokens of the global batch, however it is split into
    `train.grad_accum` microbatches, so accumulation equals one big batch. With `return_grads`
    the step returns (state, metrics, grads): the very gradients it applied, for tests that
    compare layouts and kernels on what the step computes rather than on a separate function.
    `chaos` (third argument): the drill's factor, a float32 scalar (1 when no drill fires; read
    only where `reads_chaos(cfg)`).
    """
    schedule = learning_rate_schedule(cfg)
    drills = reads_chaos(cfg)
    z_loss, guard = cfg.stability.z_loss, cfg.stability.guard
    part = partitioning(cfg, mesh, rules)
    scaling = uses_loss_scaling(cfg)
    # A pipeline schedule may fold the accumulation microbatches into one pass (pipeline.fold_grad_accum).
    accum = pipeline.accumulation_steps(cfg.train.grad_accum, part.schedule)

    moe = cfg.model.num_experts > 0
    depth = cfg.model.mtp_depth

    def scaled_loss(params, batch, grad_scale, inject, moe_scale, router_bias, mtp_scales):
        objective, (ce, z, n, stats) = loss_terms(params, graphdef, batch, z_loss, part, grad_scale, router_bias,
                                                  mtp_scales)
        # What is differentiated: the mean loss times the loss scale (fp16; grad_scale = scale / the
        # global count of counted tokens), times the chaos drill's factor. MoE losses are means
        # already: each microbatch adds its own times scale / microbatches (their mean over them).
        # Multi-token prediction's comes scaled by scale x weight / (depth x its global counts).
        total = objective * grad_scale
        kept = {}
        if depth:
            total = total + stats["mtp_objective"]
            kept["mtp_ce"] = stats["mtp_ce"]
        if moe:
            balance, router_z = moe_losses(cfg, stats)
            total = total + (balance + router_z) * moe_scale
            kept.update({"moe_aux_loss": balance, "router_z_loss": router_z, "load": stats["load"],
                         "dropped": jnp.sum(stats["dropped"]), "assigned": jnp.sum(stats["assigned"])})
        return total * inject, (ce, z, n, kept if (moe or depth) else stats)

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def step(state: State, batch: Batch, chaos: jax.Array):
        params = state["params"]
        inject = chaos if drills else jnp.float32(1.0)  # chaos.nan_at_steps / spike_at_steps; 1 otherwise
        # Context parallelism's zig-zag order (jaxtrain.parallel.context): each device's chunks, once per
        # batch; tokens, targets, positions, segment ids and mask move together, and the loss is a sum.
        mtp_scales = None
        if depth:  # shifted from the batch in sequence order, then permuted and split with it
            batch = mtp.shifted_batch(batch, depth)
        batch = context.permute_batch(batch, part.context)
        # Without fp16 the scale is 1 (precision.init_loss_scale): a constant here, so that no
        # `g / 1` pass copies each (vocab-sized) gradient into a second buffer.
        scale = state["loss_scale"]["scale"] if scaling else jnp.float32(1.0)
        # The loss scale multiplies the *mean* loss: the count of counted tokens of the whole global
        # batch (all microbatches) is known before the backward pass, so the scale's meaning (and
        # the fp16 overflow threshold of a given scale) does not depend on tokens per step.
        denom = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
        grad_scale = scale / denom
        moe_scale = scale / accum
        router_bias = state["moe"]["router_bias"] if moe else None
        if depth:
            mtp_counts = mtp.mtp_counts(batch, depth)
            mtp_scales = scale * cfg.model.mtp_loss_weight / (depth * jnp.maximum(mtp_counts, 1.0))
        if accum == 1:
            (_, (ce, z, tokens, moe_stats)), grads = grad_fn(params, batch, grad_scale, inject, moe_scale, router_bias,
                                                             mtp_scales)
        else:
            def micro(carry, mb):
                (_, (c, zz, n, st)), g = grad_fn(params, mb, grad_scale, inject, moe_scale, router_bias, mtp_scales)
                ce_acc, z_acc, tok_acc, st_acc, grad_acc = carry
                return (ce_acc + c, z_acc + zz, tok_acc + n, jax.tree_util.tree_map(jnp.add, st_acc, st),
                        jax.tree_util.tree_map(jnp.add, grad_acc, g)), None

            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            stats0 = {}
            if moe:
                stats0 = {k: jnp.float32(0) for k in ("moe_aux_loss", "router_z_loss", "dropped", "assigned")}
                stats0["load"] = jnp.zeros(router_bias.shape, jnp.float32)
            if depth:
                stats0["mtp_ce"] = jnp.zeros((depth,), jnp.float32)
            (ce, z, tokens, moe_stats, grads), _ = jax.lax.scan(
                micro, (jnp.float32(0), jnp.float32(0), jnp.float32(0), stats0, zeros),
                split_microbatches(batch, accum, part))
        if scaling:
            grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
        loss = ce * inject / denom  # what a drill injected shows in the loss too
        # Finite from every element, not from the norm: a sum of squares in fp32 overflows for
        # finite gradients (one element above ~1.8e19), which would skip a good step.
        finite = jnp.isfinite(loss) & all_finite(grads)
        grad_norm = global_norm(grads, finite)

        stats = state["stability"]
        spike = spike_check(cfg, stats, loss, grad_norm)
        spike_flag = finite & spike["spike"]
        skip = ~finite | (spike_flag if cfg.stability.skip_spikes else False)
        if not guard:  # stability.guard=false: only to measure what the guard costs (bench/)
            spike_flag, skip = jnp.bool_(False), jnp.bool_(False)

        # A skipped step keeps the old parameters and optimizer state by selection: multiplying the
        # update by zero would not do (0 x NaN is NaN). make_optimizer's optimizer keeps its own
        # state (`optim.guarded_adam`): selecting over its output state here made XLA copy every
        # large Adam moment first (docs/memory.md). The parameters are selected here.
        keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(skip, o, n), new, old)
        if keeps_state_on_skip(optimizer):
            updates, opt_state = optimizer.update(grads, state["opt_state"], params, skip=skip)
        else:
            updates, opt_state = optimizer.update(grads, state["opt_state"], params)
            opt_state = keep(opt_state, state["opt_state"]) if guard else opt_state
        new_params = optax.apply_updates(params, updates)
        new_state = {"step": state["step"] + 1, "params": keep(new_params, params) if guard else new_params,
                     "opt_state": opt_state,
                     "rng": advance_rng(state["rng"], state["step"]),
                     "loss_scale": update_loss_scale(cfg, state["loss_scale"], finite),
                     "stability": update_statistics(cfg, stats, loss, grad_norm, ~skip) if guard else stats}
        moe_metrics = {}
        if moe:  # the routing bias: outside the optimizer, kept on a skipped step like everything else
            rate = cfg.model.router_bias_update_rate
            bias = state["moe"]["router_bias"]
            moved = update_router_bias(bias, moe_stats["load"], rate) if rate > 0 else bias
            new_state["moe"] = {"router_bias": jnp.where(skip, bias, moved)}
            load = moe_stats["load"]
            moe_metrics = {"moe_aux_loss": moe_stats["moe_aux_loss"] / accum,
                           "router_z_loss": moe_stats["router_z_loss"] / accum,
                           "moe_max_load": jnp.max(load / jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)),
                           "moe_dropped_fraction": moe_stats["dropped"] / jnp.maximum(moe_stats["assigned"], 1.0)}
        if depth:  # the mean over the modules of each one's mean cross-entropy
            moe_metrics["mtp_loss"] = jnp.mean(moe_stats["mtp_ce"] / jnp.maximum(mtp_counts, 1.0))
        # The rate this update used (the optimizer's count, which skipped steps do not advance).
        learning_rate = applied_learning_rate(schedule, state["opt_state"])
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate, "tokens": tokens,
                   "loss_scale": state["loss_scale"]["scale"], "next_loss_scale": new_state["loss_scale"]["scale"],
                   "skipped": skip, "nonfinite": ~finite, "spike": spike_flag, "loss_z": spike["loss_z"],
                   "grad_norm_z": spike["grad_norm_z"], "loss_rise": spike["loss_rise"],
                   "loss_divergence": spike["loss_divergence"], "z_loss": z / denom,
                   "skipped_steps": new_state["stability"]["skipped_steps"], **moe_metrics}
        return (new_state, metrics, grads) if return_grads else (new_state, metrics)

    return step


def make_eval_step(graphdef: nnx.GraphDef, part: Partitioning = Partitioning()
                   ) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """(params, batch[, router_bias]) -> (loss sum, token count) without gradients.

    `part`: the mesh, rules and pipeline schedule (`partitioning(cfg, mesh, rules)`); without a
    schedule the layers still compute the same loss, as one scan over stage-sharded weights.
    `router_bias`: a mixture of experts' routing bias (the state's `moe.router_bias`; zeros when absent).
    """
    def eval_step(params, batch, router_bias=None):
        batch = context.permute_batch(batch, part.context)
        _, (ce, _, tokens, _) = loss_terms(params, graphdef, batch, part=part, router_bias=router_bias)
        return ce, tokens
    return eval_step
