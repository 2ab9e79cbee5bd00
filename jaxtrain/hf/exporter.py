"""`jaxtrain export-hf RUN_DIR --output DST`: a run's parameters -> a Hugging Face Llama directory.

RUN_DIR may be local or a gs:// / s3:// URL (a run trained into a bucket): config.yaml,
hf_config.json and the tokenizer files are read as objects, the checkpoint through the same
restore path as `checkpoint.init_from`. The output is always a local directory.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from jaxtrain.storage import object_store, small_files
from jaxtrain.storage.paths import is_remote, join
from jaxtrain.config import Config, ConfigError, from_dict, load_config
from jaxtrain.hf.files import (DTYPES, HF_CONFIG, copy_tokenizer, finish, fresh_output, parse_size, refuse_url,
                               write_generation_config, write_safetensors, write_tokenizer, writing)
from jaxtrain.hf.mapping import HF_DTYPE_NAMES, hf_config_from_model, hf_tensors_from_params


def _parent(folder: str) -> Optional[str]:
    """The folder above a local path or a URL; None above a bucket's root or the filesystem root."""
    if is_remote(folder):
        scheme, bucket, key = object_store.split_url(folder)
        if not key:
            return None
        up = posixpath.dirname(key)
        return f"{scheme}://{bucket}/{up}" if up else f"{scheme}://{bucket}"
    up = os.path.dirname(folder)
    return up if up != folder else None


def _find_up(start: Optional[str], name: str, levels: int = 3, *, key: str = "checkpoint.init_from") -> Optional[str]:
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
        folder = _parent(folder)
    return None


def _load_run_config(run: str, where: str) -> Config:
    """The run's config.yaml (a local file or an object), validated like `load_config`; an
    import-hf directory's config, whose data is not chosen, is accepted (only the model matters)."""
    path = join(run, "config.yaml")
    if not small_files.is_file(path):
        raise ConfigError(f"export-hf: '{where}' has no config.yaml (expected a jaxtrain run directory)")
    if not is_remote(path):
        return load_config(path, need_data=False)
    try:
        data = yaml.safe_load(small_files.read_bytes(path).decode())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    return from_dict(data, need_data=False)


def _token_meta(spec: str) -> Optional[dict]:
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


def _run_tokenizer(cfg: Config) -> tuple[Optional[str], Optional[int], bool]:
    """(tokenizer, eod id, known) of the data the run trained on.

    tokenizer is 'bytes', a tokenizers JSON path or None; eod id is None when unknown. `known` is
    True when the data fixes the tokenizer (tokens or text); for markov (and an import's unchosen
    data) the tokenizer is only `data.tokenizer`, the model's own at best.
    """
    from jaxtrain.data.tokenizer import BYTES_EOD_ID, load_tokenizer

    d = cfg.data
    if d.source == "tokens" and d.path:
        meta = _token_meta(d.path)
        if meta is not None:  # what prepare-data tokenized with: the resolved path, or 'bytes'
            return meta.get("tokenizer"), meta["eod_id"], True
    spec = d.tokenizer
    if spec == "bytes":  # token files without meta.json may come from anywhere: not known
        return ("bytes", BYTES_EOD_ID, True) if d.source == "text" else (None, d.eod_id, False)
    known = d.source in ("tokens", "text")
    if is_remote(spec) or not Path(spec).expanduser().is_file():
        return spec, d.eod_id, known  # gone since training: reported, not copied
    return spec, load_tokenizer(spec, d.eod_id).eod_id, known


def _restore_params(run_dir: str, cfg: Config, step: Optional[int]) -> tuple[dict, int]:
    """The parameters of checkpoint `step` (default: latest good) as host fp32 arrays."""
    import jax
    from flax import nnx

    from jaxtrain.checkpoint.layout import check_checkpoint
    from jaxtrain.checkpoint.checkpointer import restore_params_only
    from jaxtrain.checkpoint.layout import latest_good, scan
    from jaxtrain.storage.paths import to_path
    from jaxtrain.model.llama import Transformer

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
    abstract = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[1])
    try:  # host memory: export must not need (or fill) an accelerator
        device = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        device = jax.local_devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32, sharding=sharding), abstract)
    params = restore_params_only(os.fspath(root / str(step)), abstract)
    return jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x), np.float32), params), step


def export_hf(run_dir: str, output: str, *, step: Optional[int] = None, dtype: Optional[str] = None,
              max_shard_size: str = "5GB") -> dict:
    """Write a run's parameters as a Hugging Face Llama directory.

    Args:
      run_dir: a jaxtrain run directory (config.yaml + checkpoints/), or an import-hf directory;
        local, or a gs:// / s3:// URL.
      output: new local directory (must not exist, or be empty).
      step: checkpoint step to export (default: the latest good one).
      dtype: 'fp32', 'bf16' or 'fp16' (default: the imported source's dtype, else fp32).
      max_shard_size: above this many bytes the weights are split into shards with an index.
    Returns:
      Summary: output, step, dtype, files, tokenizer (files copied or written), eos_token_id (or
      None), missing_tokenizer (the path of a tokenizer the run used that is no longer there, or None).
    Raises:
      ConfigError: no config.yaml or usable checkpoint, a config that does not match the
        checkpoint, an fp16 overflow, an existing or remote output, or a bucket that cannot be
        read. Nothing is written then.
    """
    refuse_url(output, "export-hf --output", "write it locally, then upload it if needed")
    if is_remote(run_dir):
        object_store.check_access(run_dir, key="export-hf RUN_DIR")
        run = run_dir.rstrip("/")
    else:
        run = os.path.abspath(os.path.expanduser(run_dir))
    cfg = _load_run_config(run, run_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    # The imported source's config.json: here (an import dir) or where the run started from.
    hf_home = _find_up(run, HF_CONFIG, 1, key="export-hf RUN_DIR") or _find_up(cfg.checkpoint.init_from, HF_CONFIG)
    source = json.loads(small_files.read_bytes(join(hf_home, HF_CONFIG))) if hf_home else {}
    if dtype is None:
        names = {v: k for k, v in HF_DTYPE_NAMES.items()}
        dtype = names.get(source.get("dtype") or source.get("torch_dtype"), "fp32")
    out, tmp = fresh_output(output)
    params, step = _restore_params(run, cfg, step)
    tensors = []
    for name, t in hf_tensors_from_params(params, cfg.model):
        cast = t.astype(DTYPES[dtype])  # round to nearest even, as torch's .to(bfloat16)
        if dtype == "fp16" and not np.isfinite(cast).all():
            raise ConfigError(f"tensor '{name}' overflows fp16 (largest |value| {np.abs(t).max():.4g}); "
                              "export with --dtype bf16 or fp32")
        tensors.append((name, cast))
    del params
    # The tokenizer the run trained with: a Hugging Face tokenizer folder (an import's) is copied
    # as it is; a bare tokenizers file (prepare-data's) gets a tokenizer_config.json around it.
    # Without one (markov data), the imported source's files.
    tokenizer, eod_id, known = _run_tokenizer(cfg)
    tokenizer_home: Optional[str] = None
    bare: Optional[Path] = None
    missing: Optional[str] = None
    local = Path(tokenizer).expanduser() if tokenizer and tokenizer != "bytes" and not is_remote(tokenizer) else None
    if local is not None and local.is_file():
        if local.name == "tokenizer.json" and (local.parent / "tokenizer_config.json").is_file():
            tokenizer_home = os.fspath(local.parent)
        else:
            bare = local
    elif tokenizer and tokenizer != "bytes" and known:  # the data's own tokenizer, not merely data.tokenizer
        missing = tokenizer
    if tokenizer_home is None and bare is None and not known and hf_home is not None:
        tokenizer_home = hf_home
    hf_config = hf_config_from_model(cfg.model, dtype, source)
    if eod_id is not None and "eos_token_id" not in hf_config:
        # The source's ids win (they are its convention); else the eod id, the only boundary the
        # model has seen: bos and pad too, as the tokenizer_config.json written below says.
        hf_config.update(bos_token_id=eod_id, eos_token_id=eod_id, pad_token_id=eod_id)
    with writing(tmp):
        files = write_safetensors(tensors, tmp, max_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        copied = copy_tokenizer(tokenizer_home, tmp) if tokenizer_home else []
        if bare is not None and eod_id is not None:  # a bare file always comes with an eod id (_run_tokenizer)
            copied += write_tokenizer(bare, eod_id, tmp, cfg.model.max_seq_len)
        ids = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config}
        if "generation_config.json" not in copied and "eos_token_id" in ids:
            copied.append(write_generation_config(ids, tmp))
        finish(tmp, out)
    return {"output": os.fspath(out), "step": step, "dtype": dtype, "files": files, "tokenizer": copied,
            "eos_token_id": hf_config.get("eos_token_id"), "missing_tokenizer": missing}


def main(argv: list[str]) -> int:
    """`jaxtrain export-hf RUN_DIR --output DST [--step N] [--dtype ...]` (argv without the
    subcommand). Returns 0; user errors raise ConfigError (exit 2)."""
    parser = argparse.ArgumentParser(prog="jaxtrain export-hf",
                                     description="Write a run's parameters as a Hugging Face Llama checkpoint "
                                                 "(config.json + safetensors) for transformers.")
    parser.add_argument("run_dir", help="jaxtrain run directory (config.yaml + checkpoints/): a local path, "
                                        "gs://BUCKET/PATH or s3://BUCKET/PATH")
    parser.add_argument("--output", required=True, help="new local directory to write (must not exist or be empty)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest good one)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="tensor dtype (default: the imported source's, else fp32)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="split the weights into shards with an index above this size (default 5GB)")
    args = parser.parse_args(argv)
    # Conversion is host work: keep JAX off an accelerator that a training job may be using.
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    s = export_hf(args.run_dir, args.output, step=args.step, dtype=args.dtype, max_shard_size=args.max_shard_size)
    gone = s["missing_tokenizer"]
    missing = f" (the run's tokenizer '{gone}' is not there any more)" if gone else ""
    eos = "no eos id" if s["eos_token_id"] is None else f"eos id {s['eos_token_id']}"
    print(f"export-hf: step {s['step']} as {s['dtype']} into {s['output']} ({len(s['files'])} file(s)); "
          f"tokenizer: {', '.join(s['tokenizer']) or 'no files'}{missing}; {eos}")
    return 0
