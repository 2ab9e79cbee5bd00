"""`jaxtrain export-hf RUN_DIR --output DST`: a run's parameters -> a Hugging Face Llama directory."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from jaxtrain.config import Config, ConfigError, load_config
from jaxtrain.hf.files import (DTYPES, HF_CONFIG, copy_tokenizer, finish, fresh_output, parse_size, writing,
                               write_safetensors)
from jaxtrain.hf.mapping import HF_DTYPE_NAMES, hf_config_from_model, hf_tensors_from_params


def _find_up(start: Optional[str], name: str, levels: int = 3) -> Optional[Path]:
    """The folder at or above `start` (a run dir, checkpoints/ or step folder) that holds `name`."""
    if not start:
        return None
    p = Path(start).expanduser().absolute()
    for _ in range(levels):
        if (p / name).is_file():
            return p
        p = p.parent
    return None


def _restore_params(run_dir: Path, cfg: Config, step: Optional[int]) -> tuple[dict, int]:
    """The parameters of checkpoint `step` (default: latest good) as host fp32 arrays."""
    import jax
    from flax import nnx

    from jaxtrain.checkpoint import check_checkpoint, restore_params_only
    from jaxtrain.checkpoint.layout import latest_good, scan, to_path
    from jaxtrain.model import Transformer

    root = to_path(os.fspath(run_dir / "checkpoints"))
    if step is None:
        step = latest_good(root)
        if step is None:
            raise ConfigError(f"'{run_dir}' holds no committed checkpoint (looked in {root})")
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
      run_dir: a jaxtrain run directory (config.yaml + checkpoints/), or an import-hf directory.
      output: new directory (must not exist, or be empty).
      step: checkpoint step to export (default: the latest good one).
      dtype: 'fp32', 'bf16' or 'fp16' (default: the imported source's dtype, else fp32).
      max_shard_size: above this many bytes the weights are split into shards with an index.
    Returns:
      Summary: output, step, dtype, files, tokenizer (files copied).
    Raises:
      ConfigError: no config.yaml or usable checkpoint, a config that does not match the
        checkpoint, an fp16 overflow, or an existing output. Nothing is written then.
    """
    run = Path(run_dir).expanduser().absolute()
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"export-hf: '{run_dir}' has no config.yaml (expected a jaxtrain run directory)")
    cfg = load_config(run / "config.yaml")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    # The imported source's config.json: here (an import dir) or where the run started from.
    hf_home = _find_up(os.fspath(run), HF_CONFIG, 1) or _find_up(cfg.checkpoint.init_from, HF_CONFIG)
    source = json.loads((hf_home / HF_CONFIG).read_text()) if hf_home else {}
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
    tokenizer_home = None
    if cfg.data.tokenizer != "bytes" and Path(cfg.data.tokenizer).expanduser().is_file():
        tokenizer_home = Path(cfg.data.tokenizer).expanduser().parent
    elif hf_home is not None:
        tokenizer_home = hf_home
    with writing(tmp):
        files = write_safetensors(tensors, tmp, max_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config_from_model(cfg.model, dtype, source), indent=2) + "\n")
        copied = copy_tokenizer(tokenizer_home, tmp) if tokenizer_home else []
        finish(tmp, out)
    return {"output": os.fspath(out), "step": step, "dtype": dtype, "files": files, "tokenizer": copied}


def main(argv: list[str]) -> int:
    """`jaxtrain export-hf RUN_DIR --output DST [--step N] [--dtype ...]` (argv without the
    subcommand). Returns 0; user errors raise ConfigError (exit 2)."""
    parser = argparse.ArgumentParser(prog="jaxtrain export-hf",
                                     description="Write a run's parameters as a Hugging Face Llama checkpoint "
                                                 "(config.json + safetensors) for transformers.")
    parser.add_argument("run_dir", help="jaxtrain run directory (config.yaml + checkpoints/)")
    parser.add_argument("--output", required=True, help="new directory to write (must not exist or be empty)")
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
    print(f"export-hf: step {s['step']} as {s['dtype']} into {s['output']} ({len(s['files'])} file(s)); "
          f"copied {', '.join(s['tokenizer']) or 'no tokenizer files'}")
    return 0
