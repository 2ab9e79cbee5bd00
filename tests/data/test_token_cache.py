"""Text is tokenized once per host, by worker processes, and kept on disk (jaxtrain/data/token_cache.py).

On real text (the standard library's source) with a BPE trained here: worker processes write the same
entries as the opening process, and both equal `tokenizers` run directly; a second open tokenizes nothing
(the tokenizer is made to fail) and gives bitwise the same batches from memory-mapped entries; a changed
file or setting is a new entry; a bad row in a worker is the same one line as in this process, and no
entry is left for it; an incomplete entry is never read.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from test_examples import chat_dir, conversations  # noqa: F401 (chat_dir: a fixture used here)
from test_record_sources import Text, check_source, one_epoch, stream, write_jsonl

from jaxtrain.config import ConfigError
from jaxtrain.data import token_cache
from jaxtrain.data.documents import encode_documents, open_text, row_files
from jaxtrain.data.examples import encode_example_file
from jaxtrain.data.sources import TEXT_SUFFIXES, resolve_paths
from jaxtrain.data.tokenizer import HFTokenizer, load_tokenizer

VOCAB = 512


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Text:
    return Text(tmp_path_factory.mktemp("text"))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenized"


def encode_both_ways(encoding, files, tokenizer, encoder, monkeypatch, tmp_path):
    """The files encoded by 2 worker processes (this process made unable to encode) and by this process."""
    monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / "by_workers"))
    by_workers = token_cache.encode(encoding, files, "data.path", tokenizer,
                                    lambda *a: pytest.fail("encoded in the opening process"), workers=2, inline_bytes=0)
    monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / "here"))
    here = token_cache.encode(encoding, files, "data.path", tokenizer, encoder, workers=0)
    return by_workers, here


def test_worker_processes_encode_documents_as_this_process_and_tokenizers_do(text, tmp_path, monkeypatch):
    folder = write_jsonl(text, tmp_path / "jsonl")
    files = resolve_paths(str(folder), "data.path", TEXT_SUFFIXES)
    tok = load_tokenizer(str(text.tokenizer))
    encoding = token_cache.Encoding.of("documents", "text", tok, text_field="text")
    by_workers, here = encode_both_ways(encoding, files, tok, encode_documents, monkeypatch, tmp_path)
    for half, w, h in zip(text.halves(), by_workers, here):
        np.testing.assert_array_equal(w.tokens, h.tokens)
        np.testing.assert_array_equal(h.tokens, stream(text.encode(half), text.eod))
        assert isinstance(w.tokens, np.memmap) and w.max_id == h.max_id == int(h.tokens.max())


def test_worker_processes_encode_chat_examples_as_this_process_does(chat_dir, tmp_path, monkeypatch):  # noqa: F811
    rows = [{"messages": m} for m in conversations(24)]
    for i in range(2):
        (tmp_path / f"chat{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[i::2]))
    files = row_files("text", str(tmp_path / "chat*.jsonl"), "data.path")
    from jaxtrain.data.examples import _chat_template
    from jaxtrain.config import load_config
    cfg = load_config(None, ["data.source=text", "data.format=chat", f"data.tokenizer={chat_dir / 'tokenizer.json'}",
                             f"data.path={tmp_path}"])
    template, variables = _chat_template(cfg)
    tok = load_tokenizer(str(chat_dir / "tokenizer.json"))
    encoding = token_cache.Encoding.of("examples", "text", tok, fmt="chat", template=template,
                                       variables=tuple(sorted(variables.items())))
    by_workers, here = encode_both_ways(encoding, files, tok, encode_example_file, monkeypatch, tmp_path)
    for w, h in zip(by_workers, here):
        for field in ("ids", "masks", "offsets"):
            np.testing.assert_array_equal(getattr(w, field), getattr(h, field))
        assert len(h.offsets) == 13 and h.masks.any() and not h.masks.all()
        assert w.where(5) == h.where(5) == f"{files[0 if h is here[0] else 1]}:6"


def test_a_second_open_reads_the_cache_and_tokenizes_nothing(text, tmp_path, monkeypatch, cache):
    folder = write_jsonl(text, tmp_path / "jsonl")
    overrides = ["data.source=text", f"data.path={folder}", f"data.tokenizer={text.tokenizer}",
                 "data.tokenize_workers=2"]
    expected = stream(text.encode([*text.halves()[0], *text.halves()[1]]), text.eod)
    monkeypatch.setattr(token_cache, "INLINE_BYTES", 0)  # the first open hands both files to the workers
    check_source(overrides, expected)  # (and the opens of the two processes after it read the cache)
    entries = sorted(p.name for p in cache.iterdir() if p.name != ".locks")
    assert len(entries) == 2  # one entry per file, nothing else (no temporary folders left)
    first = one_epoch(overrides, 1)
    monkeypatch.setattr(HFTokenizer, "encode_batch", lambda *a: pytest.fail("tokenized again"))
    again = one_epoch(overrides, 1)
    for k in first:
        np.testing.assert_array_equal(again[k], first[k])
    corpus = open_text(str(folder), load_tokenizer(str(text.tokenizer)), vocab_size=VOCAB)
    assert all(isinstance(a, np.memmap) for a in corpus.arrays)
    assert sorted(p.name for p in cache.iterdir() if p.name != ".locks") == entries


def test_a_changed_file_or_setting_is_a_new_entry(text, tmp_path, cache):
    path = tmp_path / "docs.jsonl"
    docs = text.docs[:20]
    path.write_text("".join(json.dumps({"text": d, "body": d.upper()}) + "\n" for d in docs))
    tok = load_tokenizer(str(text.tokenizer))

    def tokens(field: str = "text") -> np.ndarray:
        return np.asarray(open_text(str(path), tok, vocab_size=VOCAB, text_field=field).arrays[0])

    np.testing.assert_array_equal(tokens(), stream(text.encode(docs), text.eod))
    np.testing.assert_array_equal(tokens("body"), stream(text.encode([d.upper() for d in docs]), text.eod))
    path.write_text(path.read_text() + json.dumps({"text": "one more document"}) + "\n")  # same path, appended
    np.testing.assert_array_equal(tokens(), stream(text.encode([*docs, "one more document"]), text.eod))
    assert len([p for p in cache.iterdir() if p.name != ".locks"]) == 3


def test_a_bad_row_in_a_worker_is_the_same_one_line_error_and_leaves_no_entry(text, tmp_path, monkeypatch):
    folder = write_jsonl(text, tmp_path / "jsonl")
    bad = folder / "part1.jsonl"
    lines = bad.read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:2] + ['{"text": 7}\n'] + lines[2:]))
    files = resolve_paths(str(folder), "data.path", TEXT_SUFFIXES)
    tok = load_tokenizer(str(text.tokenizer))
    encoding = token_cache.Encoding.of("documents", "text", tok, text_field="text")
    messages = []
    for name, workers, inline in [("by_workers", 2, 0), ("here", 0, None)]:
        monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / name))
        with pytest.raises(ConfigError) as e:
            token_cache.encode(encoding, files, "data.path", tok, encode_documents, workers=workers, inline_bytes=inline)
        messages.append(str(e.value))
        bad_entry = token_cache.cache_root() / token_cache.entry_digest(encoding, bad)
        assert not bad_entry.exists()
    assert messages[0] == messages[1] and len(messages[0].splitlines()) == 1
    assert messages[0].startswith(f"data.path: {bad}:3 has no string field 'text'"), messages[0]


def test_an_incomplete_entry_is_never_read_and_an_abandoned_one_is_removed(text, tmp_path, cache):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in text.docs[:10]))
    tok = load_tokenizer(str(text.tokenizer))
    encoding = token_cache.Encoding.of("documents", "text", tok, text_field="text")
    entry = cache / token_cache.entry_digest(encoding, path)
    entry.mkdir(parents=True)  # what a writer killed mid-way could leave if it wrote in place: no info.json
    np.save(entry / "tokens.npy", np.zeros(3, np.uint16))
    stale, fresh = cache / f".{entry.name}.stale", cache / f".{entry.name}.fresh"
    for folder in (stale, fresh):  # a killed writer's temporary folder (2 days old), and one still at work
        folder.mkdir()
        (folder / "tokens.npy").write_bytes(b"partial")
    os.utime(stale, (time.time() - 2 * 86400,) * 2)
    (got,) = token_cache.encode(encoding, [path], "data.path", tok, encode_documents, workers=0)
    np.testing.assert_array_equal(got.tokens, stream(text.encode(text.docs[:10]), text.eod))
    assert (entry / "info.json").exists()
    assert not stale.exists() and fresh.exists()


def test_a_cache_folder_that_cannot_be_written_is_one_line(text, tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / "a_file" / "cache"))
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": text.docs[0]}) + "\n")
    with pytest.raises(ConfigError, match=r"^data.path: the token cache .* cannot be written \(Not a directory\); "
                                          r"set JAXTRAIN_DATA_CACHE to a writable folder$"):
        open_text(str(path), load_tokenizer(str(text.tokenizer)), vocab_size=VOCAB)


def test_processes_opening_the_same_files_at_once_encode_each_file_once(text, tmp_path):
    """Four openers at once (threads: each takes its own lock-file descriptor, as processes do) encode each file
    once; the others wait, then read that entry."""
    import threading

    folder = write_jsonl(text, tmp_path / "jsonl")
    files = resolve_paths(str(folder), "data.path", TEXT_SUFFIXES)
    tok = load_tokenizer(str(text.tokenizer))
    encoding = token_cache.Encoding.of("documents", "text", tok, text_field="text")
    calls, results = [], []

    def counting(*args):
        calls.append(args[1])
        return encode_documents(*args)

    def opener():
        results.append(token_cache.encode(encoding, files, "data.path", tok, counting, workers=0))

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == sorted(files)  # each file encoded once, by whichever opener came first
    assert len(results) == 4
    for r in results:
        for got, want in zip(r, results[0]):
            np.testing.assert_array_equal(got.tokens, want.tokens)
