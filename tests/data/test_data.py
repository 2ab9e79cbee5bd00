"""Data pipeline: packing, sources, global order, process sharding, resume, eval, bad input, prepare-data.

Everything here is numpy-only and small (well under a second per test); the model, multi-process
and end-to-end checks live in test_data_model.py, test_data_multiprocess.py, test_data_e2e.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import build_eval_data, build_train_data
from jaxtrain.data.packing import FIELDS, SequenceSource, pack_window
from jaxtrain.commands.prepare_data import main as prepare_main
from jaxtrain.data.prepare import prepare
from jaxtrain.data.sources import Corpus, open_tokens, write_meta
from jaxtrain.data.tokenizer import BYTES_EOD_ID, load_tokenizer

EOD = 99


def corpus_of(docs: list[list[int]], eod: int | None = EOD) -> Corpus:
    """An in-memory corpus: the documents one after another, each followed by `eod`."""
    stream = [t for d in docs for t in (d + ([eod] if eod is not None else []))]
    arr = np.array(stream, np.uint16)
    return Corpus([arr], ["<mem>"], eod, int(arr.max()))


def write_tokens(dirpath: Path, docs: list[list[int]], *, eod: int = EOD, meta: bool = True, dtype=np.uint16,
                 name: str = "part-0.bin") -> Path:
    """A token file (documents + eod) and, optionally, its meta.json."""
    dirpath.mkdir(parents=True, exist_ok=True)
    arr = np.array([t for d in docs for t in d + [eod]], dtype)
    (dirpath / name).write_bytes(arr.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    if meta:
        write_meta(dirpath / "meta.json", dtype=np.dtype(dtype).name, eod_id=eod, vocab_size=eod + 1,
                   max_id=int(arr.max()), tokenizer="test", files={name: len(arr)}, num_documents=len(docs))
    return dirpath


def random_docs(n: int, seed: int = 0, vocab: int = 90) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=rng.integers(1, 40)).tolist() for _ in range(n)]


def cfg_for(path: Path | str, *extra: str):
    return load_config(None, ["data.source=tokens", f"data.path={path}", "model.vocab_size=128",
                              "data.seq_len=16", "data.global_batch_size=8", *extra])


def take(it, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in FIELDS)


@pytest.fixture
def corpus_dir(tmp_path):
    return write_tokens(tmp_path / "tok", random_docs(60))


# ----------------------------------------------------------------------------- packing


def test_packing_hand_made_documents():
    # Stream: 1 2 3 E 4 5 E 6 7 8 9 E (E = eod); rows of L=5 take stream[5i : 5i + 6].
    src = SequenceSource(corpus_of([[1, 2, 3], [4, 5], [6, 7, 8, 9]]), seq_len=5)
    assert len(src) == 3  # ceil((12 - 1) / 5)
    r0, r1, r2 = src[0], src[1], src[2]
    np.testing.assert_array_equal(r0["tokens"], [1, 2, 3, EOD, 4])
    np.testing.assert_array_equal(r0["targets"], [2, 3, EOD, 4, 5])
    np.testing.assert_array_equal(r0["segment_ids"], [1, 1, 1, 1, 2])
    np.testing.assert_array_equal(r0["positions"], [0, 1, 2, 3, 0])
    np.testing.assert_array_equal(r0["loss_mask"], [1, 1, 1, 0, 1])  # eod -> next doc's first token: masked
    np.testing.assert_array_equal(r1["tokens"], [5, EOD, 6, 7, 8])
    np.testing.assert_array_equal(r1["targets"], [EOD, 6, 7, 8, 9])
    np.testing.assert_array_equal(r1["segment_ids"], [1, 1, 2, 2, 2])
    np.testing.assert_array_equal(r1["positions"], [0, 1, 0, 1, 2])
    np.testing.assert_array_equal(r1["loss_mask"], [1, 0, 1, 1, 1])
    # Last row: the stream ends, the rest is padding (segment 0, out of the loss).
    np.testing.assert_array_equal(r2["tokens"], [9, EOD, 0, 0, 0])
    np.testing.assert_array_equal(r2["segment_ids"], [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(r2["positions"], [0, 1, 0, 0, 0])
    np.testing.assert_array_equal(r2["loss_mask"], [1, 0, 0, 0, 0])
    for r in (r0, r1, r2):
        assert {k: r[k].dtype for k in FIELDS} == {"tokens": np.int32, "targets": np.int32, "segment_ids": np.int32,
                                                   "positions": np.int32, "loss_mask": np.float32}


def test_packing_file_boundary_starts_a_document_without_eod():
    corpus = Corpus([np.array([1, 2, 3], np.uint16), np.array([4, 5], np.uint16)], ["a", "b"], None, 5)
    row = SequenceSource(corpus, seq_len=4)[0]
    np.testing.assert_array_equal(row["tokens"], [1, 2, 3, 4])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0])
    np.testing.assert_array_equal(row["loss_mask"], [1, 1, 0, 1])


def test_packing_covers_every_target_once():
    """Rows tile the stream: each in-document next-token pair is in the loss exactly once."""
    docs = random_docs(30, seed=1)
    src = SequenceSource(corpus_of(docs), seq_len=7)
    pairs = [(int(r["tokens"][j]), int(r["targets"][j])) for r in (src[i] for i in range(len(src)))
             for j in np.flatnonzero(r["loss_mask"])]
    expected = [(a, b) for d in docs for a, b in zip(d + [EOD], d[1:] + [EOD])]
    # Pairs cut at a row boundary start a new segment there; all others match in order.
    assert len(pairs) == len(expected)
    assert pairs == expected
    padding = sum(int((src[i]["segment_ids"] == 0).sum()) for i in range(len(src)))
    assert padding < 7  # only the last row is padded


def test_pack_window_consecutive_eods_are_one_token_documents():
    row = pack_window(np.array([EOD, EOD, 3, 4, EOD]), np.zeros(5, bool), 4, EOD)
    np.testing.assert_array_equal(row["segment_ids"], [1, 2, 3, 3])
    np.testing.assert_array_equal(row["positions"], [0, 0, 0, 1])
    np.testing.assert_array_equal(row["loss_mask"], [0, 0, 1, 1])


# ----------------------------------------------------------------------------- order and sharding


def test_same_config_gives_identical_batches(corpus_dir):
    cfg = cfg_for(corpus_dir)
    a, b = build_train_data(cfg), build_train_data(cfg)
    first, second = take(a, 6), take(b, 6)
    assert same(first, second)
    c = build_train_data(cfg_for(corpus_dir, "data.seed=1"))
    assert not same(first, take(c, 6))  # the seed matters
    for it in (a, b, c):
        it.close()


def test_epochs_cover_every_row_once_and_reshuffle(corpus_dir):
    cfg = cfg_for(corpus_dir, "data.global_batch_size=1", "data.prefetch=0")
    it = build_train_data(cfg)
    n = it.num_sequences
    rows = [next(it)["tokens"][0].tobytes() for _ in range(2 * n)]
    src = SequenceSource(open_tokens(str(corpus_dir), token_dtype="uint16", eod_id=None, vocab_size=128), 16)
    all_rows = sorted(src[i]["tokens"].tobytes() for i in range(n))
    assert sorted(rows[:n]) == all_rows and sorted(rows[n:]) == all_rows
    assert rows[:n] != rows[n:]  # a new order each epoch
    assert rows[:n] != [src[i]["tokens"].tobytes() for i in range(n)]  # shuffled at all
    unshuffled = build_train_data(cfg_for(corpus_dir, "data.global_batch_size=1", "data.shuffle=false"))
    assert [next(unshuffled)["tokens"][0].tobytes() for _ in range(n)] == [src[i]["tokens"].tobytes() for i in range(n)]


@pytest.mark.parametrize("processes", [2, 4])
def test_global_batch_independent_of_process_count(corpus_dir, processes):
    cfg = cfg_for(corpus_dir)
    whole = build_train_data(cfg, 0, 1)
    shards = [build_train_data(cfg, p, processes) for p in range(processes)]
    for _ in range(5):
        expected = next(whole)
        parts = [next(s) for s in shards]
        for k in FIELDS:
            assert parts[0][k].shape == (8 // processes, 16)
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), expected[k])
    for it in [whole, *shards]:
        it.close()


def test_batch_not_divisible_by_processes(corpus_dir):
    with pytest.raises(ConfigError, match="data.global_batch_size=8 is not divisible by the 3 processes"):
        build_train_data(cfg_for(corpus_dir), 0, 3)


# ----------------------------------------------------------------------------- resume


def test_state_round_trip_continues_like_uninterrupted(corpus_dir):
    cfg = cfg_for(corpus_dir, "data.prefetch=3")
    reference = build_train_data(cfg)
    expected = take(reference, 7)[3:]
    it = build_train_data(cfg)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # checkpoints store it as JSON
    resumed = build_train_data(cfg)
    assert not same(take(build_train_data(cfg), 4), expected)  # differs before the restore...
    resumed.set_state(state)
    assert same(take(resumed, 4), expected)  # ...and equals after it
    for x in (reference, it, resumed):
        x.close()


def test_set_state_while_prefetching_discards_the_queue(corpus_dir):
    it = build_train_data(cfg_for(corpus_dir, "data.prefetch=4"))
    first = take(it, 2)
    time.sleep(0.2)  # let the background thread fill its queue with batches 2..5
    it.set_state({"next_sample": 0})
    assert same(take(it, 2), first)


def test_skip_batches_equals_consuming_them(corpus_dir):
    cfg = cfg_for(corpus_dir)
    a, b = build_train_data(cfg), build_train_data(cfg)
    take(a, 1)
    after = take(a, 4)[3]
    take(b, 1)
    b.skip_batches(3)
    assert same([next(b)], [after])
    assert b.get_state() == a.get_state()


def test_close_stops_the_prefetch_thread(corpus_dir):
    def prefetch_threads():
        return [t for t in threading.enumerate() if t.name.startswith("grain-thread-prefetch")]

    before = len(prefetch_threads())
    it = build_train_data(cfg_for(corpus_dir, "data.prefetch=2"))
    next(it)
    assert len(prefetch_threads()) == before + 1 and all(t.daemon for t in prefetch_threads())
    it.close()
    assert len(prefetch_threads()) == before
    assert isinstance(it.last_wait_s, float) and it.last_wait_s >= 0 and it.entropy_floor is None


def test_an_unclosed_iterator_is_collected_and_its_thread_stops(corpus_dir):
    """Nothing the prefetch thread runs may refer back to the iterator, or dropping the last
    reference would leave it (and its thread) alive until the interpreter exits."""
    import gc
    import weakref

    def prefetch_threads():
        return [t for t in threading.enumerate() if t.name.startswith("grain-thread-prefetch") and t.is_alive()]

    before = len(prefetch_threads())
    it = build_train_data(cfg_for(corpus_dir, "data.prefetch=2"))
    next(it)
    alive = weakref.ref(it)
    del it
    gc.collect()
    assert alive() is None
    deadline = time.time() + 10
    while len(prefetch_threads()) > before and time.time() < deadline:
        time.sleep(0.05)
    assert len(prefetch_threads()) == before


# ----------------------------------------------------------------------------- eval


def test_eval_is_one_ordered_pass_then_padding(tmp_path):
    train = write_tokens(tmp_path / "train", random_docs(40))
    held = write_tokens(tmp_path / "held", random_docs(10, seed=5))
    cfg = cfg_for(train, f"data.eval={held}", "data.global_batch_size=4")
    assert build_eval_data(cfg_for(train)) is None
    ev = build_eval_data(cfg)
    src = SequenceSource(open_tokens(str(held), token_dtype="uint16", eod_id=None, vocab_size=128), 16)
    rows = np.concatenate([next(ev)["tokens"] for _ in range(ev.num_batches)])
    np.testing.assert_array_equal(rows[:len(src)], np.stack([src[i]["tokens"] for i in range(len(src))]))
    past_end = next(ev)
    assert past_end["loss_mask"].sum() == 0 and (past_end["segment_ids"] == 0).all()
    ev.reset()
    np.testing.assert_array_equal(next(ev)["tokens"], rows[:4])
    ev.close()


# ----------------------------------------------------------------------------- sources and tokenizers


def test_token_files_without_meta_use_config(tmp_path):
    d = write_tokens(tmp_path / "raw", [[1, 2], [3, 4, 5]], eod=7, meta=False, dtype=np.uint32)
    corpus = open_tokens(str(d), token_dtype="uint32", eod_id=7, vocab_size=8)
    assert corpus.num_tokens == 7 and corpus.eod_id == 7 and corpus.max_id == 7
    assert open_tokens(str(d / "*.bin"), token_dtype="uint32", eod_id=None, vocab_size=8).eod_id is None


def test_many_files_read_as_one_stream(tmp_path):
    d = tmp_path / "multi"
    write_tokens(d, [[1, 2, 3]], name="a.bin", meta=False)
    write_tokens(d, [[4, 5]], name="b.bin", meta=False)
    corpus = open_tokens(str(d), token_dtype="uint16", eod_id=EOD, vocab_size=128)
    tokens, starts = corpus.read(2, 6)
    np.testing.assert_array_equal(tokens, [3, EOD, 4, 5])
    np.testing.assert_array_equal(starts, [False, False, True, False])


def _word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_text_source_with_a_tokenizers_json(tmp_path):
    tok_path = _word_tokenizer(tmp_path / "tok.json")
    tok = load_tokenizer(str(tok_path))
    assert tok.eod_id == 3 and tok.vocab_size == 4  # found '</s>'
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n\n" + json.dumps({"text": "world"}))
    cfg = load_config(None, ["data.source=text", f"data.path={tmp_path}/docs.jsonl", f"data.tokenizer={tok_path}",
                             "model.vocab_size=8", "data.seq_len=4", "data.global_batch_size=1", "data.shuffle=false"])
    it = build_train_data(cfg)
    np.testing.assert_array_equal(next(it)["tokens"][0], [1, 2, 3, 2])
    it.close()


def test_text_source_bytes(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    cfg = load_config(None, ["data.source=text", f"data.path={tmp_path}", "model.vocab_size=260",
                             "data.seq_len=8", "data.global_batch_size=1"])
    row = next(build_train_data(cfg))
    expected = list("héllo".encode()) + [BYTES_EOD_ID]
    np.testing.assert_array_equal(row["tokens"][0][:len(expected)], expected)
    assert row["segment_ids"][0].tolist() == [1] * 7 + [0]


# ----------------------------------------------------------------------------- prepare-data


def test_prepare_data_then_tokens_source(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("first document")
    (tmp_path / "in" / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["second", "third one"]))
    out = tmp_path / "out"
    assert prepare_main(["--input", str(tmp_path / "in"), "--output", str(out), "--shard-tokens", "10"]) == 0
    assert "wrote 32 tokens (3 documents" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["eod_id"] == 256 and meta["dtype"] == "uint16" and meta["num_tokens"] == 32
    assert len(meta["files"]) == 2  # a new shard once one holds >= 10 tokens, at a document boundary
    corpus = open_tokens(str(out), token_dtype="uint32", eod_id=None, vocab_size=257)
    tokens, _ = corpus.read(0, corpus.num_tokens)
    text = bytes(t for t in tokens.tolist() if t != 256).decode()
    assert text == "first documentsecondthird one"
    assert (tokens == 256).sum() == 3


def test_prepare_data_with_tokenizer_json(tmp_path):
    tok_path = _word_tokenizer(tmp_path / "tok.json")
    (tmp_path / "a.txt").write_text("hello world hello")
    s = prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), tokenizer=str(tok_path), dtype="uint32")
    assert s["num_tokens"] == 4 and s["dtype"] == "uint32"
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out" / "tokens-00000.bin", "<u4"), [1, 2, 1, 3])


def test_prepare_data_refuses_non_empty_output_and_writes_nothing_on_error(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--output: directory .* is not empty"):
        prepare_main(["--input", str(tmp_path / "a.txt"), "--output", str(out)])
    with pytest.raises(ConfigError, match="--input: .*missing.txt' does not exist"):
        prepare_main(["--input", str(tmp_path / "missing.txt"), "--output", str(tmp_path / "new")])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 is not valid JSON"):
        prepare_main(["--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "a.txt", "bad.jsonl", "out"]


def test_prepare_data_skips_and_counts_empty_files(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "a.txt").write_text("text")
    (corpus / "empty.txt").write_text("")  # real corpora hold empty files (an empty __init__.py)
    (corpus / "pkg" / "empty.jsonl").write_text("")
    out = tmp_path / "out"
    assert prepare_main(["--input", str(corpus), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 documents from 1 input file(s)" in printed and "skipped 2 empty file(s)" in printed, printed
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_tokens"] == 5 and meta["skipped_empty_files"] == 2
    # Only a corpus of nothing but empty files is refused, and nothing is written then.
    with pytest.raises(ConfigError, match=r"--input: all 2 file\(s\) are empty"):
        prepare_main(["--input", str(corpus / "empty.txt"), str(corpus / "pkg"), "--output", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists()


def test_prepare_data_directory_without_text_files_says_how_to_pass_others(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# notes")
    with pytest.raises(ConfigError, match=r"has no .txt or .jsonl files; to read files with other names, pass "
                                          r"them or a quoted glob, e\.g\. '.*docs/\*\.md'"):
        prepare_main(["--input", str(tmp_path / "docs"), "--output", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="unrecognized arguments: --frobnicate"):  # one line, not usage + error
        prepare_main(["--input", str(tmp_path / "docs"), "--output", str(tmp_path / "out"), "--frobnicate"])
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- bad input -> ConfigError


def _bad_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides, regex the message must match): each names the file or key."""
    (tmp / "empty.bin").write_bytes(b"")
    (tmp / "emptydir").mkdir()
    (tmp / "odd.bin").write_bytes(b"\x01\x00\x02")
    write_tokens(tmp / "big", [[1, 2, 500]], meta=False)
    write_tokens(tmp / "bigmeta", [[1, 2, 500]])
    d = write_tokens(tmp / "badmeta", [[1, 2]])
    (d / "meta.json").write_text("{not json")
    d = write_tokens(tmp / "trunc", [[1, 2, 3, 4]])
    (d / "part-0.bin").write_bytes((d / "part-0.bin").read_bytes()[:4])
    good = write_tokens(tmp / "good", [[1, 2, 3]])
    (tmp / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp / "broken.json").write_text("{}")
    (tmp / "a.txt").write_text("hello")
    text = ["data.source=text", "model.vocab_size=260"]
    return {
        "missing path": ([f"data.path={tmp}/nope.bin"], r"data.path: .*nope.bin' does not exist"),
        "glob matches nothing": ([f"data.path={tmp}/*.nothing"], r"data.path: the glob .* matches no files"),
        "empty file": ([f"data.path={tmp}/empty.bin"], r"data.path: file .*empty.bin' is empty"),
        "empty directory": ([f"data.path={tmp}/emptydir"], r"data.path: directory .*emptydir' has no .bin files"),
        "partial token": ([f"data.path={tmp}/odd.bin"], r"odd.bin' has 3 bytes, not a whole number of uint16"),
        "id >= vocab (scan)": ([f"data.path={tmp}/big", "data.eod_id=99"], r"token id 500 but model.vocab_size=128"),
        "id >= vocab (meta)": ([f"data.path={tmp}/bigmeta"], r"token id 500 but model.vocab_size=128"),
        "bad meta.json": ([f"data.path={tmp}/badmeta"], r"badmeta/meta.json' is not valid JSON"),
        "truncated file": ([f"data.path={tmp}/trunc"], r"part-0.bin' has 2 tokens but .*meta.json says 5"),
        "eod disagrees": ([f"data.path={good}", "data.eod_id=5"], r"disagree on the end-of-document id"),
        "missing eval": ([f"data.path={good}", f"data.eval={tmp}/nope"], r"data.eval: .*nope' does not exist"),
        "fewer rows than a global batch": ([f"data.path={good}"], r"data.path: the data fills 1 row\(s\) .* fewer than "
                                           r"one global batch \(data.global_batch_size=8\)"),
        "jsonl without text": ([*text, f"data.path={tmp}/bad.jsonl"], r"bad.jsonl:2 has no string field 'text'"),
        "tokenizer missing": ([*text, f"data.path={tmp}/a.txt", f"data.tokenizer={tmp}/none.json"],
                              r"data.tokenizer: tokenizer file .*none.json' does not exist"),
        "tokenizer broken": ([*text, f"data.path={tmp}/a.txt", f"data.tokenizer={tmp}/broken.json"],
                             r"data.tokenizer: tokenizer file .*broken.json' does not load"),
    }


def test_every_bad_input_is_a_config_error_naming_file_or_key(tmp_path):
    for name, (overrides, pattern) in _bad_cases(tmp_path).items():
        with pytest.raises(ConfigError, match=pattern):
            build_train_data(cfg_for("unused", *overrides))
            pytest.fail(f"no error for {name}")


@pytest.mark.parametrize("overrides, pattern", [
    (["data.source=text", "data.path=x", "model.vocab_size=256"], r"data.tokenizer=bytes needs model.vocab_size >= 257"),
    (["data.source=tokens", "data.path=x", "data.eod_id=300"], r"data.eod_id=300 must be within"),
    (["data.source=tokens", "data.path=x", "data.seq_len=4096"], r"data.seq_len=4096 is larger than model.max_seq_len"),
    (["data.source=tokens"], r"data.source=tokens needs data.path"),
])
def test_config_level_data_errors(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


def test_state_from_another_source_is_a_config_error(corpus_dir):
    it = build_train_data(cfg_for(corpus_dir))
    with pytest.raises(ConfigError, match="written for another data.source"):
        it.set_state({"index": 3})  # a markov iterator's state
    it.set_state({"next_sample": np.int64(8)})  # numpy ints, as a checkpoint library may return
    assert it.get_state() == {"next_sample": 8}
    it.close()


def test_every_training_source_is_the_trainers_train_data(corpus_dir):
    """The Trainer calls its data source's methods directly (no probing): every source
    `build_train_data` returns is a `TrainData` (jaxtrain/data/pipeline.py)."""
    from jaxtrain.data.pipeline import TrainData
    for cfg in (cfg_for(corpus_dir), load_config(None, ["data.source=markov", "data.seq_len=16",
                                                        "data.global_batch_size=8"])):
        it = build_train_data(cfg)
        try:
            assert isinstance(it, TrainData), type(it)
            assert it.position == 0 and it.last_wait_s >= 0 and it.num_batches != 0
            next(it)
            assert it.position == 1
        finally:
            it.close()
