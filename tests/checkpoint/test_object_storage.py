"""Run directories in object storage, against real local servers started here: Google Cloud
Storage (gcp-storage-emulator) and S3 (moto_server). No client library is mocked: checkpoints go
through tensorstore's gcs / s3 drivers, small files and listings through gcsfs / s3fs.

Each backend: SIGKILL mid-run then the same command resumes bitwise (the real CLI), the run's
files are in the bucket, `jaxtrain checkpoints URL` lists them, a damaged latest checkpoint falls
back to the previous one, retention deletes the objects, a checkpoint saved on one mesh restores
onto another (and across process counts), a checkpoint folder copied from local disk into the
bucket restores there, a wrong bucket (run.output_dir or checkpoint.init_from)
or missing credentials is one line on stderr with exit 2 and nothing written, no credential
reaches any object, local file or stderr, and `jaxtrain export-hf` reads a run directory from a
bucket. The tensorstore S3 spec is also checked on its own (region only when the environment
names one).
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
from helpers import REPO, TINY

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from storage_servers import SECRETS, objects, storage_servers  # noqa: E402
from helpers import mesh_of  # noqa: E402
from test_checkpoint import Events, abstract, cfg, host_state, matches, to_device  # noqa: E402
from trees import assert_trees_equal  # noqa: E402

from jaxtrain.checkpoint import checkpointer  # noqa: E402
from jaxtrain.checkpoint import layout  # noqa: E402
from jaxtrain.checkpoint.checkpointer import Checkpointer  # noqa: E402
from jaxtrain.storage import appended_log, object_store, small_files  # noqa: E402
from jaxtrain.config import ConfigError, load_config  # noqa: E402
from jaxtrain.observe.tensorboard import read_scalars  # noqa: E402
from jaxtrain.trainer import Trainer  # noqa: E402

BACKENDS = ["gs", "s3"]
BUCKET = "jaxtrain-test"
STEPS, KILL_AT, EVERY = 20, 13, 5
RUN = [f"train.steps={STEPS}", "train.log_every=1", f"checkpoint.every_steps={EVERY}", "model.num_layers=1",
       "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8", "data.seq_len=32"]


# ----------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers on free ports with bucket BUCKET, and the environment that points at them
    (set in this process too, for the in-process tests; subprocesses inherit it)."""
    with storage_servers(tmp_path_factory.mktemp("servers"), [BUCKET]) as env:
        yield env


# ----------------------------------------------------------------------------- the CLI


def train_cmd(out: str, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
            f"checkpoint.compilation_cache_dir={cache}", *RUN, *extra, "--cpu-devices", "1"]


def run_cli(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env={**os.environ, **env})


def read_jsonl(url_or_path: str) -> list[dict]:
    """A run log's lines, local or in a bucket (there: its segments, appended_log.read_appended)."""
    return [json.loads(line) for line in appended_log.read_appended(url_or_path).decode().splitlines()]


def losses(run_dir: str) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(f"{run_dir}/metrics.jsonl")}  # later lines win


def final_params(run_dir: str) -> dict:
    trainer = Trainer(load_config(TINY, RUN + ["checkpoint.compilation_cache_dir=null"]), write_files=False,
                      devices=jax.devices()[:1])
    return jax.device_get(checkpointer.restore_params_only(run_dir, trainer.abstract_state()["params"]))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> str:
    """The uninterrupted run, on local disk (storage does not change numerics)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    r = run_cli(train_cmd(str(out), cache), cwd=out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return str(out)


class Resumed(NamedTuple):
    url: str  # the run directory in the bucket
    cwd: Path  # the working directory of both commands
    output: dict[str, str]  # what both commands wrote: {"stdout": ..., "stderr": ...}


@pytest.fixture(scope="module", params=BACKENDS)
def resumed(request, servers, cache, tmp_path_factory) -> Resumed:
    """A run in the bucket, SIGKILLed after step KILL_AT, then the same command to the end."""
    url = f"{request.param}://{BUCKET}/resume"
    cwd = tmp_path_factory.mktemp(f"cwd_{request.param}")
    killed = run_cli(train_cmd(url, cache, f"chaos.kill_at_step={KILL_AT}"), cwd=cwd)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # The restart counter (set by `jaxtrain launch`) keeps the drill from firing again.
    again = run_cli(train_cmd(url, cache, f"chaos.kill_at_step={KILL_AT}"), cwd=cwd, JAXTRAIN_RESTART_ATTEMPT="1")
    assert again.returncode == 0, again.stderr[-3000:]
    return Resumed(url, cwd, {"stdout": killed.stdout + again.stdout, "stderr": killed.stderr + again.stderr})


@pytest.mark.slow
def test_sigkill_then_same_command_resumes_bitwise(resumed, reference):
    url = resumed.url
    events = read_jsonl(f"{url}/events.jsonl")
    restored = next(e for e in events if e["kind"] == "resume")["restored_step"]
    # The kill lands 3 steps after step 10's save: its write may still have been in flight.
    assert restored in (5, 10), restored
    ref, got = losses(reference), losses(url)
    for step in range(restored + 1, STEPS + 1):
        assert got[step] == ref[step], (step, got[step], ref[step])  # bitwise, not approximately
    a, b = final_params(url), final_params(reference)
    assert any(np.any(x != 0) for x in jax.tree.leaves(a)), "the parameters must not be trivially zero"
    assert_trees_equal(a, b, "final parameter ")


@pytest.mark.slow
def test_goodput_of_a_run_in_the_bucket_equals_that_of_a_local_copy(resumed, tmp_path):
    from jaxtrain.observe.goodput import goodput
    for name in ("events.jsonl", "metrics.jsonl"):
        (tmp_path / name).write_bytes(appended_log.read_appended(f"{resumed.url}/{name}"))
    remote, local = goodput(resumed.url), goodput(tmp_path)
    assert remote["attempts"] == 2 and remote["steps"]["final"] == STEPS, remote  # the killed attempt and the resume
    assert {**remote, "run_dir": None} == {**local, "run_dir": None}


@pytest.mark.slow
def test_run_files_are_in_the_bucket(resumed):
    url, cwd = resumed.url, resumed.cwd
    names = {o.split("/resume/", 1)[1] for o in objects(url)}
    assert {"config.yaml", "metrics.jsonl.segments/000001.jsonl", "events.jsonl.segments/000001.jsonl"} <= names
    cfg_text = small_files.read_bytes(f"{url}/config.yaml").decode()  # the resolved config
    assert f"steps: {STEPS}" in cfg_text and url in cfg_text
    events = read_jsonl(f"{url}/events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds.count("start") == 2 and "resume" in kinds and kinds[-1] == "done"
    # Object stores cannot append: the logs are written as segments, uploaded in the background
    # at once after every event, the metrics before the events. So each checkpoint_saved stored
    # had every metrics line up to its step stored with it, even in the killed run; the resumed
    # run wrote every step after its restore.
    restored = next(e for e in events if e["kind"] == "resume")["restored_step"]
    saved_before_kill = [e["step"] for e in events[:kinds.index("start", 1)] if e["kind"] == "checkpoint_saved"]
    assert saved_before_kill, kinds
    required = set(range(1, max(saved_before_kill) + 1)) | set(range(restored + 1, STEPS + 1))
    assert required <= set(losses(url)), sorted(required - set(losses(url)))
    tb = [n for n in names if n.startswith("tensorboard/events.out.tfevents.")]
    # Event files of each process start (its pid in the name), each with its own header.
    assert len({n.rsplit(".", 2)[1] for n in tb}) == 2, tb
    scalars = sum((read_scalars(f"{url}/{n}") for n in tb), [])
    assert {s for s, tag, _ in scalars if tag == "train/loss"} >= set(range(KILL_AT + 1, STEPS + 1))
    assert not any(name in os.listdir(cwd) for name in ("gs:", "s3:")), "nothing may land in a local 'gs:'/'s3:'"


@pytest.mark.slow
def test_no_credential_in_any_object_local_file_or_stderr(resumed):
    """Every object of the run (config.yaml, metrics/events, TensorBoard, commit markers, Orbax
    metadata, array chunks), every file left in the working directory, and both commands' stdout
    and stderr: none holds any of the credentials the clients were given."""
    fs = object_store.filesystem(resumed.url)
    fs.invalidate_cache()
    scanned = {o.split("/resume/", 1)[1]: fs.cat_file(o) for o in fs.find(resumed.url)}
    assert {"config.yaml", "metrics.jsonl.segments/000001.jsonl", "events.jsonl.segments/000001.jsonl"} <= set(
        scanned), sorted(scanned)
    assert any(name.endswith(f"/{layout.MARKER}") for name in scanned), sorted(scanned)
    for path in resumed.cwd.rglob("*"):
        if path.is_file():
            scanned[f"local:{path.relative_to(resumed.cwd)}"] = path.read_bytes()
    scanned.update({stream: text.encode() for stream, text in resumed.output.items()})
    assert "[resume]" in resumed.output["stdout"], "the capture must hold the runs' console output"
    for name, data in scanned.items():
        for variable, secret in SECRETS.items():
            assert secret.encode() not in data, f"{variable} found in {name}"


@pytest.mark.slow
def test_checkpoints_command_lists_the_bucket(resumed):
    url, cwd = resumed.url, resumed.cwd
    r = run_cli([sys.executable, "-m", "jaxtrain", "checkpoints", url], cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"latest good: {STEPS}" in r.stdout and "good" in r.stdout
    rows = [json.loads(line) for line in run_cli([sys.executable, "-m", "jaxtrain", "checkpoints", url,
                                                  "--json"], cwd=cwd).stdout.splitlines()]
    good = [row["step"] for row in rows if row["valid"]]
    assert good[-1] == STEPS and len(good) <= 3 and all(row["path"].startswith(url) for row in rows)


# ----------------------------------------------------------------------------- library, in process


@pytest.mark.parametrize("scheme", BACKENDS)
def test_damaged_latest_falls_back_and_restores_onto_another_mesh(servers, scheme):
    url = f"{scheme}://{BUCKET}/damaged/checkpoints"
    two = mesh_of(data=2, fsdp=1, tensor=1)  # saved on 2 devices, data=2
    ck = Checkpointer(url, cfg())
    for step in (1, 2, 3):
        ck.save(step, to_device(host_state(seed=step), two), {"step": step})
    ck.wait()
    fs = object_store.filesystem(url)
    fs.rm(f"{url}/3/{layout.MARKER}")  # killed between Orbax's commit and our marker
    data = [o for o in objects(f"{url}/2/state") if not o.rsplit("/", 1)[1].startswith(("_", ".", "manifest"))]
    biggest = max(data, key=lambda o: fs.size(o))
    fs.pipe_file(biggest, fs.cat_file(biggest)[: fs.size(biggest) // 2])  # a truncated data object

    events = Events()
    ck2 = Checkpointer(url, cfg(), on_event=events)
    assert ck2.latest_step() == 1
    damaged = dict(events.kinds("checkpoint_damaged"))
    assert set(damaged) == {2, 3}
    assert "no commit marker" in damaged[3]["reason"] and "the manifest says" in damaged[2]["reason"]
    four = mesh_of(data=1, fsdp=4, tensor=1)  # restored on 4 devices, fsdp=4
    assert not matches(to_device(host_state(seed=0), four), host_state(seed=1))
    state, extra = ck2.restore(1, abstract(host_state(0), four))
    assert matches(state, host_state(seed=1)) and extra == {"step": 1}
    assert state["params"]["layers"]["w"].sharding.mesh.devices.size == 4
    with pytest.raises(checkpointer.CheckpointError, match="manifest"):
        ck2.restore(2, abstract(host_state(0), four))


@pytest.mark.parametrize("scheme", BACKENDS)
def test_retention_deletes_the_objects(servers, scheme):
    url = f"{scheme}://{BUCKET}/retention/checkpoints"
    ck = Checkpointer(url, cfg(keep_last=2))
    state = to_device(host_state(seed=1), mesh_of(data=1, fsdp=2, tensor=1))
    for step in range(1, 6):
        ck.save(step, state, {})
    ck.wait()
    steps = {o.split("/checkpoints/", 1)[1].split("/", 1)[0] for o in objects(url)}
    assert steps == {"4", "5"}, steps
    assert ck.latest_step() == 5


def test_a_checkpoint_copied_from_disk_into_s3_restores_there(servers, tmp_path):
    """Orbax's OCDBT format (what local disk and gs:// hold), copied into an s3:// bucket as
    `aws s3 cp --recursive` would, is listed as good and restores there, onto another mesh."""
    local = tmp_path / "checkpoints"
    with Checkpointer(str(local), cfg()) as ck:
        ck.save(3, to_device(host_state(seed=3), mesh_of(data=2, fsdp=2, tensor=2)), {"step": 3})
    url = f"s3://{BUCKET}/copied/checkpoints"
    copy_to_bucket(local, url)
    assert any(o.endswith("/3/state/manifest.ocdbt") for o in objects(url))
    ck = Checkpointer(url, cfg())
    assert ck.latest_step() == 3
    four = mesh_of(data=1, fsdp=4, tensor=1)
    state, extra = ck.restore(3, abstract(host_state(0), four))
    assert matches(state, host_state(seed=3)) and extra == {"step": 3}
    assert state["params"]["layers"]["w"].sharding.mesh.devices.size == 4


def test_s3_refuses_to_write_numpy_and_scalar_leaves_by_name(tmp_path):
    """numpy leaves (what import-hf writes) are read from s3://, but never written there."""
    import asyncio

    import orbax.checkpoint as ocp

    from jaxtrain.checkpoint import s3_arrays
    info = ocp.type_handlers.ParamInfo(name="x", parent_dir=tmp_path)
    refused = r"'x': s3:// checkpoints hold jax.Array leaves only \((np.ndarray|scalar) is not"
    for leaf_type, leaf in ((np.ndarray, np.zeros(2)), (int, 1)):
        with pytest.raises(TypeError, match=refused):
            asyncio.run(s3_arrays.s3_type_handlers()[leaf_type].serialize([leaf], [info]))


def test_s3_chunks_split_within_shards_and_restore_across_them(servers, monkeypatch):
    """Chunks larger than the cap are halved inside each shard (one writer per chunk still); a
    restore onto another mesh reads across chunk boundaries."""
    from jaxtrain.checkpoint import s3_arrays
    assert s3_arrays._chunk_shape((16384, 8192), 4) == [8192, 8192]  # 512 MiB -> 2 chunks of 256 MiB
    assert s3_arrays._chunk_shape((8192, 8192), 4) == [8192, 8192] and s3_arrays._chunk_shape((3, 5), 2**30) == [3, 5]
    monkeypatch.setattr(s3_arrays, "_MAX_CHUNK_BYTES", 64)  # 16 float32 per chunk
    url = f"s3://{BUCKET}/chunks/checkpoints"
    ck = Checkpointer(url, cfg())
    ck.save(1, to_device(host_state(seed=4), mesh_of(data=1, fsdp=2, tensor=1)), {})
    ck.wait()
    # The chunks are keys of the checkpoint's OCDBT database (packed into a few objects).
    import tensorstore as ts
    kv = ts.KvStore.open({"driver": "ocdbt", "base": object_store.s3_kvstore(f"{url}/1/state")}).result()
    embed = [k for k in kv.list().result() if k.startswith(b"params.embed/") and not k.endswith(b".zarray")]
    assert len(embed) == 16 * 8 * 4 // 64, embed  # (16, 8) float32 in 64-byte chunks
    state, _ = ck.restore(1, abstract(host_state(0), mesh_of(data=2, fsdp=2, tensor=2)))
    assert matches(state, host_state(seed=4))


def test_object_log_appends_across_writers(servers):
    """A resumed run continues after the segments it finds; flush() uploads and waits; what a killed
    writer had not uploaded is lost (and only that)."""
    url = f"s3://{BUCKET}/appender/metrics.jsonl"
    killed = subprocess.run([sys.executable, "-c", f"""
import os, time
from jaxtrain.storage.appended_log import AppendOnlyFile
f = AppendOnlyFile("{url}", flush_interval_s=60)
f.write("a\\n")
f.flush()
time.sleep(1)  # the uploader has seen "a" (its first upload is at once); the next waits 60 s
f.write("b\\n")  # never uploaded: the background upload waits 60 s
os._exit(0)  # like a kill: no close()
"""], capture_output=True, text=True, timeout=120)
    assert killed.returncode == 0, killed.stderr[-2000:]
    assert appended_log.read_appended(url) == b"a\n"
    second = appended_log.AppendOnlyFile(url, flush_interval_s=0.05)
    second.write("c\n")
    deadline = time.monotonic() + 10
    while appended_log.read_appended(url) != b"a\nc\n" and time.monotonic() < deadline:
        time.sleep(0.05)  # the background upload
    assert appended_log.read_appended(url) == b"a\nc\n"
    second.write("d\n")
    second.close()
    assert appended_log.read_appended(url) == b"a\nc\nd\n"


# ----------------------------------------------------------------------------- user errors


@pytest.mark.parametrize("scheme", BACKENDS)
def test_wrong_bucket_is_one_line_exit_2_nothing_written(servers, scheme, cache, tmp_path):
    url = f"{scheme}://no-such-bucket-here/run"
    before = objects(f"{scheme}://{BUCKET}")
    r = run_cli(train_cmd(url, cache), cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no-such-bucket-here" in r.stderr and "does not exist" in r.stderr
    for verb in ("checkpoints", "goodput"):
        r = run_cli([sys.executable, "-m", "jaxtrain", verb, url], cwd=tmp_path)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "does not exist" in r.stderr, r.stderr
    assert objects(f"{scheme}://{BUCKET}") == before and os.listdir(tmp_path) == []


@pytest.mark.parametrize("scheme", BACKENDS)
def test_wrong_init_from_bucket_is_one_line_exit_2_nothing_written(servers, scheme, cache, tmp_path):
    """A local run whose checkpoint.init_from names a bucket that does not exist: refused before
    the run directory is made, naming the setting and the bucket."""
    url = f"{scheme}://no-such-bucket-here/imported"
    r = run_cli(train_cmd(str(tmp_path / "run"), cache, f"checkpoint.init_from={url}"), cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"checkpoint.init_from='{url}'" in r.stderr and "bucket 'no-such-bucket-here' does not exist" in r.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("scheme", BACKENDS)
def test_missing_credentials_is_one_line_exit_2_nothing_written(servers, scheme, cache, tmp_path):
    url = f"{scheme}://{BUCKET}/no-credentials"
    env = {k: v for k, v in os.environ.items() if k not in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS",
        "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "FSSPEC_GCS_TOKEN")}
    env["CLOUDSDK_CONFIG"] = str(tmp_path / "no-gcloud")  # no gcloud user credentials either
    r = subprocess.run(train_cmd(url, cache), capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ("no AWS credentials" if scheme == "s3" else "no Google Cloud credentials") in r.stderr
    assert objects(url) == [] and os.listdir(tmp_path) == []


def test_half_configured_gcs_emulator_is_refused(servers, monkeypatch):
    """gcsfs and tensorstore read different variables: with one set, a checkpoint would be split
    between the emulator and the real GCS."""
    object_store.check_access(f"gs://{BUCKET}/x")
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL")
    with pytest.raises(ConfigError, match="set both STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL"):
        object_store.check_access(f"gs://{BUCKET}/x", key="run.output_dir")


# ----------------------------------------------------------------------------- S3 region


def _without_region(monkeypatch) -> None:
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)


def test_s3_spec_names_a_region_only_when_the_environment_does(monkeypatch):
    """No region set: the spec has none (tensorstore then asks the bucket); AWS_REGION wins over
    AWS_DEFAULT_REGION; the endpoint is passed on; no credential is ever in the spec."""
    _without_region(monkeypatch)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRETS["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRETS["AWS_SECRET_ACCESS_KEY"])
    assert object_store.s3_kvstore("s3://bkt/a/b") == {"driver": "s3", "bucket": "bkt", "path": "a/b/",
                                                  "aws_credentials": {"type": "environment"}}
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert object_store.s3_kvstore("s3://bkt/a")["aws_region"] == "eu-west-1"
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    spec = object_store.s3_kvstore("s3://bkt")
    assert (spec["aws_region"], spec["endpoint"], spec["path"]) == ("ap-south-1", "http://127.0.0.1:9000", "")
    assert not any(secret in json.dumps(spec) for secret in SECRETS.values())


class _RegionServer(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that only says where its bucket lives (HEAD) and has no objects (GET: 404);
    it records the region each GET was signed for."""
    signed_for: list[str] = []

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("x-amz-bucket-region", "eu-central-1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        # Authorization: AWS4-HMAC-SHA256 Credential=<key>/<date>/<region>/s3/aws4_request, ...
        credential = self.headers.get("Authorization", "").split("Credential=", 1)[1].split(",", 1)[0]
        self.signed_for.append(credential.split("/")[2])
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_s3_without_region_signs_for_the_buckets_own_region(monkeypatch):
    """With no AWS_REGION, tensorstore signs for the region the server reports for the bucket
    (on AWS, a bucket outside us-east-1 refuses requests signed for us-east-1)."""
    import tensorstore as ts
    _without_region(monkeypatch)
    _RegionServer.signed_for = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RegionServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRETS["AWS_ACCESS_KEY_ID"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRETS["AWS_SECRET_ACCESS_KEY"])
        kv = ts.KvStore.open(object_store.s3_kvstore("s3://eu-bucket/run")).result()
        assert kv.read("checkpoints/1/commit.json").result().state == "missing"
    finally:
        server.shutdown()
        server.server_close()
    assert _RegionServer.signed_for == ["eu-central-1"]


def test_orbax_and_tensorstore_are_pinned_to_a_tested_range():
    """jaxtrain/checkpoint/ uses Orbax internals and tensorstore's s3 driver: pyproject.toml bounds
    both above (next minor), and what is installed here lies in that range."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {r.name: r.specifier for r in map(Requirement, deps)}
    for name in ("orbax-checkpoint", "tensorstore"):
        assert any(spec.operator == "<" for spec in pins[name]), f"{name} {pins[name]}: no upper bound"
        assert pins[name].contains(version(name)), f"{name} {version(name)} is outside {pins[name]}"


# ----------------------------------------------------------------------------- export-hf from a bucket


def copy_to_bucket(local: Path, url: str) -> None:
    """A local folder copied file by file into the bucket, as `aws s3 cp --recursive` or
    `gsutil cp -r` would."""
    fs = object_store.filesystem(url)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{url}/{path.relative_to(local).as_posix()}")


def _hf_source(path: Path) -> Path:
    """A tiny random Llama directory (config.json, model.safetensors, tokenizer files), made with
    jaxtrain's own mapping and numpy: no torch needed here."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    from jaxtrain.hf import hf_config_from_model, hf_shapes
    m = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
                           "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=48"]).model
    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    save_file({name: rng.standard_normal(shape).astype(np.float32) for name, shape in hf_shapes(m).items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config_from_model(m, "fp32")))
    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.mark.parametrize("scheme", BACKENDS)
def test_export_hf_reads_a_run_directory_in_a_bucket(servers, scheme, tmp_path, capsys):
    """An import-hf directory put into the bucket (and gone locally) exports from its URL: the
    weights bitwise, the tokenizer files and the source's config from the bucket; a URL --output,
    a wrong bucket and a folder without a run are one line, exit 2, nothing written."""
    import shutil

    from safetensors.numpy import load_file

    from jaxtrain.commands import cli
    src = _hf_source(tmp_path / "src")
    local = tmp_path / "imported"
    assert cli.main(["import-hf", str(src), "--output", str(local)]) == 0
    url = f"{scheme}://{BUCKET}/hf-export"
    copy_to_bucket(local, url)
    shutil.rmtree(local)  # its config.yaml points at local tokenizer/init_from paths: now all from the bucket
    out = tmp_path / "exported"
    capsys.readouterr()
    assert cli.main(["export-hf", url, "--output", str(out)]) == 0
    assert "export-hf: step 0 as fp32" in capsys.readouterr().out
    source, back = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(source) == sorted(back)
    for name in source:
        assert back[name].tobytes() == source[name].tobytes(), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name

    for argv, message in ((["export-hf", url, "--output", f"{scheme}://{BUCKET}/exported"], "is a URL"),
                          (["export-hf", f"{scheme}://no-such-bucket-here/run", "--output", str(tmp_path / "x")],
                           "bucket 'no-such-bucket-here' does not exist"),
                          (["export-hf", f"{scheme}://{BUCKET}/no-run-here", "--output", str(tmp_path / "x")],
                           "has no config.yaml")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "src"]
    assert not objects(f"{scheme}://{BUCKET}/exported")

    # A run whose only checkpoint lost a file: the one line says which step and why.
    fs = object_store.filesystem(url)
    fs.rm([f for f in fs.find(f"{url}/checkpoints/0") if not f.endswith("commit.json")][0])
    assert cli.main(["export-hf", url, "--output", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds no committed checkpoint" in err and "step 0: file " in err, err
    assert not (tmp_path / "y").exists()


@pytest.mark.slow
def test_export_hf_of_a_run_trained_into_the_bucket(resumed, tmp_path):
    """The resumed run's latest checkpoint, exported straight from its URL, holds its final
    parameters."""
    from safetensors.numpy import load_file

    from jaxtrain.commands import cli
    from jaxtrain.hf import hf_tensors_from_params
    out = tmp_path / "exported"
    assert cli.main(["export-hf", resumed.url, "--output", str(out)]) == 0
    back = load_file(out / "model.safetensors")
    model = load_config(TINY, RUN).model
    expected = dict(hf_tensors_from_params(final_params(resumed.url), model))
    assert sorted(back) == sorted(expected)
    for name, t in expected.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)


# ----------------------------------------------------------------------------- several processes


@pytest.mark.multiprocess
@pytest.mark.parametrize("scheme", BACKENDS)
def test_two_processes_save_to_the_bucket_and_one_restores(servers, scheme):
    from test_checkpoint_multiprocess import run_workers
    one_proc, two_procs = f"{scheme}://{BUCKET}/mp/saved_by_1x8", f"{scheme}://{BUCKET}/mp/saved_by_2x4"
    with Checkpointer(one_proc, cfg()) as ck:
        assert ck.save(5, to_device(host_state(seed=5), mesh_of(data=2, fsdp=2, tensor=2)), {"from": "1x8"})
    outputs = run_workers("roundtrip", one_proc, two_procs)  # 2 processes x 4 devices restore it, save step 7
    assert all("RESTORED OK" in out and "SAVED OK" in out for out in outputs), outputs
    marker = json.loads(small_files.read_bytes(f"{two_procs}/7/{layout.MARKER}"))
    assert marker["process_count"] == 2
    ck = Checkpointer(two_procs, cfg())
    assert ck.latest_step() == 7
    state, extra = ck.restore(7, abstract(host_state(0), mesh_of(data=1, fsdp=1, tensor=1)))
    assert matches(state, host_state(seed=7)) and extra == {"from": "2x4"}


@pytest.mark.parametrize("reader", ["latest_good", "checkpoints_cli", "init_from"])
@pytest.mark.parametrize("scheme", BACKENDS)
def test_a_listing_cached_before_another_writer_commits_does_not_hide_the_checkpoint(servers, scheme, reader,
                                                                                       tmp_path, capsys):
    """epath keeps fsspec filesystems of its own (gcsfs with other arguments than jaxtrain's, so
    another instance and another listing cache): a folder looked at through epath before another
    writer (tensorstore, another process, `gsutil cp`) put a checkpoint there must still show it,
    to each reader of a run directory. CI once exported from a bucket folder whose bucket epath had
    listed earlier: 'no committed checkpoint'."""
    from jaxtrain.checkpoint import layout
    from jaxtrain.checkpoint.checkpointer import _resolve_folder
    run = f"{scheme}://{BUCKET}/listed-early-{reader}"
    root = layout.to_path(f"{run}/checkpoints")
    object_store.filesystem(run).pipe(f"{run}-sibling/a", b"1")  # (an empty listing is not cached)
    assert not root.exists() and not layout.to_path(run).exists()
    list(layout.to_path(f"{scheme}://{BUCKET}").iterdir())  # epath caches the bucket's listing
    local = tmp_path / "7"
    local.mkdir()
    (local / "a.bin").write_bytes(b"x" * 5)
    (local / layout.MARKER).write_text(json.dumps({"format": layout.FORMAT, "step": 7, "files": {"a.bin": 5}}))
    copy_to_bucket(local, f"{root}/7")
    if reader == "latest_good":
        assert layout.latest_good(root) == 7
        assert layout.list_files(root / "7") == {"a.bin": 5}
    elif reader == "checkpoints_cli":
        capsys.readouterr()
        from jaxtrain.commands import checkpoints
        assert checkpoints.main([run, "--json"]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # JSON lines
        assert [(row["step"], row["valid"]) for row in rows] == [(7, True)]
    else:
        assert str(_resolve_folder(run)) == f"{root}/7"
