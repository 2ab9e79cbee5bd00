"""The record sources (ArrayRecord, Parquet, Hugging Face `datasets` files), local and in gs:// / s3://
buckets, and the text source (.txt/.jsonl), through the real reading path: `build_train_data` on a config,
one epoch in file order.

Every file is written here from real text (the standard library's source, tests/real_text.py) with a
tokenizer trained here; what training reads is compared with an independent reading of the same files
(pyarrow.parquet.read_table, array_record's ArrayRecordReader, datasets.load_from_disk /
Dataset.from_file, tokenized with `tokenizers` directly): the documents in order, each followed by the
eod id, empty ones left out. One process reads it all; two processes (0 and 1 of 2) each read their rows
and together give the same batches (prepare-data's ArrayRecord files: each reads fewer than all records,
none at open). A bucket's object is copied once per version, and retried only on errors that may pass.
Bad input is one ConfigError line naming the key and the file (the object's URL for a bucket), and
`jaxtrain train` on it exits 2 with that line, no traceback and no run directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from helpers import TINY, epoch_rows
from real_text import EOT, stdlib_sources, train_tokenizer
from storage_servers import storage_servers

from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import arrayrecord_source, build_train_data
from jaxtrain.data.documents import DocumentStream, iter_rows
from jaxtrain.data.packing import FIELDS
from jaxtrain.data.prepare import prepare

VOCAB = 512
SEQ_LEN, BATCH = 64, 8
BUCKET = "jaxtrain-records"


# ----------------------------------------------------------------------------- real text, read independently


class Text:
    """Documents of real text and a tokenizer trained on them, used through `tokenizers` itself."""

    def __init__(self, root: Path):
        files = stdlib_sources(60_000)
        # Blank-line separated pieces (code blocks, docstrings): ~350 documents of uneven length.
        self.docs = [piece for f in files for piece in f.read_text(encoding="utf-8").split("\n\n")]
        self.docs.insert(3, "")  # an empty document: it adds nothing, not even an eod
        self.tokenizer = train_tokenizer(files, root / "tokenizer.json", VOCAB)
        from tokenizers import Tokenizer
        self._tok = Tokenizer.from_file(str(self.tokenizer))
        self.eod = self._tok.token_to_id(EOT)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def halves(self) -> tuple[list[str], list[str]]:
        cut = len(self.docs) // 2
        return self.docs[:cut], self.docs[cut:]


def stream(docs_ids: list[list[int]], eod: int) -> np.ndarray:
    """The documents one after another, each followed by `eod`; empty ones left out."""
    return np.array([t for d in docs_ids if len(d) for t in (*d, eod)], np.int64)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Text:
    return Text(tmp_path_factory.mktemp("text"))


# ----------------------------------------------------------------------------- reading one epoch


def one_epoch(overrides: list[str], process_count: int) -> dict[str, np.ndarray]:
    """The rows of one epoch (file order) as `build_train_data` gives them, the processes' shares put together."""
    cfg = load_config(None, [*overrides, f"model.vocab_size={VOCAB}", f"data.seq_len={SEQ_LEN}",
                             f"data.global_batch_size={BATCH}", "data.shuffle=false"])
    return epoch_rows(cfg, process_count)


def assert_epoch_is(rows: dict[str, np.ndarray], expected: np.ndarray) -> None:
    """Row i holds stream tokens [i*L, i*L + L + 1): the inputs of all rows, in order, are the stream."""
    got = np.concatenate([t[s > 0] for t, s in zip(rows["tokens"], rows["segment_ids"])])
    assert len(expected) - 1 <= len(got) <= len(expected)  # the very last token is only a target
    np.testing.assert_array_equal(got, expected[:len(got)])


def check_source(overrides: list[str], expected: np.ndarray) -> None:
    """One process reads `expected`; two processes, each its rows, give the same batches between them."""
    one = one_epoch(overrides, 1)
    assert_epoch_is(one, expected)
    two = one_epoch(overrides, 2)
    for k in FIELDS:
        np.testing.assert_array_equal(two[k], one[k])


# ----------------------------------------------------------------------------- writers (one per case)


def write_arrayrecord_json(text: Text, folder: Path, field: str = "text") -> Path:
    folder.mkdir(parents=True)
    for i, half in enumerate(text.halves()):
        w = ArrayRecordWriter(str(folder / f"rows-{i}.arrayrecord"), "group_size:16")
        for n, doc in enumerate(half):
            w.write(json.dumps({"id": n, field: doc}).encode())
        w.close()
    return folder


def read_arrayrecord_json(folder: Path, text: Text) -> np.ndarray:
    docs = []
    for f in sorted(folder.glob("*.arrayrecord")):
        r = ArrayRecordReader(str(f))
        docs += [json.loads(rec)["text"] for rec in r.read_all()]
        r.close()
    return stream(text.encode(docs), text.eod)


def write_jsonl(text: Text, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for i, half in enumerate(text.halves()):
        (folder / f"part{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in half))
    return folder


def write_prepared(text: Text, folder: Path, output_format: str = "arrayrecord") -> Path:
    src = write_jsonl(text, folder.parent / f"{folder.name}-jsonl")
    with open(os.devnull, "w") as quiet:
        prepare([str(src)], str(folder), tokenizer=str(text.tokenizer), output_format=output_format,
                shard_tokens=8_000, progress=quiet)
    return folder


def read_token_files(folder: Path) -> np.ndarray:
    """prepare-data's token files, read with numpy: the .bin files in name order, in meta.json's dtype."""
    dtype = np.dtype(json.loads((folder / "meta.json").read_text())["dtype"]).newbyteorder("<")
    return np.concatenate([np.fromfile(f, dtype) for f in sorted(folder.glob("*.bin"))]).astype(np.int64)


def read_prepared(folder: Path) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    docs = []
    for f in sorted(folder.glob("*.arrayrecord")):
        r = ArrayRecordReader(str(f))
        docs += [np.frombuffer(rec, "<u4").tolist() for rec in r.read_all()]
        r.close()
    return stream(docs, meta["eod_id"])


def write_parquet(text: Text, folder: Path, tokens: bool = False) -> Path:
    folder.mkdir(parents=True)
    for i, half in enumerate(text.halves()):
        cols = {"id": list(range(len(half)))}
        cols.update({"ids": pa.array(text.encode(half), pa.list_(pa.int32()))} if tokens else {"text": half})
        pq.write_table(pa.table(cols), folder / f"part-{i}.parquet", row_group_size=40)  # several row groups
    return folder


def read_parquet(folder: Path, text: Text, column: str) -> np.ndarray:
    values = [v for f in sorted(folder.glob("*.parquet")) for v in pq.read_table(f).column(column).to_pylist()]
    return stream(values if column == "ids" else text.encode(values), text.eod)


def saved_dataset(text: Text, folder: Path, tokens: bool = False) -> Path:
    import datasets
    column = {"input_ids": text.encode(text.docs)} if tokens else {"text": text.docs}
    datasets.Dataset.from_dict(column).save_to_disk(str(folder), num_shards=3)
    return folder


# ----------------------------------------------------------------------------- each source, one epoch


def test_arrayrecord_json_text_records(text, tmp_path):
    folder = write_arrayrecord_json(text, tmp_path / "ar")
    check_source(["data.source=arrayrecord", f"data.path={folder}", f"data.tokenizer={text.tokenizer}"],
                 read_arrayrecord_json(folder, text))


def test_arrayrecord_json_token_records(text, tmp_path):
    folder = tmp_path / "ar"
    folder.mkdir()
    w = ArrayRecordWriter(str(folder / "rows.arrayrecord"), "group_size:1")
    for ids in text.encode(text.docs):
        w.write(json.dumps({"tokens": ids}).encode())
    w.close()
    r = ArrayRecordReader(str(folder / "rows.arrayrecord"))
    expected = stream([json.loads(rec)["tokens"] for rec in r.read_all()], text.eod)
    check_source(["data.source=arrayrecord", f"data.path={folder}", f"data.tokenizer={text.tokenizer}",
                  "data.tokens_field=tokens"], expected)


def test_arrayrecord_written_by_prepare_data(text, tmp_path):
    folder = write_prepared(text, tmp_path / "prepared")
    names = sorted(p.name for p in folder.iterdir())
    parts = [n for n in names if n.endswith(".arrayrecord")]
    assert len(parts) > 1 and parts[0] == "part-00000.arrayrecord", names  # --shard-tokens split it
    assert names == sorted(["meta.json", *parts, *(p + ".lengths.npy" for p in parts)])
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format"] == "jaxtrain.arrayrecord_tokens" and meta["eod_id"] == text.eod
    expected = read_prepared(folder)
    # The records are the text's documents, tokenized: the same stream as tokenizing it here.
    np.testing.assert_array_equal(expected, stream(text.encode(text.docs), text.eod))
    assert meta["num_documents"] == sum(1 for d in text.encode(text.docs) if d) and meta["num_tokens"] == len(expected)
    for p in parts:  # the lengths file says how long each record is without reading them
        r = ArrayRecordReader(str(folder / p))
        np.testing.assert_array_equal(np.load(folder / f"{p}.lengths.npy"), [len(x) // 4 for x in r.read_all()])
    # data.tokenizer is not needed: the ids and the eod id are meta.json's.
    check_source(["data.source=arrayrecord", f"data.path={folder}"], expected)


def test_prepared_arrayrecord_is_read_lazily_by_each_process(text, tmp_path, monkeypatch):
    """Opening reads no record; each of two processes reads only the documents of its rows (fewer than all),
    and between them every document."""
    folder = write_prepared(text, tmp_path / "prepared")
    seen: dict[int, set] = {}
    current = [0]
    real_call = arrayrecord_source._RandomReader.__call__

    def counted(self, i):
        seen.setdefault(current[0], set()).add((self.path.name, i))
        return real_call(self, i)

    monkeypatch.setattr(arrayrecord_source._RandomReader, "__call__", counted)
    cfg = load_config(None, ["data.source=arrayrecord", f"data.path={folder}", f"model.vocab_size={VOCAB}",
                             f"data.seq_len={SEQ_LEN}", f"data.global_batch_size={BATCH}", "data.shuffle=false",
                             "data.prefetch=0"])
    total = sum(len(np.load(f)) for f in folder.glob("*.lengths.npy"))
    for p in (0, 1):
        current[0] = p
        data = build_train_data(cfg, p, 2)
        assert not seen.get(p)  # nothing read at open (only lengths and meta.json)
        for _ in range(data.num_batches):
            next(data)
        data.close()
    assert 0 < len(seen[0]) < total and 0 < len(seen[1]) < total
    assert len(seen[0] | seen[1]) == total


def test_parquet_text_column(text, tmp_path):
    folder = write_parquet(text, tmp_path / "pq")
    check_source(["data.source=parquet", f"data.path={folder}", f"data.tokenizer={text.tokenizer}"],
                 read_parquet(folder, text, "text"))


def test_parquet_token_column(text, tmp_path):
    folder = write_parquet(text, tmp_path / "pq", tokens=True)
    check_source(["data.source=parquet", f"data.path={folder}/*.parquet", f"data.tokenizer={text.tokenizer}",
                  "data.tokens_field=ids"], read_parquet(folder, text, "ids"))


@pytest.mark.parametrize("tokens", [False, True], ids=["text", "input_ids"])
def test_hf_datasets_saved_to_disk(text, tmp_path, tokens):
    import datasets
    folder = saved_dataset(text, tmp_path / "saved", tokens)
    # A cache file beside the saved shards (what `map` leaves) is not part of the dataset.
    shutil.copy(next(folder.glob("data-00000-*.arrow")), folder / "cache-0123456789abcdef.arrow")
    loaded = datasets.load_from_disk(str(folder))
    expected = stream(list(loaded["input_ids"]) if tokens else text.encode(list(loaded["text"])), text.eod)
    check_source(["data.source=hf_datasets", f"data.path={folder}", f"data.tokenizer={text.tokenizer}",
                  *(["data.tokens_field=input_ids"] if tokens else [])], expected)


def test_hf_datasets_arrow_files_stream_and_file_format(text, tmp_path):
    import datasets
    first, second = text.halves()
    datasets.Dataset.from_dict({"text": first}).save_to_disk(str(tmp_path / "one"))
    folder = tmp_path / "arrow"
    folder.mkdir()
    shutil.copy(tmp_path / "one" / "data-00000-of-00001.arrow", folder / "a.arrow")  # IPC stream format
    table = pa.table({"text": second})
    with pa.ipc.new_file(str(folder / "b.arrow"), table.schema) as w:  # IPC file format, two batches
        for batch in table.to_batches(max_chunksize=50):
            w.write_batch(batch)
    texts = list(datasets.Dataset.from_file(str(folder / "a.arrow"))["text"])
    texts += pa.ipc.open_file(str(folder / "b.arrow")).read_all().column("text").to_pylist()
    check_source(["data.source=hf_datasets", f"data.path={folder}/*.arrow", f"data.tokenizer={text.tokenizer}"],
                 stream(text.encode(texts), text.eod))


def test_hf_datasets_parquet_from_to_parquet(text, tmp_path):
    import datasets
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_dict({"text": text.docs}).to_parquet(str(path), batch_size=100)
    check_source(["data.source=hf_datasets", f"data.path={path}", f"data.tokenizer={text.tokenizer}"],
                 stream(text.encode(pq.read_table(path).column("text").to_pylist()), text.eod))


def test_text_source_txt_and_jsonl_files(text, tmp_path):
    """data.source=text over a directory: its .jsonl files one document a line (an empty one left out), each .txt
    file one document, in sorted file order; other files are not read."""
    first, second = text.halves()
    folder = tmp_path / "text"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(first)))
    books = ["\n\n".join(second[:len(second) // 2]), "\n\n".join(second[len(second) // 2:])]
    (folder / "b.txt").write_text(books[0], encoding="utf-8")
    (folder / "sub" / "c.txt").write_text(books[1], encoding="utf-8")
    (folder / "notes.md").write_text("not a document of this corpus")
    assert "" in first  # the empty document (Text puts it in the first half)
    check_source(["data.source=text", f"data.path={folder}", f"data.tokenizer={text.tokenizer}"],
                 stream(text.encode([*first, *books]), text.eod))


def test_rows_are_the_files_rows(text, tmp_path):
    """`iter_rows` (what chat and prompt/completion data read) gives every row's fields, in file order."""
    ar = write_arrayrecord_json(text, tmp_path / "ar")
    rows = [row for _, row in iter_rows("arrayrecord", str(ar), "data.path")]
    records = [rec for f in sorted(ar.glob("*.arrayrecord")) for rec in ArrayRecordReader(str(f)).read_all()]
    assert rows == [json.loads(rec) for rec in records]
    pqd = write_parquet(text, tmp_path / "pq")
    rows = [row for _, row in iter_rows("parquet", str(pqd), "data.path")]
    assert rows == [r for f in sorted(pqd.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    import datasets
    saved = saved_dataset(text, tmp_path / "saved")
    rows = [row for _, row in iter_rows("hf_datasets", str(saved), "data.path")]
    assert rows == datasets.load_from_disk(str(saved)).to_list()


def test_document_stream_reads_only_the_documents_a_slice_touches():
    docs = [[1, 2, 3], [], [4], [5, 6, 7, 8], [9, 10]]
    reads: list[int] = []

    def read(i):
        reads.append(i)
        return np.array(docs[i])

    for eod in (99, None):
        s = DocumentStream(np.array([len(d) for d in docs]), read, eod)
        full = [t for d in docs if d for t in (*d, *([eod] if eod is not None else []))]
        assert len(s) == len(full) and s.num_documents == 4
        for lo in range(len(full) + 1):
            for hi in range(lo, len(full) + 2):
                assert s[lo:hi].tolist() == full[lo:hi], (eod, lo, hi)
        reads.clear()
        assert s[4:7].tolist() == full[4:7]
        assert reads == ([2, 3] if eod is not None else [3])  # the empty document 1 is never asked for
    assert DocumentStream(np.array([3]), read, 99)[-1] == 99 and DocumentStream(np.array([3]), read, 99)[2] == 3


# ----------------------------------------------------------------------------- buckets


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with storage_servers(tmp_path_factory.mktemp("servers"), [BUCKET]) as env:
        yield env


def upload(local: Path, url: str) -> None:
    from jaxtrain.storage import object_store
    fs = object_store.filesystem(url)
    for f in sorted(local.rglob("*")):
        if f.is_file():
            fs.put_file(str(f), f"{url}/{f.relative_to(local).as_posix()}")
    fs.invalidate_cache()


@pytest.mark.parametrize("scheme", ["gs", "s3"])
@pytest.mark.parametrize("kind", ["parquet", "prepared_arrayrecord", "hf_datasets", "tokens", "text"])
def test_sources_in_a_bucket(servers, text, tmp_path, monkeypatch, scheme, kind):
    monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    if kind == "tokens":  # prepare-data's token files: meta.json comes along
        folder = write_prepared(text, tmp_path / "data", "tokens")
        source, expected = "tokens", read_token_files(folder)
        assert len(list(folder.glob("*.bin"))) > 1
    elif kind == "text":  # .jsonl tokenized at open
        folder = write_jsonl(text, tmp_path / "data")
        source, expected = "text", stream(text.encode(text.docs), text.eod)
    elif kind == "parquet":
        folder = write_parquet(text, tmp_path / "data")
        source, expected = "parquet", read_parquet(folder, text, "text")
    elif kind == "prepared_arrayrecord":  # meta.json and the lengths files come along
        folder = write_prepared(text, tmp_path / "data")
        source, expected = "arrayrecord", read_prepared(folder)
    else:  # state.json says the order of the shards
        folder = saved_dataset(text, tmp_path / "data")
        source, expected = "hf_datasets", stream(text.encode(text.docs), text.eod)
    url = f"{scheme}://{BUCKET}/{kind}-{tmp_path.name}"
    upload(folder, url)
    check_source([f"data.source={source}", f"data.path={url}", f"data.tokenizer={text.tokenizer}"], expected)
    copies = [p for p in (tmp_path / "cache" / scheme).rglob("*") if p.is_file() and not p.name.endswith(".source")]
    assert sorted(p.name for p in copies) == sorted(p.name for p in folder.iterdir() if p.suffix != ".json"
                                                   or p.name in ("meta.json", "state.json"))
    if kind == "tokens":  # a rewritten object is fetched again, and the error names it and its meta.json by URL
        first = sorted(folder.glob("*.bin"))[0]
        first.write_bytes(first.read_bytes()[:-2])
        upload(folder, url)
        with pytest.raises(ConfigError, match=rf"^data\.path: file '{url}/{first.name}' has \d+ tokens but "
                                              rf"{url}/meta\.json says \d+ \(truncated or rewritten\)$"):
            one_epoch([f"data.source={source}", f"data.path={url}"], 1)


def test_a_bucket_object_is_copied_once_and_again_when_it_changes(servers, text, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    first, second = text.halves()
    url = f"s3://{BUCKET}/changes-{tmp_path.name}/train.parquet"
    from jaxtrain.storage import object_store
    fs = object_store.filesystem(url)
    pq.write_table(pa.table({"text": first}), tmp_path / "a.parquet")
    fs.put_file(str(tmp_path / "a.parquet"), url)
    overrides = ["data.source=parquet", f"data.path={url}", f"data.tokenizer={text.tokenizer}"]
    assert_epoch_is(one_epoch(overrides, 1), stream(text.encode(first), text.eod))
    copy = next((tmp_path / "cache").rglob("train.parquet"))
    stamp = copy.stat().st_mtime_ns, copy.stat().st_ino
    assert_epoch_is(one_epoch(overrides, 1), stream(text.encode(first), text.eod))
    assert (copy.stat().st_mtime_ns, copy.stat().st_ino) == stamp  # the same version: not copied again
    pq.write_table(pa.table({"text": second}), tmp_path / "b.parquet")
    fs.put_file(str(tmp_path / "b.parquet"), url)
    assert_epoch_is(one_epoch(overrides, 1), stream(text.encode(second), text.eod))
    assert not [p for p in copy.parent.iterdir() if ".tmp-" in p.name]  # no partial copy left behind


def test_bucket_errors_are_one_line_naming_the_url(servers, text, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    folder = write_parquet(text, tmp_path / "pq")
    for scheme in ("gs", "s3"):
        url = f"{scheme}://{BUCKET}/no-such-folder"
        with pytest.raises(ConfigError, match=rf"^data\.path: '{url}' does not exist") as e:
            one_epoch(["data.source=parquet", f"data.path={url}"], 1)
        assert "\n" not in str(e.value)
        url = f"{scheme}://{BUCKET}/errors-{tmp_path.name}"
        upload(folder, url)
        # The message names the object, not its copy in the cache.
        with pytest.raises(ConfigError, match=rf"^data\.path: '{url}/part-0\.parquet' has no column 'body'") as e:
            one_epoch(["data.source=parquet", f"data.path={url}", "data.text_field=body"], 1)
        assert "\n" not in str(e.value)


class FlakyStore:
    """A bucket client whose reads fail with `error` the first `failures` times (the emulators cannot be told to)."""

    def __init__(self, error: Exception, failures: int):
        self.error, self.failures, self.opens = error, failures, 0

    def invalidate_cache(self, *_):
        pass

    def info(self, url):
        return {"name": url.split("://")[1], "type": "file", "size": 5, "ETag": "v1"}

    def ls(self, url, detail=True):
        return [self.info(f"{url}/x.parquet")]

    def open(self, url, mode="rb"):
        import io
        self.opens += 1
        if self.opens <= self.failures:
            raise self.error
        return io.BytesIO(b"12345")


@pytest.mark.parametrize("error, failures, outcome", [
    (ConnectionResetError("reset by peer"), 2, None),  # transient twice, then copied
    (TimeoutError("read timed out"), 99, "TransientStorageError"),  # never answers: exit 75, not 2
    (PermissionError("Forbidden"), 1, "ConfigError"),  # a definite no: at once, no retry
])
def test_copies_retry_only_what_may_pass(tmp_path, monkeypatch, error, failures, outcome):
    from jaxtrain.data import remote_files
    from jaxtrain.storage import object_store
    store = FlakyStore(error, failures)
    monkeypatch.setattr(object_store, "check_access", lambda *a, **k: None)
    monkeypatch.setattr(object_store, "filesystem", lambda url: store)
    monkeypatch.setattr(remote_files, "RETRY_FIRST_WAIT_S", 0.0)
    url = "s3://b/x.parquet"
    if outcome is None:
        [copy] = remote_files.local_files(url, "data.path", (".parquet",), cache_dir=str(tmp_path))
        assert copy.read_bytes() == b"12345" and store.opens == 3
        return
    expected = object_store.TransientStorageError if outcome == "TransientStorageError" else ConfigError
    with pytest.raises(expected, match=r"^data\.path: copying 's3://b/x\.parquet': ") as e:
        remote_files.local_files(url, "data.path", (".parquet",), cache_dir=str(tmp_path))
    assert "\n" not in str(e.value)
    assert store.opens == (remote_files.RETRY_ATTEMPTS if outcome == "TransientStorageError" else 1)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no partial copy, nothing to mistake for one


# ----------------------------------------------------------------------------- bad input


def bad_cases(text: Text, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (config overrides, the ConfigError line it must be)."""
    tok = f"data.tokenizer={text.tokenizer}"
    pqd = write_parquet(text, tmp / "pq")
    floats = tmp / "floats.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1.0, 2.5]], pa.list_(pa.float64()))}), floats)
    strings = tmp / "strings"
    strings.mkdir()
    w = ArrayRecordWriter(str(strings / "r.arrayrecord"))
    w.write(json.dumps({"tokens": [5, 6]}).encode())
    w.write(json.dumps({"tokens": ["a", "b"]}).encode())
    w.close()
    numbers = tmp / "numbers"
    numbers.mkdir()
    w = ArrayRecordWriter(str(numbers / "r.arrayrecord"))
    w.write(json.dumps({"text": 5}).encode())
    w.close()
    garbage = tmp / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all" * 10)
    import datasets
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]}),
                          "test": datasets.Dataset.from_dict({"text": ["b"]})}).save_to_disk(str(tmp / "dict"))
    return {
        "missing path": (["data.source=parquet", f"data.path={tmp}/missing", tok],
                         rf"^data\.path: '{tmp}/missing' does not exist"),
        "missing column": (["data.source=parquet", f"data.path={pqd}", "data.text_field=body", tok],
                           rf"^data\.path: '{pqd}/part-0\.parquet' has no column 'body' \(its columns: id, text\); "
                           r"set data\.text_field$"),
        "token column of floats": (["data.source=parquet", f"data.path={floats}", "data.tokens_field=ids", tok],
                                   rf"^data\.path: column 'ids' of '{floats}' holds lists of double, not lists of "
                                   "integer token ids"),
        "token field of strings": (["data.source=arrayrecord", f"data.path={strings}", "data.tokens_field=tokens", tok],
                                   rf"^data\.path: {strings}/r\.arrayrecord:row 1 field 'tokens' is not a list of "
                                   "token ids"),
        "text field not a string": (["data.source=arrayrecord", f"data.path={numbers}", tok],
                                    rf"^data\.path: {numbers}/r\.arrayrecord:row 0 has no string field 'text' \(a int"),
        "unreadable file": (["data.source=parquet", f"data.path={garbage}", tok],
                            rf"^data\.path: '{garbage}' is not a readable Parquet file"),
        "DatasetDict": (["data.source=hf_datasets", f"data.path={tmp}/dict", tok],
                        rf"^data\.path: '{tmp}/dict' is a DatasetDict saved to disk \(splits test, train\); name one "
                        rf"split's folder, e.g. '{tmp}/dict/train'$"),
    }


def test_bad_input_is_one_config_error_line_naming_key_and_file(text, tmp_path):
    for name, (overrides, pattern) in bad_cases(text, tmp_path).items():
        with pytest.raises(ConfigError, match=pattern) as e:
            one_epoch(overrides, 1)
        assert "\n" not in str(e.value), name


def test_train_cli_exits_2_on_a_missing_column_and_writes_nothing(text, tmp_path, jaxtrain_train):
    pqd = write_parquet(text, tmp_path / "pq")
    run = tmp_path / "run"
    r = jaxtrain_train("--config", TINY, "--cpu-devices", "1", "data.source=parquet", f"data.path={pqd}",
                       "data.text_field=body", f"data.tokenizer={text.tokenizer}", f"model.vocab_size={VOCAB}",
                       f"run.output_dir={run}", "checkpoint.compilation_cache_dir=null", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error")]
    assert len(errors) == 1 and f"data.path: '{pqd}/part-0.parquet' has no column 'body'" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not run.exists()
