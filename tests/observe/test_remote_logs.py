"""Run logs in a bucket, against the real local GCS and S3 servers (tests/storage_servers.py).

The logs are written as bounded segments by a background thread: the bytes uploaded over a run
grow linearly with the bytes written and no upload is larger than a segment; an event returns
without waiting for a slow store, yet is uploaded at once; close() stores everything; a resumed
run continues after the existing segments with one listing and never rewrites one; a killed
writer loses only what was written since its last upload; TensorBoard gets new event files
(each with its own header) instead of one rewritten file; and every reader (read_log, goodput,
the launchers' blame) reads the segments after the whole object of a run written before them.
The code under test is the real RunLog / AppendOnlyFile; only `object_store.filesystem` is wrapped,
to count (or slow down) the writes of the real fsspec client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from storage_servers import clear_client_caches, storage_servers  # noqa: E402

from jaxtrain.storage import appended_log, object_store  # noqa: E402
from jaxtrain.observe import runlog  # noqa: E402
from jaxtrain.observe.runlog import RunLog  # noqa: E402

BUCKET = "jaxtrain-logs"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with storage_servers(tmp_path_factory.mktemp("servers"), [BUCKET]) as env:
        yield env


class Recording:
    """The real filesystem of a URL, recording every object write (path, bytes) and listing;
    `delay_s` makes each write that much slower (a slow or distant store)."""

    def __init__(self, real, delay_s: float = 0.0):
        self._real, self.delay_s = real, delay_s
        self.writes: list[tuple[str, int]] = []
        self.listings = 0

    def pipe_file(self, path, value, **kwargs):
        time.sleep(self.delay_s)
        self.writes.append((path.split("://", 1)[-1], len(value)))
        return self._real.pipe_file(path, value, **kwargs)

    def pipe(self, *args, **kwargs):
        raise AssertionError("a write this test does not count")

    def open(self, path, mode="rb", **kwargs):
        assert "r" in mode, "a write this test does not count"
        return self._real.open(path, mode, **kwargs)

    def ls(self, *args, **kwargs):
        self.listings += 1
        return self._real.ls(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture
def recording(servers, monkeypatch):
    """Every object_store.filesystem() answers one Recording of the real client (fresh caches)."""
    clear_client_caches()
    made: dict[str, Recording] = {}
    real = object_store.filesystem

    def filesystem(url):
        scheme = object_store.split_url(url)[0]
        if scheme not in made:
            made[scheme] = Recording(real(url))
        return made[scheme]

    monkeypatch.setattr(object_store, "filesystem", filesystem)
    return lambda scheme: filesystem(f"{scheme}://{BUCKET}")


def objects(url: str) -> dict[str, bytes]:
    """Every object under `url` and its bytes, fresh from the server."""
    fs = object_store.filesystem(url)
    fs.invalidate_cache()
    scheme = object_store.split_url(url)[0]
    return {f"{scheme}://{o.split('://')[-1]}": fs.cat_file(o) for o in sorted(fs.find(url))}


def line(i: int) -> str:
    return json.dumps({"step": i, "loss": 1.0 / (i + 1), "pad": "x" * 80}) + "\n"


def upload_cost(url: str, lines: int, fs: Recording) -> tuple[int, int, int]:
    """(bytes uploaded, largest upload, bytes written) for `lines` lines, each stored before the next."""
    before = len(fs.writes)
    f = appended_log.AppendOnlyFile(url, flush_interval_s=3600)
    written = 0
    for i in range(lines):
        f.write(line(i))
        written += len(line(i))
        f.flush()  # the worst case: one upload per line (an event after every metrics line)
    f.close()
    sizes = [n for _, n in fs.writes[before:]]
    return sum(sizes), max(sizes), written


def test_bytes_uploaded_grow_linearly_and_each_upload_is_one_segment(recording, monkeypatch):
    monkeypatch.setattr(appended_log, "SEGMENT_BYTES", 2048, raising=False)
    monkeypatch.setattr(appended_log, "SEGMENT_UPLOADS", 4, raising=False)
    fs = recording("s3")
    short = upload_cost(f"s3://{BUCKET}/linear/short.jsonl", 40, fs)
    long = upload_cost(f"s3://{BUCKET}/linear/long.jsonl", 160, fs)
    # 4x the lines: 4x the bytes (a whole-object rewrite per upload: 16x).
    assert long[0] <= 1.25 * 4 * short[0], (short, long)
    assert long[0] <= (4 + 2) * long[2], long  # at most SEGMENT_UPLOADS + 1 uploads of each byte, and slack
    assert long[1] <= 2048 + len(line(999)), long  # no upload is larger than a segment
    data = appended_log.read_appended(f"s3://{BUCKET}/linear/long.jsonl")
    assert data.decode() == "".join(line(i) for i in range(160))  # every line, once, in order
    assert len(appended_log.list_segments(f"s3://{BUCKET}/linear/long.jsonl")) >= 160 * len(line(0)) // 2048


def test_an_event_does_not_wait_for_a_slow_store_and_is_uploaded_at_once(recording):
    url = f"s3://{BUCKET}/slow"
    fs = recording("s3")
    log = RunLog(url, flush_interval_s=60)  # only events (and close) may start an upload here
    fs.delay_s = 0.5  # each object write takes half a second
    took = []
    for step in range(1, 6):
        log.metrics({"step": step, "loss": 2.0, "tokens_per_sec": 1.0, "mfu": 0.1})
        started = time.perf_counter()
        log.event("checkpoint_saved", step, blocked_s=0.0)
        took.append(time.perf_counter() - started)
    assert max(took) < 0.1, took  # synchronous uploads: >= 2 x 0.5 s per event
    # Uploaded without sync(), close() or the 60 s interval: the event woke the uploader.
    deadline = time.monotonic() + 15
    while len(runlog.read_log(url, "events.jsonl")) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runlog.read_log(url, "events.jsonl"), "the event must be uploaded at once"
    log.close()  # waits: everything is stored
    assert [e["step"] for e in runlog.read_log(url, "events.jsonl")] == [1, 2, 3, 4, 5]
    assert [m["step"] for m in runlog.read_log(url, "metrics.jsonl")] == [1, 2, 3, 4, 5]
    tb = [o for o in objects(url) if "/tensorboard/" in o]
    assert tb, "the TensorBoard records are stored at close too"


def test_sync_stores_everything_now(recording):
    url = f"gs://{BUCKET}/sync"
    log = RunLog(url, flush_interval_s=3600)
    log.metrics({"step": 1, "loss": 2.0, "tokens_per_sec": 1.0, "mfu": 0.1})
    assert log.sync()
    assert [m["step"] for m in runlog.read_log(url, "metrics.jsonl")] == [1]
    log.close()


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_resumed_run_continues_after_the_segments_and_never_rewrites_one(recording, scheme):
    url = f"{scheme}://{BUCKET}/resumed"
    fs = recording(scheme)
    # A run written before segments: its whole events.jsonl object comes first.
    object_store.filesystem(url).pipe_file(f"{url}/events.jsonl", b'{"time": 1.0, "step": 0, "kind": "legacy"}\n')
    first = RunLog(url)
    for kind in ("start", "checkpoint_saved"):
        first.event(kind, 1)
    first.close()
    stored = objects(url)
    assert f"{url}/events.jsonl.segments/000001.jsonl" in stored, sorted(stored)
    listings, writes = fs.listings, len(fs.writes)
    second = RunLog(url)
    assert fs.listings - listings == 2, "one listing per log (metrics, events) at start, none later"
    for kind in ("resume", "checkpoint_saved", "done"):
        second.event(kind, 2)
    second.close()
    assert fs.listings - listings == 2
    rewritten = {p for p, _ in fs.writes[writes:]} & {o.split("://")[-1] for o in stored}
    assert not rewritten, rewritten
    assert all(objects(url)[o] == data for o, data in stored.items())
    kinds = [e["kind"] for e in runlog.read_log(url, "events.jsonl")]
    assert kinds == ["legacy", "start", "checkpoint_saved", "resume", "checkpoint_saved", "done"]


def test_a_killed_writer_loses_only_the_lines_after_its_last_upload(servers):
    url = f"s3://{BUCKET}/killed"
    killed = subprocess.run([sys.executable, "-c", f"""
import os, time
from jaxtrain.observe.runlog import RunLog
log = RunLog("{url}", flush_interval_s=60)
log.metrics({{"step": 1, "loss": 2.0, "tokens_per_sec": 1.0, "mfu": 0.1}})
log.event("checkpoint_saved", 1)  # uploads the metrics line and the event at once
time.sleep(2)
log.metrics({{"step": 2, "loss": 2.0, "tokens_per_sec": 1.0, "mfu": 0.1}})  # waits for the 60 s interval
os._exit(0)  # like a kill: no close()
"""], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert killed.returncode == 0, killed.stderr[-2000:]
    clear_client_caches()
    assert [m["step"] for m in runlog.read_log(url, "metrics.jsonl")] == [1]
    assert [e["kind"] for e in runlog.read_log(url, "events.jsonl")] == ["checkpoint_saved"]
    again = RunLog(url)
    again.metrics({"step": 2, "loss": 2.0, "tokens_per_sec": 1.0, "mfu": 0.1})
    again.close()
    assert [m["step"] for m in runlog.read_log(url, "metrics.jsonl")] == [1, 2]


def test_tensorboard_rotates_to_new_event_files_each_with_a_header(recording, monkeypatch, tmp_path):
    from jaxtrain.observe.tensorboard import ScalarWriter, _fields, read_scalars
    monkeypatch.setattr(appended_log, "SEGMENT_BYTES", 600, raising=False)
    url = f"gs://{BUCKET}/tb"
    fs = recording("gs")
    writer = ScalarWriter(url, flush_interval_s=3600)
    for step in range(1, 41):
        writer.scalars(step, {"train/loss": 1.0 / step, "train/mfu": 0.5})
        if step % 5 == 0:
            writer.flush()
    writer.close()
    files = objects(url)
    assert len(files) >= 4, sorted(files)  # 40 records of ~60 bytes, 600-byte files
    names = sorted(files)
    # Written in the order of their names, and a file started later is never written again.
    order = [names.index(next(n for n in names if n.endswith(p))) for p, _ in fs.writes]
    assert order == sorted(order), order
    got = []
    for name in names:
        data = files[name]
        length = int.from_bytes(data[:8], "little")
        assert dict(_fields(data[12:12 + length])).get(3) == b"brain.Event:2", name  # its own header
        got += read_scalars(name)
        (tmp_path / os.path.basename(name)).write_bytes(data)
    assert [s for s, tag, _ in got if tag == "train/loss"] == list(range(1, 41))
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="tensorboard (dev extra) not installed")
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 41))


def test_goodput_and_blame_read_a_run_in_segments_like_its_local_copy(recording, monkeypatch, tmp_path, capsys):
    """The goodput run of tests/observe/test_goodput.py, half of its events in the whole object of
    a run written before segments and the rest in small segments: `jaxtrain goodput` and
    `jaxtrain recovery blame` (through the launchers' reader) give what they give for the local copy."""
    from jaxtrain.launch import runfiles
    from jaxtrain.commands.recovery import print_blame
    from jaxtrain.observe.goodput import goodput
    from goodput_run import EVENTS, METRICS, write_run

    monkeypatch.setattr(appended_log, "SEGMENT_BYTES", 400, raising=False)
    url = f"s3://{BUCKET}/goodput"
    events = [*EVENTS[:-1], {"time": EVENTS[-1]["time"], "step": 0, "kind": "hang", "behind": [1]}, EVENTS[-1]]
    half = len(events) // 2
    object_store.filesystem(url).pipe_file(f"{url}/events.jsonl", "".join(json.dumps(e) + "\n" for e in events[:half]).encode())
    for name, records in (("events.jsonl", events[half:]), ("metrics.jsonl", METRICS)):
        f = appended_log.AppendOnlyFile(f"{url}/{name}", flush_interval_s=3600)
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.close()
    assert len(appended_log.list_segments(f"{url}/events.jsonl")) >= 2
    local = write_run(tmp_path / "run", events, METRICS)
    assert runlog.read_log(url, "events.jsonl") == events and runlog.read_log(url, "metrics.jsonl") == METRICS
    assert {**goodput(url), "run_dir": None} == {**goodput(local), "run_dir": None}
    assert runfiles.read_events(url) == runfiles.read_events(local) == events
    assert runfiles.count_events(url) == len(events)
    assert print_blame(url, 0.0, "jaxtrain recovery") == 0 and capsys.readouterr().out == "1\n"
