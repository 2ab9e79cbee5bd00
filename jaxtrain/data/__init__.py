"""Input pipeline: what the trainer asks of data.

`build_train_data(cfg, process_index, process_count, rows)` returns an iterator of this process's
rows of each global batch: a dict of numpy arrays, each [len(rows), seq_len]:
  tokens (int32), targets (int32), segment_ids (int32, 0 = padding), positions (int32),
  loss_mask (float32, 0 where the target is padding or in another document).
`rows` are the global rows its devices hold (`jaxtrain.parallel.sharding.process_rows`); without
them process p reads the block [p*b, (p+1)*b), b = global_batch / process_count. The global batch
is the same whatever the number of processes and the device order. Iterators are `TrainData`
(`pipeline.py`'s protocol, which the trainer calls): `get_state()` / `set_state()` (JSON-able) for checkpoints,
`skip_batches(n)`, `reset()`, `close()` (stops background threads), `position` (global batches
drawn so far: the index of the next one in the data order), `entropy_floor` (nats, or
None when unknown), `last_wait_s` (seconds the last `next()` waited) and `num_batches` (global
batches in one pass, None when endless).

Sources (`data.source`): `markov` (synthetic, known entropy floor), `tokens` (memory-mapped
token files, see `sources.py`), `text` (.txt/.jsonl) and the record sources (`documents.py`); text is
tokenized once per host by worker processes and memory-mapped from the cache (`token_cache.py`). Packing is in
`packing.py`, the ordered, sharded, prefetched iterator in `pipeline.py`, tokenizers in
`tokenizer.py`, and `jaxtrain prepare-data` in `prepare.py`. docs/data.md has the whole story.
"""

from __future__ import annotations

from typing import Sequence

from jaxtrain.config import Config, ConfigError, MixtureComponent
from jaxtrain.data.markov import MarkovData
from jaxtrain.data.packing import SequenceSource
from jaxtrain.data.pipeline import PackedData, RowSource, TrainData
from jaxtrain.data.sources import Corpus, open_tokens
from jaxtrain.data.tokenizer import load_tokenizer

# The last eval rows opened, keyed by everything that decides their content: evaluation builds a
# fresh iterator each time, and re-tokenizing a text eval set every time would waste minutes.
_eval_cache: dict[tuple, RowSource] = {}


def path_component(cfg: Config, path: str) -> MixtureComponent:
    """`data.path` (or `data.eval`) read as the one component of a mixture: the same reading path for both."""
    d = cfg.data
    return MixtureComponent(name="data", path=path, weight=1.0, source=d.source, format=d.format,
                            text_field=d.text_field, tokens_field=d.tokens_field, eval_only=False)


def open_corpus(cfg: Config, component: MixtureComponent, key: str) -> Corpus:
    """Open a `format: text` component's documents as one token stream, checked against model.vocab_size.

    Args:
      cfg: the config (data.* and model.vocab_size are used).
      component: what to read (`path_component` for data.path).
      key: config key named in error messages ('data.path', 'data.eval', 'data.mixture[1]').
    Raises:
      ConfigError: anything wrong with the files, the tokenizer or the ids.
    """
    d, c = cfg.data, component
    if c.source == "tokens":
        return open_tokens(c.path, token_dtype=d.token_dtype, eod_id=d.eod_id, vocab_size=cfg.model.vocab_size, key=key)
    tokenizer = load_tokenizer(d.tokenizer, d.eod_id)
    from jaxtrain.data.documents import open_documents, open_text  # pyarrow and array_record load only when read
    if c.source == "text":
        return open_text(c.path, tokenizer, vocab_size=cfg.model.vocab_size, text_field=c.text_field, key=key,
                         workers=d.tokenize_workers)
    return open_documents(c.source, c.path, tokenizer=tokenizer, text_field=c.text_field, tokens_field=c.tokens_field,
                          vocab_size=cfg.model.vocab_size, key=key, workers=d.tokenize_workers)


def open_rows(cfg: Config, component: MixtureComponent, key: str) -> RowSource:
    """A component's packed training rows: documents back to back (`format: text`, data.packing concat) or
    chat / prompt-completion examples with their loss masks (`examples.py`)."""
    if component.format == "text":
        if cfg.data.packing == "first_fit":
            raise ConfigError("data.packing=first_fit packs examples (data.format chat or prompt_completion); "
                              "documents (format text) are packed back to back (concat)")
        return SequenceSource(open_corpus(cfg, component, key), cfg.data.seq_len)
    from jaxtrain.data.examples import open_example_rows
    return open_example_rows(cfg, component, key)


def _eval_component(cfg: Config) -> tuple[MixtureComponent, str] | None:
    d = cfg.data
    if d.mixture:
        held_out = [c for c in d.mixture_components() if c.eval_only]
        return (held_out[0], "data.mixture (eval_only)") if held_out else None
    return (path_component(cfg, d.eval), "data.eval") if d.eval else None


def _eval_rows(cfg: Config) -> RowSource:
    d = cfg.data
    component, key = _eval_component(cfg)
    cache_key = (component, d.tokenizer, d.eod_id, d.token_dtype, d.seq_len, d.packing, d.chat_template,
                 cfg.model.vocab_size)
    if cache_key not in _eval_cache:
        _eval_cache.clear()
        _eval_cache[cache_key] = open_rows(cfg, component, key)
    return _eval_cache[cache_key]


def build_train_data(cfg: Config, process_index: int = 0, process_count: int = 1,
                     rows: Sequence[int] | None = None) -> TrainData:
    """The training iterator for `cfg.data`, yielding this process's rows of each global batch.

    Args:
      cfg: the config.
      process_index, process_count: this process and how many read the data (jax.process_*).
      rows: the global rows this process reads, in order (default: its block, see the module doc).
    Returns:
      An iterator (see the module docstring); its background thread is already prefetching.
    Raises:
      ConfigError: bad paths, files, tokenizer or ids, for data.path and for data.eval (checked
        now, so a bad eval set fails before any file is written rather than at the first eval).
    """
    d = cfg.data
    if d.source == "markov" and not d.mixture:
        return MarkovData(cfg, process_index, process_count, rows=rows)
    if _eval_component(cfg) is not None:
        _eval_rows(cfg)
    if d.mixture:
        from jaxtrain.data.mixture import MixtureData
        train = [(i, c) for i, c in enumerate(d.mixture_components()) if not c.eval_only]
        sources = [open_rows(cfg, c, f"data.mixture[{i}] ({c.name})") for i, c in train]
        data = MixtureData(cfg, [c for _, c in train], sources, process_index=process_index,
                           process_count=process_count, rows=rows)
    else:
        data = PackedData(open_rows(cfg, path_component(cfg, d.path), "data.path"), global_batch=d.global_batch_size,
                          process_index=process_index, process_count=process_count, seed=d.seed,
                          shuffle=d.shuffle, repeat=True, prefetch=d.prefetch, rows=rows)
    return data


def build_eval_data(cfg: Config, process_index: int = 0, process_count: int = 1, rows: Sequence[int] | None = None,
                    prefetch: int | None = None):
    """The held-out iterator (data.eval, or the mixture's eval_only component), or None when there is none.

    The iterator passes over the eval set once, in file order, with no shuffle. `num_batches` is the
    number of global batches that hold the whole set (the last one partly padding when the set's
    rows are not a multiple of the global batch); batches after it are padding only. Padding rows
    have loss_mask 0, so a masked mean over them is exact. The Markov source's held-out stream is
    endless (`num_batches` None). Call `reset()` (or build a new one) to evaluate again from the start.

    Args:
      cfg: the config (data.* and train.eval_every for the Markov stream).
      process_index, process_count: this process and how many read the data.
      rows: the global rows this process reads (see `build_train_data`).
      prefetch: batches to build ahead (default data.prefetch; 0 when the reader jumps between batches).
    """
    d = cfg.data
    if d.source == "markov" and not d.mixture:
        return MarkovData(cfg, process_index, process_count, stream=1, rows=rows) if cfg.train.eval_every else None
    if _eval_component(cfg) is None:
        return None
    return PackedData(_eval_rows(cfg), global_batch=d.global_batch_size,
                      process_index=process_index, process_count=process_count, seed=d.seed,
                      shuffle=False, repeat=False, prefetch=d.prefetch if prefetch is None else prefetch, rows=rows,
                      key=_eval_component(cfg)[1])
