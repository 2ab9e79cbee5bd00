"""`jaxtrain import-hf SRC --output DIR`: a Hugging Face Llama, Mixtral, Qwen3 or Qwen3-MoE directory ->
a jaxtrain directory."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from jaxtrain.config import Config, ConfigError, from_dict
from jaxtrain.hf.files import (HF_CONFIG, SafetensorsReader, check_tensors, copy_tokenizer, finish, fresh_output,
                               read_hf_config, refuse_url, writing)
from jaxtrain.hf.mapping import ignored_tensors, model_section_from_hf, param_plan, params_from_hf, router_bias_plan


def import_hf(source: str, output: str) -> dict:
    """Convert a Hugging Face directory (Llama, Mixtral, Qwen3, Qwen3-MoE) into a jaxtrain directory
    (layout: see `jaxtrain.hf`).

    Args:
      source: local directory with config.json and *.safetensors (plus tokenizer files, optional).
      output: new local directory (must not exist, or be empty).
    Returns:
      Summary: output, num_params, source_dtype, files (safetensors read), tokenizer (files copied),
      ignored (tensors skipped: DeepSeek-V3's multi-token prediction layers, which transformers does not run).
    Raises:
      ConfigError: missing/invalid source, a field or tensor jaxtrain cannot represent, an
        existing output, or a URL for either (raised before anything is written), or NaN/Inf
        weights (found while writing; the partial output is removed).

    The weights stream: each parameter is read, converted and written piece by piece
    (`jaxtrain.hf.streaming`), so host memory holds a few pieces, never the model.
    """
    refuse_url(source, "import-hf SRC", "download it first: gcloud storage cp -r / aws s3 cp --recursive")
    # An import copied into s3:// would not be readable there (docs/checkpoint.md): keep it local
    # or on a shared filesystem, and start runs from it with checkpoint.init_from.
    refuse_url(output, "import-hf --output", "write it locally or on a shared filesystem; a run in a bucket "
               "starts from it with checkpoint.init_from=DIR")
    src = Path(source).expanduser()
    with contextlib.ExitStack() as stack:  # the safetensors files stay open while they are read
        hf, model, reader, source_dtype = _open_hf(source, "import-hf source", stack)
        out, tmp = fresh_output(output)
        return _write_import(src, out, tmp, hf, model, reader, source_dtype)


def _write_import(src: Path, out: Path, tmp: Path, hf: dict, model: dict, reader: SafetensorsReader,
                  source_dtype: str) -> dict:
    """The body of `import_hf`: everything written into `tmp`, which is renamed to `out` at the end."""
    from jaxtrain.hf.streaming import PIECE_BYTES, StreamedLeaf, save_streamed

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
    m = model_only_config(model).model
    leaves = [StreamedLeaf(plan, reader.rows) for plan in param_plan(m, PIECE_BYTES, _interleave(hf))]
    # DeepSeek-V3's routing bias: the train state's moe.router_bias, beside the parameters.
    bias = router_bias_plan(m)
    others = {"moe": [StreamedLeaf(bias, reader.rows)]} if bias is not None else None
    num_params = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    with writing(tmp):
        header = (f"# Imported from {src.absolute()} by `jaxtrain import-hf` ({num_params:,} parameters).\n"
                  f"# Train: jaxtrain train --config {out / 'config.yaml'} data.source=text|tokens data.path=... "
                  "run.output_dir=...\n")
        (tmp / "config.yaml").write_text(header + _with_source_comment(yaml.safe_dump(cfg.to_dict(), sort_keys=False)))
        (tmp / HF_CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
        copied = copy_tokenizer(src, tmp)
        save_streamed(tmp / "checkpoints", leaves, {"hf_import": {"source": os.fspath(src.absolute()),
                                                                  "source_dtype": source_dtype}}, others)
        finish(tmp, out)
    return {"output": os.fspath(out), "num_params": num_params, "source_dtype": source_dtype,
            "files": reader.files, "tokenizer": copied, "ignored": reader.ignored}


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
    with contextlib.ExitStack() as stack:
        hf, model, reader, source_dtype = _open_hf(source, what, stack)
        params = params_from_hf(reader.get, model_only_config(model).model, _interleave(hf))
    return hf, model, params, source_dtype, reader.files


def read_hf_router_bias(source: str, what: str = "import-hf source") -> Optional[np.ndarray]:
    """The routing bias [MoE layers, E] fp32 a Hugging Face directory holds (DeepSeek-V3's
    e_score_correction_bias), or None for a family without one."""
    with contextlib.ExitStack() as stack:
        _, model, reader, _ = _open_hf(source, what, stack)
        plan = router_bias_plan(model_only_config(model).model)
        if plan is None:
            return None
        bias = np.zeros(plan.shape, np.float32)
        for piece in plan.pieces:
            rows = reader.get(piece.name).astype(np.float32)[piece.rows[0]:piece.rows[1]]
            bias[piece.index] = piece.convert(rows).reshape(bias[piece.index].shape)
    return bias


def _open_hf(source: str, what: str, stack: contextlib.ExitStack) -> tuple[dict, dict, SafetensorsReader, str]:
    """(config.json, the model section, a reader of the checked tensors, the source dtype); the
    files stay open until `stack` closes. Reads no tensor data."""
    src = Path(source).expanduser()
    if not src.is_dir():
        raise ConfigError(f"{what} '{source}' does not exist or is not a directory")
    hf = read_hf_config(src)
    model = model_section_from_hf(hf)
    reader = SafetensorsReader(src, stack)
    # Tensors the family's checkpoints hold that transformers does not run (DeepSeek-V3's MTP layers):
    # skipped before the check, which otherwise refuses any tensor without a place in the model.
    reader.ignored = ignored_tensors(hf, list(reader.shape))
    for name in reader.ignored:
        del reader.shape[name], reader.dtype[name]
    source_dtype = check_tensors(reader, model_only_config(model).model)
    return hf, model, reader, source_dtype


def _interleave(hf: dict) -> bool:
    """DeepSeek-V3's `rope_interleave` (default true): whether its rope rows are reordered on import."""
    return hf.get("rope_interleave", True) is not False


def _with_source_comment(text: str) -> str:
    """The dumped config with a comment on `data.source: null` saying what to choose."""
    note = "  source: null  # choose: text or tokens (with data.path), or markov (synthetic); training refuses null"
    return text.replace("\ndata:\n  source: null\n", f"\ndata:\n{note}\n", 1)
