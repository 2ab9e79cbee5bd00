"""A trained run, read back: its directory (local or gs:// / s3://), its config, the parameters of
one of its checkpoints and the tokenizer its data was made with. `export-hf` writes them out as a
Hugging Face directory; `jaxtrain generate`, `eval` and `lm-eval` run them (jaxtrain.infer).
Nothing here writes.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from jaxtrain.config import TOKENIZED_SOURCES, Config, ConfigError, from_dict, load_config
from jaxtrain.storage import object_store, small_files
from jaxtrain.storage.paths import is_remote, join


def resolve_run(run_dir: str, key: str) -> str:
    """`run_dir` as read: a URL (its bucket's access checked, `key` named in the error) or an
    absolute local path."""
    if is_remote(run_dir):
        object_store.check_access(run_dir, key=key)
        return run_dir.rstrip("/")
    return os.path.abspath(os.path.expanduser(run_dir))


def parent_folder(folder: str) -> Optional[str]:
    """The folder above a local path or a URL; None above a bucket's root or the filesystem root."""
    if is_remote(folder):
        scheme, bucket, key = object_store.split_url(folder)
        if not key:
            return None
        up = posixpath.dirname(key)
        return f"{scheme}://{bucket}/{up}" if up else f"{scheme}://{bucket}"
    up = os.path.dirname(folder)
    return up if up != folder else None


def find_up(start: Optional[str], name: str, levels: int = 3, *, key: str = "checkpoint.init_from") -> Optional[str]:
    """The folder at or above `start` (a run dir, checkpoints/ or step folder) that holds `name`,
    local or in a bucket (whose access is checked first: `key` names the setting in the error)."""
    if not start:
        return None
    if is_remote(start):
        object_store.check_access(start, key=key)
        folder: Optional[str] = start.rstrip("/")
    else:
        folder = os.path.abspath(os.path.expanduser(start))
    for _ in range(levels):
        if folder is None:
            return None
        if small_files.is_file(join(folder, name)):
            return folder
        folder = parent_folder(folder)
    return None


def load_run_config(run: str, where: str, verb: str = "export-hf") -> Config:
    """The run's config.yaml (a local file or an object), validated like `load_config`; an
    import-hf directory's config, whose data is not chosen, is accepted (only the model matters)."""
    path = join(run, "config.yaml")
    if not small_files.is_file(path):
        raise ConfigError(f"{verb}: '{where}' has no config.yaml (expected a jaxtrain run directory)")
    if not is_remote(path):
        return load_config(path, need_data=False)
    try:
        data = yaml.safe_load(small_files.read_bytes(path).decode())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    return from_dict(data, need_data=False)


def token_meta(spec: str) -> Optional[dict]:
    """The meta.json of the token files `spec` names (data.path), or None when there is none here
    (no meta.json, or files on another machine)."""
    from jaxtrain.data.sources import META_NAME, TOKEN_SUFFIXES, read_meta, resolve_paths

    try:
        files = resolve_paths(spec, "data.path", TOKEN_SUFFIXES)
    except ConfigError:
        return None
    for folder in dict.fromkeys(f.parent for f in files):
        if (folder / META_NAME).is_file():
            return read_meta(folder / META_NAME)
    return None


def run_tokenizer(cfg: Config) -> tuple[Optional[str], Optional[int], bool]:
    """(tokenizer, eod id, known) of the data the run trained on.

    tokenizer is 'bytes', a tokenizers JSON path or None; eod id is None when unknown. `known` is
    True when the data fixes the tokenizer (tokens or text); for markov (and an import's unchosen
    data) the tokenizer is only `data.tokenizer`, the model's own at best.
    """
    from jaxtrain.data.tokenizer import BYTES_EOD_ID, load_tokenizer

    d = cfg.data
    if d.source == "tokens" and d.path:
        meta = token_meta(d.path)
        if meta is not None:  # what prepare-data tokenized with: the resolved path, or 'bytes'
            return meta.get("tokenizer"), meta["eod_id"], True
    spec = d.tokenizer
    if spec == "bytes":  # token files without meta.json may come from anywhere: not known
        return ("bytes", BYTES_EOD_ID, True) if d.source in TOKENIZED_SOURCES else (None, d.eod_id, False)
    known = d.source == "tokens" or d.source in TOKENIZED_SOURCES
    if is_remote(spec) or not Path(spec).expanduser().is_file():
        return spec, d.eod_id, known  # gone since training: reported, not copied
    return spec, load_tokenizer(spec, d.eod_id).eod_id, known


def checkpoint_folder(run_dir: str, step: Optional[int]) -> tuple[str, int]:
    """(the folder of checkpoint `step` of the run, the step); default: the latest good one.

    Raises:
      ConfigError: no committed checkpoint, or `step` is not a usable one (the good steps named).
    """
    from jaxtrain.checkpoint.layout import check_checkpoint, latest_good, scan
    from jaxtrain.storage.paths import to_path

    root = to_path(join(run_dir, "checkpoints"))
    if step is None:
        damaged: list[str] = []
        step = latest_good(root, report=lambda s, reason: damaged.append(f"step {s}: {reason}"))
        if step is None:
            why = f"; {', '.join(damaged)}" if damaged else ""
            raise ConfigError(f"'{run_dir}' holds no committed checkpoint (looked in {root}{why})")
    else:
        good, reason, _ = check_checkpoint(root / str(step))
        if not good:
            steps = [s for s, p, tmp in scan(root) if not tmp and check_checkpoint(p)[0]]
            raise ConfigError(f"checkpoint step {step} of '{run_dir}' is not usable ({reason}); "
                              f"good steps: {', '.join(map(str, steps)) or 'none'}")
    return os.fspath(root / str(step)), step


def restore_params(run_dir: str, cfg: Config, step: Optional[int], shardings: Any = None) -> tuple[dict, int]:
    """(the parameters of checkpoint `step` (default: latest good), the step).

    shardings: None: host fp32 numpy arrays (export, or a notebook); else a tree of shardings like
    the parameters' (`StateLayout.param_shardings`), into which every process reads its shards.
    """
    import jax
    from flax import nnx

    from jaxtrain.checkpoint.checkpointer import restore_params_only
    from jaxtrain.model.llama import Transformer

    folder, step = checkpoint_folder(run_dir, step)
    abstract = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[1])
    if shardings is not None:
        abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, np.float32, sharding=s),
                                          abstract, shardings)
        return restore_params_only(folder, abstract), step
    sharding = jax.sharding.SingleDeviceSharding(host_device())
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32, sharding=sharding), abstract)
    params = restore_params_only(folder, abstract)
    return jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x), np.float32), params), step


def restore_router_bias(run_dir: str, cfg: Config, step: int, sharding: Any = None) -> Any:
    """An MoE run's routing bias [MoE layers, E] at checkpoint `step` (None for a dense model, or a
    checkpoint written without one, such as an import's: zeros then)."""
    import jax

    from jaxtrain.checkpoint.checkpointer import restore_params_only, saved_entries

    m = cfg.model
    if not m.num_experts:
        return None
    folder, _ = checkpoint_folder(run_dir, step)
    if "moe" not in saved_entries(folder):  # an import-hf checkpoint holds parameters only
        return None
    shape = jax.ShapeDtypeStruct((m.num_moe_layers, m.num_experts), np.float32,
                                 sharding=sharding or jax.sharding.SingleDeviceSharding(host_device()))
    return restore_params_only(folder, {"router_bias": shape}, subtree="moe")["router_bias"]


def host_device() -> Any:
    """A CPU device when there is one: reading a checkpoint to the host must not fill an accelerator."""
    import jax

    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]
