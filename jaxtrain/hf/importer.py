"""`jaxtrain import-hf SRC --output DIR`: a Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE directory ->
a jaxtrain directory."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import yaml

from jaxtrain.config import Config, ConfigError, from_dict
from jaxtrain.hf.files import (HF_CONFIG, SafetensorsReader, check_tensors, copy_tokenizer, finish, fresh_output,
                               read_hf_config, refuse_url, writing)
from jaxtrain.hf.mapping import model_section_from_hf, params_from_hf


def import_hf(source: str, output: str) -> dict:
    """Convert a Hugging Face directory (Llama, Mixtral, Qwen3, Qwen3-MoE) into a jaxtrain directory
    (layout: see `jaxtrain.hf`).

    Args:
      source: local directory with config.json and *.safetensors (plus tokenizer files, optional).
      output: new local directory (must not exist, or be empty).
    Returns:
      Summary: output, num_params, source_dtype, files (safetensors read), tokenizer (files copied).
    Raises:
      ConfigError: missing/invalid source, a field or tensor jaxtrain cannot represent, an
        existing output, or a URL for either. Raised before anything is written.
    """
    refuse_url(source, "import-hf SRC", "download it first: gcloud storage cp -r / aws s3 cp --recursive")
    # An import copied into s3:// would not be readable there (docs/checkpoint.md): keep it local
    # or on a shared filesystem, and start runs from it with checkpoint.init_from.
    refuse_url(output, "import-hf --output", "write it locally or on a shared filesystem; a run in a bucket "
               "starts from it with checkpoint.init_from=DIR")
    src = Path(source).expanduser()
    hf, model, params, source_dtype, files = read_hf(source)
    out, tmp = fresh_output(output)
    tokenizer = out / "tokenizer.json" if (src / "tokenizer.json").is_file() else None
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", src.absolute().name) or "hf"
    cfg = from_dict({
        "run": {"name": name, "output_dir": f"runs/{name}"},
        "model": model,
        # No data source: training refuses until one is named (config.DATA_NOT_CHOSEN), so the
        # imported model is never fine-tuned on the default synthetic Markov chain by accident.
        "data": {"source": None, "seq_len": min(128, model["max_seq_len"]),
                 **({"tokenizer": os.fspath(tokenizer)} if tokenizer else {})},
        # A run from this config starts from the imported weights unless told otherwise.
        "checkpoint": {"init_from": os.fspath(out)},
    }, need_data=False)
    num_params = sum(x.size for x in _leaves(params))
    with writing(tmp):
        header = (f"# Imported from {src.absolute()} by `jaxtrain import-hf` ({num_params:,} parameters).\n"
                  f"# Train: jaxtrain train --config {out / 'config.yaml'} data.source=text|tokens data.path=... "
                  "run.output_dir=...\n")
        (tmp / "config.yaml").write_text(header + _with_source_comment(yaml.safe_dump(cfg.to_dict(), sort_keys=False)))
        (tmp / HF_CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
        copied = copy_tokenizer(src, tmp)
        _save_params(tmp / "checkpoints", params, {"source": os.fspath(src.absolute()), "source_dtype": source_dtype})
        finish(tmp, out)
    return {"output": os.fspath(out), "num_params": num_params, "source_dtype": source_dtype,
            "files": files, "tokenizer": copied}


def model_only_config(model: dict) -> Config:
    """A config around a model section alone: no data chosen (training refuses it until named),
    a sequence length the model allows."""
    return from_dict({"model": model, "data": {"source": None, "seq_len": min(128, model["max_seq_len"])}},
                     need_data=False)


def read_hf(source: str, what: str = "import-hf source") -> tuple[dict, dict, dict, str, list[str]]:
    """A Hugging Face directory read into memory: (its config.json, the jaxtrain model section,
    the parameters as fp32 numpy arrays, the source dtype, the safetensors files read).

    Raises:
      ConfigError: not a directory, or a field or tensor jaxtrain cannot represent (`what` names it).
    """
    src = Path(source).expanduser()
    if not src.is_dir():
        raise ConfigError(f"{what} '{source}' does not exist or is not a directory")
    hf = read_hf_config(src)
    model = model_section_from_hf(hf)
    model_cfg = model_only_config(model).model
    with contextlib.ExitStack() as stack:
        reader = SafetensorsReader(src, stack)
        source_dtype = check_tensors(reader, model_cfg)
        params = params_from_hf(reader.get, model_cfg)
        files = reader.files
    return hf, model, params, source_dtype, files


def _with_source_comment(text: str) -> str:
    """The dumped config with a comment on `data.source: null` saying what to choose."""
    note = "  source: null  # choose: text or tokens (with data.path), or markov (synthetic); training refuses null"
    return text.replace("\ndata:\n  source: null\n", f"\ndata:\n{note}\n", 1)


def _leaves(tree: dict) -> Iterator[np.ndarray]:
    for v in tree.values():
        if isinstance(v, dict):
            yield from _leaves(v)
        else:
            yield v


def _save_params(directory: Path, params: dict, extra: dict) -> None:
    """Write `{"params": params}` as committed checkpoint 0 with jaxtrain's Checkpointer, so
    restore_params_only, `jaxtrain checkpoints` and discovery treat it like any other."""
    from jaxtrain.checkpoint.checkpointer import Checkpointer
    from jaxtrain.config import CheckpointConfig

    with Checkpointer(os.fspath(directory), CheckpointConfig(async_save=False)) as ckpt:
        if not ckpt.save(0, {"params": params}, {"hf_import": extra}):
            raise ConfigError("the source weights hold NaN or Inf values; nothing was imported")
