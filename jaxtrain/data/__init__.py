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
token files, see `sources.py`) and `text` (.txt/.jsonl tokenized at open). Packing is in
`packing.py`, the ordered, sharded, prefetched iterator in `pipeline.py`, tokenizers in
`tokenizer.py`, and `jaxtrain prepare-data` in `prepare.py`. docs/data.md has the whole story.
"""

from __future__ import annotations

from typing import Sequence

from jaxtrain.config import Config
from jaxtrain.data.markov import MarkovData
from jaxtrain.data.packing import SequenceSource
from jaxtrain.data.pipeline import PackedData, TrainData
from jaxtrain.data.sources import Corpus, open_text, open_tokens
from jaxtrain.data.tokenizer import load_tokenizer

# The last eval corpus opened, keyed by everything that decides its content: evaluation builds a
# fresh iterator each time, and re-tokenizing a text eval set every time would waste minutes.
_eval_cache: dict[tuple, Corpus] = {}


def open_corpus(cfg: Config, path: str, key: str) -> Corpus:
    """Open `path` as the configured source (tokens or text), checked against model.vocab_size.

    Args:
      cfg: the config (data.* and model.vocab_size are used).
      path: file, directory or glob.
      key: config key named in error messages ('data.path' or 'data.eval').
    Returns:
      The corpus.
    Raises:
      ConfigError: anything wrong with the files, the tokenizer or the ids.
    """
    d = cfg.data
    if d.source == "tokens":
        return open_tokens(path, token_dtype=d.token_dtype, eod_id=d.eod_id, vocab_size=cfg.model.vocab_size, key=key)
    tokenizer = load_tokenizer(d.tokenizer, d.eod_id)
    return open_text(path, tokenizer, vocab_size=cfg.model.vocab_size, text_field=d.text_field, key=key)


def _eval_corpus(cfg: Config) -> Corpus:
    d = cfg.data
    cache_key = (d.source, d.eval, d.tokenizer, d.eod_id, d.text_field, d.token_dtype, cfg.model.vocab_size)
    if cache_key not in _eval_cache:
        _eval_cache.clear()
        _eval_cache[cache_key] = open_corpus(cfg, d.eval, "data.eval")
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
    if d.source == "markov":
        return MarkovData(cfg, process_index, process_count, rows=rows)
    corpus = open_corpus(cfg, d.path, "data.path")
    if d.eval:
        _eval_corpus(cfg)
    return PackedData(SequenceSource(corpus, d.seq_len), global_batch=d.global_batch_size,
                      process_index=process_index, process_count=process_count, seed=d.seed,
                      shuffle=d.shuffle, repeat=True, prefetch=d.prefetch, rows=rows)


def build_eval_data(cfg: Config, process_index: int = 0, process_count: int = 1, rows: Sequence[int] | None = None,
                    prefetch: int | None = None):
    """The held-out iterator (data.eval), or None when no eval source is configured.

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
    if d.source == "markov":
        return MarkovData(cfg, process_index, process_count, stream=1, rows=rows) if cfg.train.eval_every else None
    if not d.eval:
        return None
    return PackedData(SequenceSource(_eval_corpus(cfg), d.seq_len), global_batch=d.global_batch_size,
                      process_index=process_index, process_count=process_count, seed=d.seed,
                      shuffle=False, repeat=False, prefetch=d.prefetch if prefetch is None else prefetch, rows=rows)
