"""`jaxtrain export-hf RUN_DIR --output DST`: a run's parameters -> a Hugging Face directory (Llama,
Mixtral, Qwen3, Qwen3-MoE or Gemma 3: `jaxtrain.hf.mapping.hf_model_type`).

RUN_DIR may be local or a gs:// / s3:// URL (a run trained into a bucket): config.yaml,
hf_config.json and the tokenizer files are read as objects, the checkpoint through the same
restore path as `checkpoint.init_from`. The output is always a local directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from jaxtrain.storage import small_files
from jaxtrain.storage.paths import is_remote, join
from jaxtrain.config import ConfigError
from jaxtrain.checkpoint.trained_run import (find_up, load_run_config, resolve_run, restore_params, restore_router_bias,
                                             run_tokenizer)
from jaxtrain.hf.files import (DTYPES, HF_CONFIG, copy_tokenizer, finish, fresh_output, parse_size, refuse_url,
                               write_generation_config, write_safetensors, write_tokenizer, writing)
from jaxtrain.hf.mapping import HF_DTYPE_NAMES, hf_config_from_model, hf_tensors_from_params














def export_hf(run_dir: str, output: str, *, step: Optional[int] = None, dtype: Optional[str] = None,
              max_shard_size: str = "5GB") -> dict:
    """Write a run's parameters as a Hugging Face directory of the family `hf_model_type` names.

    Args:
      run_dir: a jaxtrain run directory (config.yaml + checkpoints/), or an import-hf directory;
        local, or a gs:// / s3:// URL.
      output: new local directory (must not exist, or be empty).
      step: checkpoint step to export (default: the latest good one).
      dtype: 'fp32', 'bf16' or 'fp16' (default: the imported source's dtype, else fp32).
      max_shard_size: above this many bytes the weights are split into shards with an index.
    Returns:
      Summary: output, step, dtype, files, tokenizer (files copied or written), eos_token_id (or
      None), missing_tokenizer (the path of a tokenizer the run used that is no longer there, or None),
      dropped (parameter trees the family has no tensors for: `mtp`, multi-token prediction).
    Raises:
      ConfigError: no config.yaml or usable checkpoint, a config that does not match the
        checkpoint, an fp16 overflow, an existing or remote output, or a bucket that cannot be
        read. Nothing is written then.
    """
    refuse_url(output, "export-hf --output", "write it locally, then upload it if needed")
    run = resolve_run(run_dir, "export-hf RUN_DIR")
    cfg = load_run_config(run, run_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    # The imported source's config.json: here (an import dir) or where the run started from.
    hf_home = find_up(run, HF_CONFIG, 1, key="export-hf RUN_DIR") or find_up(cfg.checkpoint.init_from, HF_CONFIG)
    source = json.loads(small_files.read_bytes(join(hf_home, HF_CONFIG))) if hf_home else {}
    if dtype is None:
        names = {v: k for k, v in HF_DTYPE_NAMES.items()}
        dtype = names.get(source.get("dtype") or source.get("torch_dtype"), "fp32")
    out, tmp = fresh_output(output)
    params, step = restore_params(run, cfg, step)
    # DeepSeek-V3's e_score_correction_bias is the train state's routing bias (zeros if never saved).
    router_bias = restore_router_bias(run, cfg, step) if cfg.model.mla and cfg.model.num_experts else None
    dropped = [k for k in ("mtp",) if k in params]  # transformers runs no MTP module: not written
    tensors = []
    for name, t in hf_tensors_from_params(params, cfg.model, router_bias):
        cast = t.astype(DTYPES[dtype])  # round to nearest even, as torch's .to(bfloat16)
        if dtype == "fp16" and not np.isfinite(cast).all():
            raise ConfigError(f"tensor '{name}' overflows fp16 (largest |value| {np.abs(t).max():.4g}); "
                              "export with --dtype bf16 or fp32")
        tensors.append((name, cast))
    del params
    # The tokenizer the run trained with: a Hugging Face tokenizer folder (an import's) is copied
    # as it is; a bare tokenizers file (prepare-data's) gets a tokenizer_config.json around it.
    # Without one (markov data), the imported source's files.
    tokenizer, eod_id, known = run_tokenizer(cfg)
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
        if bare is not None and eod_id is not None:  # a bare file always comes with an eod id (run_tokenizer)
            copied += write_tokenizer(bare, eod_id, tmp, cfg.model.max_seq_len)
        ids = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config}
        if "generation_config.json" not in copied and "eos_token_id" in ids:
            copied.append(write_generation_config(ids, tmp))
        finish(tmp, out)
    return {"output": os.fspath(out), "step": step, "dtype": dtype, "files": files, "tokenizer": copied,
            "eos_token_id": hf_config.get("eos_token_id"), "missing_tokenizer": missing, "dropped": dropped}
