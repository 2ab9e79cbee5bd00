"""lm-evaluation-harness (`lm_eval`, 0.4.x) over a jaxtrain model: a run's checkpoint or a Hugging Face
directory, scored and decoded by `jaxtrain.infer` (no torch).

    import jaxtrain.infer.lm_eval_adapter  # registers the model name "jaxtrain"
    lm_eval.simple_evaluate(model="jaxtrain", model_args="run_dir=runs/mine,batch_size=16", tasks=[...])
    # or: JaxtrainLM(trained=from_run("runs/mine"))  (a Trained already loaded, on a mesh of your own)

`jaxtrain lm-eval` runs it from the command line; `python -m jaxtrain.infer.lm_eval_adapter ARGS` is
lm-eval's own command line (`lm_eval --model jaxtrain ...`) with this model registered.

Text is read the way lm-eval's `hf` backend reads it, so the two give the same numbers on the same
weights: a (context, continuation) pair is encoded whole and split where the context's own tokens
end (trailing whitespace of the context moves to the continuation); an empty context is the
end-of-text id; `loglikelihood_rolling` cuts a text into lm-eval's disjoint windows of
`max_length` tokens, the first after the end-of-text id. The model's tokenizer adds no special
token (no BOS): a model is scored as it was trained.

lm-eval is an optional dependency (`pip install 'jaxtrain[eval]'`): only this module imports it,
and nothing in jaxtrain imports this module except `jaxtrain lm-eval`.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

import lm_eval.models  # noqa: F401  (the built-in backends: the registry loads them only while it is empty)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from jaxtrain.config import ConfigError

if TYPE_CHECKING:
    from jaxtrain.infer.loading import Trained

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for a task that sets no max_gen_toks (the hf backend's)


def _int(name: str, value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"lm-eval model_args: {name}={value!r} is not an integer") from None
    if n < 1 and name != "step":
        raise ConfigError(f"lm-eval model_args: {name} must be at least 1, got {n}")
    return n


class JaxtrainLM(TemplateLM):
    """lm-eval's `LM` over a `Trained`: loglikelihood, loglikelihood_rolling and generate_until."""

    def __init__(self, run_dir: Optional[str] = None, step: Optional[int] = None, hf: Optional[str] = None,
                 batch_size: Any = 8, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, max_length: Optional[int] = None,
                 trained: Optional["Trained"] = None, mesh=None, device: Optional[str] = None,
                 max_batch_size: Optional[int] = None, **unused):
        """
        Args:
          run_dir, step: a jaxtrain run (or import-hf) directory and its checkpoint (default: the latest good one).
          hf: a Hugging Face Llama/Mixtral directory instead.
          trained: a `Trained` already loaded, instead of both.
          batch_size: rows per device call ("auto" from lm-eval: 8).
          max_gen_toks: tokens generated when a task sets no max_gen_toks.
          max_length: the scoring window (default and at most: the model's max_seq_len).
          mesh: where to run (None: one device); device and max_batch_size (lm-eval's) are unused: JAX
            picks its platform.
        """
        super().__init__()
        if unused:
            log.warning("lm-eval model_args not used by the jaxtrain model: %s", ", ".join(sorted(unused)))
        if sum(x is not None for x in (run_dir, hf, trained)) != 1:
            raise ConfigError("lm-eval model_args: give one of run_dir=DIR, hf=DIR (or a loaded Trained)")
        if hf is not None and step is not None:
            raise ConfigError("lm-eval model_args: step is for run_dir, not hf")
        if trained is None:
            from jaxtrain.infer.loading import from_hf, from_run
            trained = from_hf(str(hf)) if hf is not None else from_run(str(run_dir), None if step is None else
                                                                       _int("step", step), verb="lm-eval")
        if trained.tokenizer is None:
            raise ConfigError(f"{trained.source}: the model has no tokenizer (Markov data, or its tokenizer file is "
                              "gone): lm-eval tasks are text")
        self.trained = trained
        self.tok = trained.tokenizer
        self.batch_size = 8 if str(batch_size).startswith("auto") else _int("batch_size", batch_size)
        self._max_gen_toks = _int("max_gen_toks", max_gen_toks)
        model_len = trained.cfg.model.max_seq_len
        self._max_length = model_len if max_length is None else min(_int("max_length", max_length), model_len)
        self.generator = trained.generator(mesh)
        self.backend = "causal"

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "JaxtrainLM":
        """From `--model_args run_dir=DIR,step=N,batch_size=B`; lm-eval's own settings (its
        --batch_size, --device) fill in what model_args leave out."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "JaxtrainLM":
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    # ------------------------------------------------------------------------- what lm-eval reads

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.eod_id  # no BOS: the end-of-text id stands before a text, as in training

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name.replace("/", "__")

    def get_model_info(self) -> dict:
        return {"model_source": self.trained.source, "step": self.trained.step}

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return self.trained.encode([string])[0]

    def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
        return self.tok.decode(list(tokens))

    # ------------------------------------------------------------------------- scoring

    def _split_full_window(self, context: list[int], continuation: list[int]) -> list[tuple[list[int], list[int]]]:
        """Scoring requests whose sum is (context, continuation)'s: a continuation of exactly
        max_length tokens (a rolling window's first) scores in two rows over the same positions."""
        L = self._max_length
        if len(continuation) < L:
            whole = (context + continuation)[-(L + 1):]  # the window lm-eval's hf backend scores
            return [(whole[:len(whole) - len(continuation)], continuation)]
        if len(continuation) > L:
            raise ConfigError(f"a continuation of {len(continuation)} tokens is longer than max_length {L}")
        first = context[-1:]
        return [(first, continuation[:-1]), (first + continuation[:-1], continuation[-1:])]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy) of each (key, context ids, continuation ids)."""
        rows: list[tuple[int, list[int], list[int]]] = []  # (request, context, continuation)
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ConfigError(f"lm-eval request {i}: an empty {'context' if not context else 'continuation'}")
            rows += [(i, c, t) for c, t in self._split_full_window(list(context), list(continuation))]
        # Longest first: a batch's rows share one padded length, and the first batch is the largest.
        rows.sort(key=lambda r: -(len(r[1]) + len(r[2])))
        logp = [0.0] * len(requests)
        greedy = [True] * len(requests)
        with tqdm(total=len(rows), disable=disable_tqdm, desc="Running loglikelihood requests") as bar:
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start:start + self.batch_size]
                pairs = _padded([(c, t) for _, c, t in chunk], min(self.batch_size, len(rows)))
                for (i, _, _), (lp, g) in zip(chunk, self.generator.score(pairs, len(pairs))):
                    logp[i] += lp
                    greedy[i] = greedy[i] and g
                bar.update(len(chunk))
        out = list(zip(logp, greedy))
        for (key, _, _), result in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, in lm-eval's disjoint windows of max_length tokens."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to the first of its `until` strings (greedy unless do_sample)."""
        from jaxtrain.infer.sampling import Sampling

        groups: dict[str, list[int]] = {}  # requests of the same gen_kwargs decode together
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[Optional[str]] = [None] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests") as bar:
            for members in groups.values():
                gen_kwargs = requests[members[0]].args[1]
                if not isinstance(gen_kwargs, dict):
                    raise ConfigError(f"lm-eval generation kwargs must be a dict, got {gen_kwargs!r}")
                kwargs = normalize_gen_kwargs(gen_kwargs, self._max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
                new = kwargs.pop("max_gen_toks")
                room = self._max_length - new
                if room < 1:
                    raise ConfigError(f"lm-eval asks for {new} new tokens: the model's max_length is {self._max_length}")
                sampling = Sampling(temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                                    top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                                    seed=int(kwargs.get("seed") or 0))
                # Contexts cut on the left to leave room for the new tokens (as the hf backend does).
                prompts = {i: (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-room:] for i in members}
                ordered = sorted(members, key=lambda i: -len(prompts[i]))
                for start in range(0, len(ordered), self.batch_size):
                    batch = ordered[start:start + self.batch_size]
                    rows = _padded([prompts[i] for i in batch], min(self.batch_size, len(ordered)))
                    done = self.generator.generate(rows, new, sampling, eos_id=self.eot_token_id,
                                                   stop=[s for s in until if s], detokenize=self.tok.decode)
                    for i, c in zip(batch, done):
                        out[i] = postprocess_generated_text(c.text, until, None)
                        self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
                    bar.update(len(batch))
        return out  # type: ignore[return-value]


def _padded(rows: list, n: int) -> list:
    """`rows` with its last row repeated up to `n`: every batch of a request has one shape (one compilation)."""
    return rows + rows[-1:] * (n - len(rows))


if __name__ != "__main__":  # (run as a script, main() imports the module by name, which registers it)
    register_model("jaxtrain")(JaxtrainLM)


def main() -> None:
    """lm-eval's command line with the "jaxtrain" model registered: `python -m jaxtrain.infer.lm_eval_adapter
    --model jaxtrain --model_args run_dir=runs/mine --tasks hellaswag`."""
    from lm_eval.__main__ import cli_evaluate
    cli_evaluate()


if __name__ == "__main__":
    import importlib

    importlib.import_module("jaxtrain.infer.lm_eval_adapter").main()  # the registered module, not __main__
