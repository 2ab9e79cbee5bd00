"""`jaxtrain eval`: a trained model's loss on a whole held-out set, computed as training computes its
evaluations (the same packed rows, the same eval step, every process its share of each batch).

    cfg = eval_config(run_config, "data/eval")            # data.eval = the set; its kind from the files
    result = evaluate(cfg, params_of=..., router_bias=...)  # after jax.distributed is up
    result["loss"], result["perplexity"], result["tokens"], result.get("bits_per_byte")

Every token of the set is a target exactly once, except each document's first (nothing precedes
it). Bits per byte (text sets only) divide the total loss in bits by the UTF-8 bytes of the documents.
"""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

from jaxtrain.config import Config, ConfigError, apply_overrides, from_dict
from jaxtrain.data.remote_files import local_files
from jaxtrain.data.sources import META_NAME, TEXT_SUFFIXES, TOKEN_SUFFIXES, iter_documents


def data_kind(path: str) -> str:
    """'tokens' (prepare-data's files) or 'text' (.txt / .jsonl), from the files `path` names."""
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / META_NAME).is_file() or any(p.glob(f"*{TOKEN_SUFFIXES[0]}")):
            return "tokens"
        if any(any(p.glob(f"*{s}")) for s in TEXT_SUFFIXES):
            return "text"
    elif p.suffix in TOKEN_SUFFIXES:
        return "tokens"
    elif p.suffix in TEXT_SUFFIXES:
        return "text"
    else:
        matched = [Path(f).suffix for f in glob.glob(os.path.expanduser(path))]
        if any(s in TOKEN_SUFFIXES for s in matched):
            return "tokens"
        if any(s in TEXT_SUFFIXES for s in matched):
            return "text"
    raise ConfigError(f"--data '{path}': no token files (.bin, meta.json) or text files (.txt, .jsonl) there")


def eval_config(cfg: Config, data: str, tokenizer: Optional[tuple[str, Optional[int]]] = None,
                overrides: tuple[str, ...] = ()) -> Config:
    """The config that evaluates `cfg`'s model on the set `data` (the whole set, once).

    tokenizer: (spec, eod id) for a text set: what the model was trained with.
    Raises:
      ConfigError: a text set without a tokenizer, or a bad override.
    """
    kind = data_kind(data)
    d = cfg.to_dict()
    d["data"].update(source=kind, path=data, eval=data)
    if kind == "text":
        if tokenizer is None or tokenizer[0] is None:
            raise ConfigError(f"--data '{data}' is text, and the model has no tokenizer to read it with "
                              "(set data.tokenizer=FILE)")
        d["data"].update(tokenizer=tokenizer[0], eod_id=tokenizer[1] if tokenizer[0] != "bytes" else None)
    d["train"].update(eval_batches=0, eval_every=0)
    return from_dict(apply_overrides(d, list(overrides)))


def text_bytes(cfg: Config) -> int:
    """UTF-8 bytes of the documents of the text set `data.eval`."""
    files = local_files(cfg.data.eval, "data.eval", TEXT_SUFFIXES)  # a bucket's copies, already made by the eval
    return sum(len(doc.encode("utf-8")) for f in files for doc in iter_documents(f, cfg.data.text_field, "data.eval"))


def evaluate(cfg: Config, params_of: Callable[[Any], Any], router_bias_of: Callable[[Any], Any] = lambda s: None) -> dict:
    """Mean loss, perplexity and tokens of the model on `cfg.data.eval`, on every process.

    Args:
      cfg: from `eval_config`.
      params_of: parameter shardings -> the parameters in them (a checkpoint read into them).
      router_bias_of: a replicated sharding -> the MoE router bias (None: zeros, or a dense model).
    """
    import jax

    from jaxtrain.parallel.mesh import build_mesh, slice_count, validate_against_devices
    from jaxtrain.train.evaluation import Evaluator
    from jaxtrain.train.state import build_layout

    devices = jax.devices()
    validate_against_devices(cfg, len(devices), jax.process_count(), num_slices=slice_count(devices))
    layout = build_layout(cfg, build_mesh(cfg.mesh, devices))
    params = params_of(layout.param_shardings)
    bias = router_bias_of(layout.replicated)
    result = Evaluator(cfg, layout, jax.process_index(), jax.process_count()).run(params, 0, bias)
    if result is None or result.tokens == 0:
        raise ConfigError(f"--data '{cfg.data.eval}' holds no token to predict")
    out = {"loss": result.loss, "perplexity": math.exp(min(result.loss, 700.0)), "tokens": int(result.tokens),
           "data": cfg.data.eval, "source": cfg.data.source}
    if cfg.data.source == "text":
        out["bytes"] = text_bytes(cfg)
        out["bits_per_byte"] = result.loss * result.tokens / math.log(2) / out["bytes"]
    return out
