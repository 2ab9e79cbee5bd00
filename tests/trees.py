"""Comparing pytrees in tests: structure first, then every leaf by name (and a run's final parameters).

`zip(tree_leaves(a), tree_leaves(b))` silently pairs the wrong leaves when the structures differ
(or stops at the shorter one); these helpers fail instead, naming the leaf.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np


def rel_err(a, b) -> float:
    """max |a - b| / max |b| over a whole tensor."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def named_leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]}


def assert_same_structure(got, want) -> None:
    got_s, want_s = jax.tree_util.tree_structure(got), jax.tree_util.tree_structure(want)
    assert got_s == want_s, f"tree structures differ:\n{got_s}\n{want_s}"


def assert_trees_close(got, want, rel: float, what: str = "") -> None:
    """Same structure and, leaf by leaf, max|got - want| <= rel * max|want|."""
    assert_same_structure(got, want)
    a, b = named_leaves(got), named_leaves(want)
    for name in b:
        assert a[name].shape == b[name].shape, (what, name, a[name].shape, b[name].shape)
        err = rel_err(a[name], b[name])
        assert err <= rel, f"{what}{name}: relative error {err:.3g} > {rel:g}"


def assert_trees_equal(got, want, what: str = "") -> None:
    """Same structure and bitwise-equal leaves."""
    assert_same_structure(got, want)
    a, b = named_leaves(got), named_leaves(want)
    for name in b:
        assert np.array_equal(a[name], b[name]), f"{what}{name} differs"


def assert_trees_differ(got, want, rel: float, what: str = "") -> None:
    """Every leaf moved by more than `rel` (relative): a comparison that follows is not trivial."""
    assert_same_structure(got, want)
    a, b = named_leaves(got), named_leaves(want)
    for name in b:
        assert rel_err(a[name], b[name]) > rel, f"{what}{name} did not change"


def final_params(run_dir: Path) -> dict:
    """The parameters of a run directory's latest checkpoint, on one device (layout-free)."""
    from flax import nnx

    from jaxtrain.checkpoint.checkpointer import restore_params_only
    from jaxtrain.config import load_config
    from jaxtrain.model.llama import Transformer

    cfg = load_config(Path(run_dir) / "config.yaml", ["checkpoint.compilation_cache_dir=null"])
    abstract = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[1])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
    return jax.device_get(restore_params_only(str(run_dir), abstract))
