"""What `generate`, `eval` and `lm-eval` run: a trained run's checkpoint or a Hugging Face directory,
with the tokenizer that goes with it, made into a `Generator` on the devices given.

    trained = from_run("runs/mine")            # or from_hf("hf/llama"), or from_trainer(trainer)
    gen = trained.generator(mesh=mesh)         # parameters sharded by the run's rules
    gen.generate(trained.encode(["def "]), 40, eos_id=trained.eos_id, detokenize=trained.tokenizer.decode)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from jaxtrain.checkpoint.trained_run import (load_run_config, resolve_run, restore_params, restore_router_bias,
                                             run_tokenizer)
from jaxtrain.config import Config, ConfigError

if TYPE_CHECKING:
    from jaxtrain.data.tokenizer import Tokenizer
    from jaxtrain.infer.generate import Generator


@dataclasses.dataclass
class Trained:
    """A model to read: its config, parameters (host arrays or a live run's), tokenizer and ids."""

    cfg: Config
    params: Any
    step: Optional[int] = None  # the checkpoint step (None: a Hugging Face directory)
    tokenizer: Optional["Tokenizer"] = None  # None: the run's data fixed none (Markov data)
    router_bias: Optional[Any] = None  # MoE: the train state's routing bias
    source: str = ""

    def __post_init__(self):
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.cfg.model.vocab_size:
            raise ConfigError(f"{self.source}: the tokenizer {self.tokenizer.name} has {self.tokenizer.vocab_size} ids, "
                              f"more than the model's vocabulary of {self.cfg.model.vocab_size}: not this model's tokenizer")

    @property
    def eos_id(self) -> Optional[int]:
        return self.tokenizer.eod_id if self.tokenizer is not None else None

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with the tokenizer the model was trained with."""
        if self.tokenizer is None:
            raise ConfigError(f"{self.source}: the run's data fixes no tokenizer (data.source="
                              f"{self.cfg.data.source}): give token ids, or set data.tokenizer in its config.yaml")
        return [ids.astype(np.int64).tolist() for ids in self.tokenizer.encode_batch(texts)]

    def generator(self, mesh=None, **kwargs) -> "Generator":
        """A Generator over these parameters; on `mesh` with the run's rules (None: one device)."""
        from jaxtrain.infer.generate import Generator  # here: reading a run imports no JAX until now
        from jaxtrain.train.precision import compute_dtype

        return Generator(self.cfg.model, self.params, mesh=mesh, rules=self.cfg.mesh.rules if mesh is not None else None,
                         router_bias=self.router_bias, dtype=compute_dtype(self.cfg), **kwargs)


def from_run(run_dir: str, step: Optional[int] = None, verb: str = "generate") -> Trained:
    """A jaxtrain run (or import-hf) directory's checkpoint `step` (default: the latest good one).

    Raises:
      ConfigError: no config.yaml, no usable checkpoint or no such step (the good steps named).
    """
    run = resolve_run(run_dir, f"{verb} RUN_DIR")
    cfg = load_run_config(run, run_dir, verb)
    params, step = restore_params(run, cfg, step)
    router_bias = restore_router_bias(run, cfg, step)
    return Trained(cfg=cfg, params=params, step=step, tokenizer=tokenizer_of(cfg), router_bias=router_bias,
                   source=run_dir)


def tokenizer_of(cfg: Config) -> Optional["Tokenizer"]:
    """The tokenizer a run's data was made with, when it is still there (None: Markov data, or gone)."""
    from jaxtrain.data.tokenizer import load_tokenizer

    spec, eod_id, _ = run_tokenizer(cfg)
    if spec is None or (spec != "bytes" and not Path(spec).expanduser().is_file()):
        return None
    return load_tokenizer(spec, eod_id if spec != "bytes" else None)


def read_hf_dir(hf_dir: str) -> tuple[Config, dict, Optional[tuple[str, Optional[int]]]]:
    """(a config around the model, its parameters as host arrays, (tokenizer.json, eos id) or None)
    of a Hugging Face Llama or Mixtral directory. Imports no JAX (the verbs start it afterwards)."""
    from jaxtrain.hf.importer import model_only_config, read_hf

    hf, model, params, _, _ = read_hf(hf_dir, "--hf")
    cfg = model_only_config(model)
    path = Path(hf_dir).expanduser() / "tokenizer.json"
    eos = hf.get("eos_token_id")
    spec = (str(path), eos[0] if isinstance(eos, list) else eos) if path.is_file() else None
    return cfg, params, spec


def from_hf(hf_dir: str) -> Trained:
    """A Hugging Face Llama or Mixtral directory (config.json, *.safetensors, tokenizer.json)."""
    from jaxtrain.data.tokenizer import load_tokenizer

    from jaxtrain.hf.importer import read_hf_router_bias

    cfg, params, spec = read_hf_dir(hf_dir)
    tokenizer = load_tokenizer(spec[0], spec[1], key="--hf") if spec else None
    # DeepSeek-V3 routes with its e_score_correction_bias: without it other experts are chosen.
    return Trained(cfg=cfg, params=params, tokenizer=tokenizer, source=hf_dir,
                   router_bias=read_hf_router_bias(hf_dir, "--hf"))


def from_trainer(trainer) -> Trained:
    """The live parameters of a `Trainer` (a notebook), on its mesh: `trained.generator(trainer.mesh)`."""
    state = trainer.state
    bias = state["moe"]["router_bias"] if "moe" in state else None
    return Trained(cfg=trainer.cfg, params=state["params"], step=int(state["step"]), tokenizer=tokenizer_of(trainer.cfg),
                   router_bias=bias, source=trainer.cfg.run.output_dir)
