"""Chat and prompt/completion examples as packed training rows, the loss on what the model should learn.

`data.format: chat` rows hold `messages: [{role, content}, ...]`, rendered with the tokenizer's chat template
(`chat.encode_chat`); `prompt_completion` rows hold `prompt` and `completion` strings (`chat.encode_prompt_completion`,
ended by the eos id). Either way an example is token ids plus a mask that is true on the tokens to learn (the
assistant's turns, or the completion and its eos). `encode_examples` makes them, `ExampleRows` packs them into
rows of `packing.FIELDS` (a `pipeline.RowSource`) and `open_example_rows` does both for a config's component.

Packing (`data.packing`, null = first_fit here):
- `first_fit`: examples, longest first (ties in file order), each placed whole into the first row with room
  (first-fit decreasing, deterministic). An example of n tokens takes n positions; one longer than seq_len keeps
  its first seq_len tokens (counted in `num_truncated`). The rest of a row is padding (`padding_fraction`).
- `concat`: examples back to back in file order, cut every seq_len tokens like documents (`packing.pack_window`);
  an example cut at a row's end continues in the next row as a new segment (without its beginning in view).
An example with no token to learn left in its rows (its answer cut off past seq_len) is left out (`num_dropped`).

Within a row each example is its own segment (ids 1, 2, ...; 0 = padding) with positions from 0, so attention
(masked by segment id) never crosses examples. `loss_mask[t]` is 1 iff token t + 1 is in the same segment and
is one to learn: the model learns to predict the assistant's tokens, never the prompt's. L = 8, example a
(a3 a4 the assistant's), example b (b2 b3 the assistant's), first_fit:

  tokens       a1 a2 a3 a4 b1 b2 b3  0
  targets      a2 a3 a4 b1 b2 b3  0  0
  segment_ids   1  1  1  1  2  2  2  0
  positions     0  1  2  3  0  1  2  0
  loss_mask     0  1  1  0  1  1  0  0
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from jaxtrain.config import Config, ConfigError, MixtureComponent
from jaxtrain.data import token_cache
from jaxtrain.data.chat import encode_chat, encode_prompt_completion, load_chat_template, load_template_tokens
from jaxtrain.data.packing import pack_window
from jaxtrain.data.tokenizer import Tokenizer, load_tokenizer

_log = logging.getLogger(__name__)

PACKINGS = ("first_fit", "concat")
_NO_ROWS = "{key}: no rows to read (the files hold only blank lines?)"


@dataclasses.dataclass
class Examples:
    """Encoded examples in file order: `ids[i]` (int32) and `masks[i]` (bool, true on the tokens to learn),
    from the row at `where[i]` (file:line)."""

    ids: list[np.ndarray]
    masks: list[np.ndarray]
    where: list[str]

    @property
    def num_examples(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(x) for x in self.ids))


def _encode_row(row: dict, fmt: str, tokenizer: Tokenizer, template: Optional[str], variables: dict,
                eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One row's (ids, mask); ConfigError without the row's place (the caller adds it)."""
    if fmt == "chat":
        messages = row.get("messages")
        if not isinstance(messages, (list, tuple)):
            what = "has no 'messages'" if "messages" not in row else f"has 'messages' of type {type(messages).__name__}"
            raise ConfigError(f"a chat row needs 'messages', a list of {{role, content}} objects; this one {what} "
                              f"(keys: {sorted(row)})")
        return encode_chat(tokenizer, template, messages, **variables)
    missing = [k for k in ("prompt", "completion") if not isinstance(row.get(k), str)]
    if missing:
        raise ConfigError(f"a prompt_completion row needs the string fields 'prompt' and 'completion'; this one lacks "
                          f"{' and '.join(repr(k) for k in missing)} as strings (keys: {sorted(row)})")
    return encode_prompt_completion(tokenizer, row["prompt"], row["completion"], eos_id)


def encode_examples(rows: Iterable[tuple[str, dict]], fmt: str, tokenizer: Tokenizer, template: Optional[str],
                    variables: dict[str, Any], key: str, eos_id: Optional[int] = None,
                    allow_empty: bool = False) -> Examples:
    """Encode every row (from `documents.iter_rows`) as ids and a learn mask.

    Args:
      rows: `(where, row)` pairs, `where` a "file:line" for messages.
      fmt: `chat` (a `messages` list, rendered with `template`) or `prompt_completion` (`prompt`, `completion`).
      tokenizer: an HFTokenizer or the bytes tokenizer.
      template: the chat template source (format chat).
      variables: what the template may refer to (`bos_token`, `eos_token` ...: `chat.load_template_tokens`).
      key: the config key named in errors ('data.path', 'data.mixture[1] (name)').
      eos_id: the id that ends a completion (default: the tokenizer's eod id, what jaxtrain's generation stops at).
      allow_empty: no rows is no examples, not an error (one file of several: `token_cache`).
    Returns:
      The examples in row order.
    Raises:
      ConfigError: one line naming `key` and the row's file:line: a row without `messages` (a list) or without
        `prompt`/`completion` strings, a conversation without an assistant turn, a template that fails on it or
        cannot tell the assistant's tokens; or no rows at all.
    """
    if fmt not in ("chat", "prompt_completion"):
        raise ValueError(f"encode_examples: format {fmt!r} is not chat or prompt_completion")
    if fmt == "chat" and template is None:
        raise ValueError("encode_examples: format chat needs a template")
    eos = tokenizer.eod_id if eos_id is None else int(eos_id)
    out = Examples([], [], [])
    for where, row in rows:
        try:
            ids, mask = _encode_row(row, fmt, tokenizer, template, variables, eos)
        except ConfigError as e:
            raise ConfigError(f"{key}: {where}: {e}") from None
        out.ids.append(ids)
        out.masks.append(mask)
        out.where.append(where)
    if not out.ids and not allow_empty:
        raise ConfigError(_NO_ROWS.format(key=key))
    return out


def encode_example_file(encoding: token_cache.Encoding, path: Path, key: str,
                        tokenizer: Tokenizer) -> token_cache.FileEncoding:
    """One local file's rows as examples (a `token_cache.Encoder`): ids, learn masks and each one's row."""
    from jaxtrain.data.documents import file_rows  # record readers (pyarrow ...) load only for these formats

    ex = encode_examples(file_rows(encoding.source, path, key), encoding.fmt, tokenizer, encoding.template,
                         dict(encoding.variables), key, eos_id=tokenizer.eod_id, allow_empty=True)
    ids = np.concatenate(ex.ids + [np.zeros(0, np.int32)]).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in ex.ids], dtype=np.int64)]).astype(np.int64)
    return token_cache.FileEncoding(
        {"ids": ids, "masks": np.concatenate(ex.masks + [np.zeros(0, bool)]).astype(bool), "offsets": offsets},
        {"examples": ex.num_examples, "tokens": len(ids), "max_id": int(ids.max()) if len(ids) else 0}, ex.where)


def _first_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each item (in the given order) under first fit: the first row with room, rows opened in order.

    A max tree over the rows' room finds the first row with room >= n in O(log rows) per item (a scan of
    every open row would be quadratic in the number of rows). Every length must be <= capacity.
    """
    n = len(lengths)
    size = 1 << max(n - 1, 0).bit_length()  # leaves: at most one row per item is ever opened
    room = [0] * (2 * size)
    room[size:size + n] = [capacity] * n
    for node in range(size - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
    rows = np.empty(n, np.int64)
    for i, length in enumerate(lengths.tolist()):
        node = 1
        while node < size:  # the leftmost leaf with room: go left whenever the left subtree has some
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        rows[i] = node - size
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return rows


class ExampleRows:
    """Packed rows of examples by index (a `pipeline.RowSource`; the layout is in the module docstring).

    Attributes:
      seq_len, packing: the row length and `first_fit` or `concat`.
      num_examples: examples packed (those with something to learn within seq_len).
      num_tokens: tokens placed in rows (after truncation).
      num_loss_tokens: targets counted in the loss over all rows.
      num_truncated: examples longer than seq_len cut to their first seq_len tokens (first_fit).
      num_dropped: examples left out because no token to learn remained (e.g. the assistant's reply lay past
        seq_len, or an example of one token).
      padding_fraction: the share of row positions that are padding.
    """

    def __init__(self, examples: Examples, seq_len: int, packing: str = "first_fit"):
        if packing not in PACKINGS:
            raise ValueError(f"ExampleRows: packing {packing!r} is not one of {PACKINGS}")
        self.seq_len, self.packing = seq_len, packing
        L = seq_len
        lengths = np.array([len(x) for x in examples.ids], np.int64)
        cut = np.minimum(lengths, L) if packing == "first_fit" else lengths  # tokens of each example placed
        self.num_truncated = int(np.sum(cut < lengths))
        # Targets each example puts in the loss: its tokens to learn but the first (nothing of its own precedes
        # that one; in concat an example's other tokens are all learned, a row's first as the previous row's target).
        learn = np.array([int(np.count_nonzero(m[1:k])) for m, k in zip(examples.masks, cut)], np.int64)
        order = np.flatnonzero(learn > 0)
        self.num_dropped = len(lengths) - len(order)
        self.num_examples = len(order)
        self.num_loss_tokens = int(learn.sum())
        if packing == "first_fit":
            # Longest first (stable: ties stay in file order): first-fit decreasing leaves less padding.
            order = order[np.argsort(-cut[order], kind="stable")]
        cut = cut[order]
        self._tokens = np.concatenate([examples.ids[i][:k] for i, k in zip(order, cut)] + [np.zeros(0, np.int32)])
        self._tokens = self._tokens.astype(np.int32)
        self._learn = np.concatenate([examples.masks[i][:k] for i, k in zip(order, cut)] + [np.zeros(0, bool)])
        self._offsets = np.concatenate([[0], np.cumsum(cut)]).astype(np.int64)  # example j: [o[j], o[j+1])
        self.num_tokens = int(self._offsets[-1])
        if packing == "first_fit":
            row_of = _first_fit(cut, L)
            num_rows = int(row_of.max()) + 1 if len(row_of) else 0
            # The examples of row r, in placement order: _items[_row_ptr[r]:_row_ptr[r + 1]].
            self._items = np.argsort(row_of, kind="stable")
            self._row_ptr = np.searchsorted(row_of[self._items], np.arange(num_rows + 1))
            self._len = num_rows
        else:
            self._starts = np.zeros(self.num_tokens, bool)
            self._starts[self._offsets[:-1]] = True
            self._len = max(0, -(-(self.num_tokens - 1) // L))  # L inputs and one more target per row
        positions = self._len * L
        used = self.num_tokens if packing == "first_fit" else min(self.num_tokens, positions)
        self.padding_fraction = 1.0 - used / positions if positions else 0.0

    @property
    def num_documents(self) -> int:
        """The examples packed (what `data.mixture_unit: documents` counts)."""
        return self.num_examples

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self._len:
            raise IndexError(f"row {i} out of range [0, {self._len})")
        L = self.seq_len
        if self.packing == "first_fit":
            items = self._items[self._row_ptr[i]:self._row_ptr[i + 1]]
            spans = [(self._offsets[j], self._offsets[j + 1]) for j in items]
            window = np.concatenate([self._tokens[a:b] for a, b in spans])
            learn = np.concatenate([self._learn[a:b] for a, b in spans])
            starts = np.zeros(len(window), bool)
            starts[np.cumsum([0] + [b - a for a, b in spans[:-1]])] = True
        else:
            start = i * L
            window = self._tokens[start:start + L + 1]
            learn = self._learn[start:start + L + 1]
            starts = self._starts[start:start + L + 1]
        row = pack_window(window, starts, L, None)  # segments, positions, targets; loss_mask = same segment
        target_learned = np.zeros(L, np.float32)
        target_learned[:len(learn) - 1] = learn[1:]
        row["loss_mask"] = row["loss_mask"] * target_learned
        return row


def _chat_template(cfg: Config) -> tuple[str, dict[str, str]]:
    """The chat template (`data.chat_template`, else beside `data.tokenizer`) and the special-token strings
    passed to it (`bos_token`, ...), which belong to the tokenizer whose ids they become."""
    d = cfg.data
    if d.chat_template is None and d.tokenizer == "bytes":
        raise ConfigError("data.format=chat with data.tokenizer=bytes needs data.chat_template (a .jinja file): the "
                          "bytes tokenizer has no chat template of its own")
    where = d.chat_template if d.chat_template is not None else str(Path(d.tokenizer).expanduser().parent)
    key = "data.chat_template" if d.chat_template is not None else "data.tokenizer"
    try:
        template = load_chat_template(where)
        variables = load_template_tokens(d.tokenizer) if d.tokenizer != "bytes" else {}
        if not variables and d.chat_template is not None and not d.chat_template.endswith(".jinja"):
            variables = load_template_tokens(d.chat_template)  # a tokenizer directory given for its template
    except ConfigError as e:
        hint = "" if d.chat_template is not None else "; set data.chat_template (a .jinja file or tokenizer directory)"
        raise ConfigError(f"{key}: {e}{hint}") from None
    return template, variables


def open_example_rows(cfg: Config, component: MixtureComponent, key: str) -> ExampleRows:
    """A chat or prompt_completion component's packed rows, checked against model.vocab_size.

    The eos that ends a completion is the tokenizer's eod id (`data.eod_id`, else the tokenizer's end-of-text
    token): the id jaxtrain's own generation stops at. A chat example ends as its template ends it.

    Args:
      cfg: the config (data.tokenizer, data.chat_template, data.seq_len, data.packing, model.vocab_size).
      component: what to read (`format` chat or prompt_completion).
      key: config key named in error messages.
    Raises:
      ConfigError: a bad row (its file:line named), no template, ids that do not fit model.vocab_size.
    """
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer, d.eod_id)
    template, variables = _chat_template(cfg) if component.format == "chat" else (None, {})
    from jaxtrain.data.documents import row_files  # record readers (pyarrow ...) load only for these formats

    files = row_files(component.source, component.path, key)
    encoding = token_cache.Encoding.of("examples", component.source, tokenizer, fmt=component.format,
                                       template=template, variables=tuple(sorted(variables.items())))
    encoded = token_cache.encode(encoding, files, key, tokenizer, encode_example_file, workers=d.tokenize_workers)
    vocab = cfg.model.vocab_size
    examples = Examples([], [], [])
    for e in encoded:
        ids = [e.ids[a:b] for a, b in zip(e.offsets[:-1], e.offsets[1:])]
        if e.max_id >= vocab:
            i = next(i for i, x in enumerate(ids) if len(x) and int(x.max()) >= vocab)
            raise ConfigError(f"{key}: {e.where(i)}: token id {int(ids[i].max())} does not fit model.vocab_size="
                              f"{vocab} (data.tokenizer has {tokenizer.vocab_size} ids); set model.vocab_size to at "
                              f"least {tokenizer.vocab_size}")
        examples.ids += ids
        examples.masks += [e.masks[a:b] for a, b in zip(e.offsets[:-1], e.offsets[1:])]
    if not examples.ids:
        raise ConfigError(_NO_ROWS.format(key=key))
    rows = ExampleRows(examples, d.seq_len, d.packing or "first_fit")
    if rows.num_examples == 0:
        raise ConfigError(f"{key}: none of the {examples.num_examples} examples has a token to learn within "
                          f"data.seq_len={d.seq_len} (the answers lie past it?); raise data.seq_len or use "
                          "data.packing=concat")
    _log.info("%s: %d %s examples (%d cut to data.seq_len=%d, %d with nothing to learn left out), %d tokens, "
              "%d in the loss, %d rows (%s), %.1f%% padding", key, rows.num_examples, component.format,
              rows.num_truncated, d.seq_len, rows.num_dropped, rows.num_tokens, rows.num_loss_tokens, len(rows),
              rows.packing, 100 * rows.padding_fraction)
    return rows
