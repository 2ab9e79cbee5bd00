"""Samples during training (`train.sample_every`): every N steps the loop has the current parameters
continue a few prompts, and the text goes to events.jsonl and TensorBoard's text tab.

The decoding is `jaxtrain.infer.generate` on the training mesh, over the live parameters (no copy):
its programs compile at the first sample and are reused after. Every process runs it (the
parameters are sharded across them); process 0's run log writes it.
"""

from __future__ import annotations

from typing import Any, Optional

from jaxtrain.config import Config, ConfigError
from jaxtrain.infer.generate import Generator, check_layout
from jaxtrain.infer.sampling import Sampling


class TrainingSamples:
    """The prompts, tokenized once, and a Generator over the training mesh."""

    def __init__(self, cfg: Config, mesh, tokenizer: Optional[Any], dtype: Any):
        """
        Raises:
          ConfigError: text prompts without a tokenizer (Markov data), a prompt longer than
            model.max_seq_len, or a mesh that decoding cannot use (named).
        """
        t = cfg.train
        self.every, self.cfg, self.tokenizer = t.sample_every, cfg, tokenizer
        try:
            check_layout(mesh)
        except ConfigError as e:
            raise ConfigError(f"train.sample_every={t.sample_every}: {e}") from None
        if t.sample_prompts and tokenizer is None:
            raise ConfigError(f"train.sample_prompts needs a tokenizer, and data.source={cfg.data.source} has none; "
                              "leave it empty (samples start from the end-of-text id)")
        if t.sample_prompts:
            self.prompts = list(t.sample_prompts)
            self.ids = [ids.tolist() for ids in tokenizer.encode_batch(self.prompts)]
        else:  # a document's start: what the model writes from nothing
            self.prompts = [""]
            self.ids = [[tokenizer.eod_id if tokenizer is not None else 0]]
        for prompt, ids in zip(self.prompts, self.ids):
            if not ids:
                raise ConfigError(f"train.sample_prompts: {prompt!r} encodes to no token")
            if len(ids) >= cfg.model.max_seq_len:
                raise ConfigError(f"train.sample_prompts: {prompt[:40]!r}... has {len(ids)} tokens; "
                                  f"model.max_seq_len is {cfg.model.max_seq_len}")
        self.generator = Generator(cfg.model, None, mesh=mesh, rules=cfg.mesh.rules, dtype=dtype)  # params: per run

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def run(self, step: int, params: Any, router_bias: Any = None) -> list[dict]:
        """The prompts continued by `params`: [{"prompt", "text" (None without a tokenizer), "tokens"}]."""
        self.generator.set_params(params)  # this step's weights, cut into layers (one copy)
        self.generator.router_bias = router_bias
        t = self.cfg.train
        sampling = Sampling(temperature=t.sample_temperature, seed=self.cfg.run.seed + step)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        eos = self.tokenizer.eod_id if self.tokenizer is not None else None
        try:
            completions = self.generator.generate(self.ids, t.sample_max_new_tokens, sampling, eos_id=eos,
                                                  detokenize=decode)
        finally:  # the layers cut from this step's weights are a copy of them: not kept until the next sample
            self.generator.params = self.generator.layers = self.generator.router_bias = None
        return [{"prompt": p, "text": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason}
                for p, c in zip(self.prompts, completions)]
