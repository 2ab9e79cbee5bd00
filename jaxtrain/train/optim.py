"""The optimizers behind optim.name (adamw, adafactor, lion, sgd, schedule_free; muon in muon.py),
each behind global-norm clipping, with the learning-rate schedule of jaxtrain/train/schedules.py,
the weight-decay mask (optim.weight_decay_mask), and the rate an update actually used
(`applied_learning_rate`). docs/optim.md is the user's page.

Every optimizer's `update` takes a `skip` keyword (the train step's guard): a skipped step returns
the old state, bitwise, and updates that the step discards. adamw's state tree is optax's adamw's.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxtrain.config import Config, ConfigError
from jaxtrain.model import llama
from jaxtrain.parallel.sharding import Partitioning
# The learning-rate schedule (optim.schedule) lives in schedules.py; re-exported for its callers.
from jaxtrain.train.schedules import learning_rate_schedule, schedule_steps  # noqa: F401
from jaxtrain.train.skip_contract import (_guarded, _keep, guarded_adam, keeps_state_on_skip,  # noqa: F401
                                          kept_on_skip)


# Logical axes that stack independent parameters rather than being one of a parameter's own dims: the
# scanned layers (and the dense, MTP kinds of them) and a mixture of experts' experts.
STACKING_AXES = ("layers", "dense_layers", "mtp_layers", "experts")


def is_matrix(names: tuple) -> bool:
    """Whether a parameter with logical axes `names` is a matrix: two or more dims of its own.

    Not counted: the stacking axes (STACKING_AXES: one matrix per layer and per expert), and
    `head_dim` beside `heads`/`kv_heads` (a projection's heads x head_dim is one output dim, as in
    [D, N * H]). So wq [layers, D, N, H] and w_up [layers, E, D, F] are matrices; a bias bq
    [layers, N, H], an expert bias [layers, E, F], norm scales and attention sinks are not.
    """
    own = [n for n in names if n not in STACKING_AXES]
    if "head_dim" in own and ("heads" in own or "kv_heads" in own):
        own.remove("head_dim")
    return len(own) >= 2


def _key_names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def weight_decay_mask(rule: str, params: Any, logical: Any = None) -> Any:
    """Which leaves of `params` decay (True) under optim.weight_decay_mask `rule`, as a tree like `params`.

    all_but_norms: every parameter but those with 'norm' in a key of their path (norm scales);
      embeddings, biases and sinks decay (the rule of every run before the key existed).
    matrices: the parameters `is_matrix` names from their logical axes (`logical`: a tree of axis-name
      tuples with `params`'s dict keys, `jaxtrain.model.llama.logical_axes`'s); no norms, biases, sinks
      or per-expert biases; embeddings and the output head do decay.
    none: nothing.
    Every optimizer uses it (`make_optimizer`).
    """
    if rule == "all_but_norms":
        return jax.tree_util.tree_map_with_path(lambda path, _: not any("norm" in k for k in _key_names(path)),
                                                params)
    if rule == "none":
        return jax.tree_util.tree_map(lambda _: False, params)
    if rule == "matrices":
        if logical is None:
            raise ValueError("weight_decay_mask('matrices') needs the parameters' logical axes")

        def lookup(path, _):
            node = logical
            for k in path:  # by key, so that optax's params placeholders (no leaves) map too
                node = node[getattr(k, "key", getattr(k, "idx", None))]
            return is_matrix(tuple(node))
        return jax.tree_util.tree_map_with_path(lookup, params)
    raise ConfigError(f"config key 'optim.weight_decay_mask' must be all_but_norms, matrices or none, got '{rule}'")


def model_logical_axes(cfg: Config) -> dict:
    """The logical axes of cfg.model's parameters (shapes only: nothing is allocated)."""
    return llama.model_logical_axes(cfg.model)


def decay_mask_fn(cfg: Config) -> Callable[[Any], Any]:
    """params -> `weight_decay_mask` under optim.weight_decay_mask, for cfg.model's parameter tree."""
    rule = cfg.optim.weight_decay_mask
    logical = model_logical_axes(cfg) if rule == "matrices" else None
    return lambda params: weight_decay_mask(rule, params, logical)


def make_optimizer(cfg: Config, part: Partitioning | None = None) -> optax.GradientTransformation:
    """optim.name's optimizer behind global-norm clipping, with the learning-rate schedule and
    decoupled weight decay (optim.weight_decay x the rate, on `weight_decay_mask`'s leaves).
    `part`: the parameters' mesh and rules, which muon uses to place its Newton-Schulz iteration
    (the others ignore it; None: no placement).

    Every optimizer keeps its state bitwise on `update(..., skip=True)` and holds the schedule's
    count once (`applied_learning_rate`). adamw's state tree is optax.adamw's (checkpoints of every
    earlier run restore). docs/optim.md describes each.
    """
    o = cfg.optim
    builders = {"adamw": _adamw, "adafactor": _adafactor, "lion": _lion, "sgd": _sgd,
                "schedule_free": _schedule_free, "muon": lambda c, mask: _muon(c, mask, part)}
    if o.name not in builders:
        raise ConfigError(f"config key 'optim.name' must be one of {', '.join(builders)}, got '{o.name}'")
    parts = [clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm > 0 else []
    parts.append(builders[o.name](cfg, decay_mask_fn(cfg)))
    return _guarded(optax.chain(*parts))


def _adamw(cfg: Config, mask: Callable) -> optax.GradientTransformationExtraArgs:
    o = cfg.optim
    # optax.adamw's own chain (so its state tree, and checkpoints, stay the same), with the Adam
    # moments and the schedule's count kept on a skipped step.
    return optax.chain(
        guarded_adam(o.b1, o.b2, o.eps),
        optax.add_decayed_weights(o.weight_decay, mask),
        kept_on_skip(optax.scale_by_learning_rate(learning_rate_schedule(cfg))))


def _adafactor(cfg: Config, mask: Callable) -> optax.GradientTransformationExtraArgs:
    """optax.adafactor's chain, but with the weight decay before the rate (decoupled, x the rate, as
    AdamW's; optax adds it after, undamped) and no momentum."""
    o = cfg.optim
    parts = [optax.scale_by_factored_rms(decay_rate=o.adafactor_decay_rate,
                                         min_dim_size_to_factor=o.adafactor_min_dim_to_factor),
             optax.clip_by_block_rms(1.0)]
    if o.adafactor_param_scale:
        parts.append(optax.scale_by_param_block_rms())
    parts += [optax.add_decayed_weights(o.weight_decay, mask),
              optax.scale_by_learning_rate(learning_rate_schedule(cfg))]
    return kept_on_skip(optax.chain(*parts))


def _lion(cfg: Config, mask: Callable) -> optax.GradientTransformationExtraArgs:
    o = cfg.optim
    return kept_on_skip(optax.lion(learning_rate_schedule(cfg), b1=o.lion_b1, b2=o.lion_b2,
                                   weight_decay=o.weight_decay, mask=mask))


def _sgd(cfg: Config, mask: Callable) -> optax.GradientTransformationExtraArgs:
    """SGD with (optionally Nesterov) momentum; the weight decay added after the momentum (decoupled)."""
    o = cfg.optim
    parts = [optax.trace(decay=o.sgd_momentum, nesterov=o.sgd_nesterov)] if o.sgd_momentum > 0 else []
    parts += [optax.add_decayed_weights(o.weight_decay, mask),
              optax.scale_by_learning_rate(learning_rate_schedule(cfg))]
    return kept_on_skip(optax.chain(*parts))


def _schedule_free(cfg: Config, mask: Callable) -> optax.GradientTransformationExtraArgs:
    """optax.contrib.schedule_free_adamw's construction (Adam without momentum inside schedule_free,
    b1 the interpolation) with the decay mask and one schedule count. The parameters it trains are
    y, the gradient point; the averaged x that the paper evaluates is `evaluation_params`."""
    o = cfg.optim
    schedule = learning_rate_schedule(cfg)
    base = optax.chain(optax.scale_by_rms(decay=o.b2, eps=o.eps, eps_in_sqrt=False, bias_correction=True),
                       optax.add_decayed_weights(o.weight_decay, mask),
                       optax.scale_by_learning_rate(schedule))
    return kept_on_skip(optax.contrib.schedule_free(base, learning_rate=schedule, b1=o.b1))


def _muon(cfg: Config, mask: Callable, part: Partitioning | None = None) -> optax.GradientTransformationExtraArgs:
    try:
        from jaxtrain.train import muon as muon_module
    except ImportError:
        muon_module = None
    if muon_module is None or not hasattr(muon_module, "muon"):
        raise ConfigError("optim.name=muon is not built yet (jaxtrain/train/muon.py)")
    return muon_module.muon(cfg, mask, part)


def evaluation_params(opt_state: Any, params: Any) -> Any:
    """The parameters to evaluate or export: `params` itself, except under optim.name=schedule_free,
    whose trained parameters are y and whose averaged x = (y - (1 - b1) z) / b1 is what the paper
    evaluates (optax.contrib.schedule_free_eval_params). The trainer's evaluation and export use
    `params` (y) as they are: docs/optim.md."""
    is_sf = lambda x: isinstance(x, optax.contrib.ScheduleFreeState)
    found = [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=is_sf) if is_sf(s)]
    return optax.contrib.schedule_free_eval_params(found[0], params) if found else params


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm's effect and state (EmptyState), as one scalar factor.

    Every gradient is multiplied by min(1, max_norm / norm): bitwise the gradient when it is not
    clipped. optax selects per element between the gradient and `g / norm * max_norm`, which keeps
    both alive into the Adam update: on jax 0.12's XLA that is one more gradient-sized buffer per
    large parameter at the step's peak (docs/memory.md).
    """
    def update(updates, state, params=None):
        del params
        norm = optax.global_norm(updates)
        factor = jnp.minimum(1.0, max_norm / norm)  # a zero norm gives inf, so 1
        return jax.tree_util.tree_map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def applied_learning_rate(schedule: optax.Schedule, opt_state: Any) -> jax.Array:
    """The learning rate this step's update uses: the schedule at the optimizer's own count.

    optax's schedule (`ScaleByScheduleState.count`) counts applied updates, not train steps: a
    skipped step keeps the old optimizer state, count included, so after k skipped steps step N
    uses schedule(N - 1 - k), not schedule(N - 1). Reporting the train step's value would show a
    rate that no update used.

    Raises:
      ValueError: the optimizer state holds no schedule count, or more than one.
    """
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
    counts = [s.count for s in jax.tree_util.tree_leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
    if len(counts) != 1:
        raise ValueError(f"expected one ScaleByScheduleState in the optimizer state, found {len(counts)}")
    return schedule(counts[0])
