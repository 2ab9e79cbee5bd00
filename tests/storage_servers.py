"""Local object-storage servers for tests and benchmarks: Google Cloud Storage
(gcp-storage-emulator) and S3 (moto_server), on free ports, with the environment that points
jaxtrain (tensorstore, gcsfs, s3fs) at them. Both come with the `dev` extra.

    with storage_servers(log_dir, buckets=["b"]) as env:   # also set in os.environ meanwhile
        ... gs://b/..., s3://b/...
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from helpers import free_port

# The credentials handed to the clients. The servers check none of them; they are distinctive so
# that a test can scan everything a run writes (objects, local files, stderr) for each of them.
SECRETS = {
    "AWS_ACCESS_KEY_ID": "jaxtrain-fake-access-key-id",
    "AWS_SECRET_ACCESS_KEY": "jaxtrain-fake-secret-access-key",
    "AWS_SESSION_TOKEN": "jaxtrain-fake-session-token",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "jaxtrain-fake-gcs-token",
}

# gcp-storage-emulator serves object bytes without the `x-goog-generation` header that real GCS
# sends; tensorstore's OCDBT reads its manifest's generation from it and fails ("Malformed
# StorageGeneration") whenever the manifest already exists when it is opened. The server is
# started with that header added (the fake made more like GCS; the clients are untouched).
GCS_SERVER = """
import sys
from gcp_storage_emulator.handlers import objects
_download = objects.download

def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]
    except Exception:
        pass  # a missing object: the original handler answers 404
    return _download(request, response, storage, *args, **kwargs)

objects.download = download  # before the server module builds its routing table
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{proc.args[:3]} did not answer at {url} within {timeout} s: {log.read_text()[-2000:]}")


def make_bucket(env: dict, scheme: str, name: str) -> None:
    """Create bucket `name` on the local GCS ('gs') or S3 ('s3') server."""
    if scheme == "gs":  # the JSON API's buckets.insert
        req = urllib.request.Request(f"{env['STORAGE_EMULATOR_HOST']}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
    else:  # S3 CreateBucket (moto does not check signatures)
        req = urllib.request.Request(f"{env['AWS_ENDPOINT_URL']}/{name}", method="PUT")
    urllib.request.urlopen(req, timeout=10).read()


def clear_client_caches() -> None:
    """Drop every cached bucket client: gcsfs's and s3fs's instance caches and etils.epath's own
    lru_cache of the gcsfs instance (Orbax and the checkpoint layout go through epath). A client
    cached while the environment pointed at another server keeps using that server's address."""
    import gcsfs
    import s3fs
    from etils.epath import backend

    s3fs.S3FileSystem.clear_instance_cache()
    gcsfs.GCSFileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()


@contextlib.contextmanager
def storage_servers(log_dir: str | Path, buckets: list[str]) -> Iterator[dict]:
    """Start both servers, create `buckets` on each, set the environment (restored afterwards),
    yield it; the servers are killed on exit."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    gcs, s3 = free_port(), free_port()
    commands = {"gcs": [sys.executable, "-c", GCS_SERVER, "start", "--port", str(gcs), "--in-memory", "-q"],
                "s3": [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3)]}
    env = {
        # GCS: gcsfs reads STORAGE_EMULATOR_HOST, tensorstore TENSORSTORE_GCS_HTTP_URL (+ a test token);
        # the metadata server is pointed at a closed port so nothing waits for a real one.
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{gcs}", "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{gcs}",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": SECRETS["GOOGLE_AUTH_TOKEN_FOR_TESTING"], "GCE_METADATA_HOST": "127.0.0.1:1",
        "GCE_METADATA_IP": "127.0.0.1:1", "GCE_METADATA_ROOT": "127.0.0.1:1",
        "FSSPEC_GCS_TOKEN": "anon",  # the emulator checks no token; skips gcsfs's 3 s credential search
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # its bucket-type lookup is a gRPC API the emulator lacks
        # S3: the same variables as for any S3-compatible store.
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3}", "AWS_ACCESS_KEY_ID": SECRETS["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": SECRETS["AWS_SECRET_ACCESS_KEY"], "AWS_SESSION_TOKEN": SECRETS["AWS_SESSION_TOKEN"],
        "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_SHARED_CREDENTIALS_FILE": str(log_dir / "none"), "AWS_CONFIG_FILE": str(log_dir / "none"),
    }
    procs = {name: subprocess.Popen(cmd, stdout=open(log_dir / f"{name}.log", "w"), stderr=subprocess.STDOUT)
             for name, cmd in commands.items()}
    saved = {k: os.environ.get(k) for k in env}
    import fsspec.config
    saved_conf = fsspec.config.conf.get("gcs")
    try:
        _wait_http(f"{env['STORAGE_EMULATOR_HOST']}/storage/v1/b", procs["gcs"], log_dir / "gcs.log")
        _wait_http(f"{env['AWS_ENDPOINT_URL']}/", procs["s3"], log_dir / "s3.log")
        for scheme in ("gs", "s3"):
            for bucket in buckets:
                make_bucket(env, scheme, bucket)
        os.environ.update(env)
        fsspec.config.conf["gcs"] = {"token": "anon"}  # fsspec read the FSSPEC_* variables at import
        clear_client_caches()  # clients made before now point elsewhere
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("gcs", None)
        else:
            fsspec.config.conf["gcs"] = saved_conf
        clear_client_caches()
        for p in procs.values():
            p.kill()
            p.wait()


def objects(url: str) -> list[str]:
    """Every object below `url`, fresh from the server (fsspec caches listings)."""
    from jaxtrain.storage import object_store
    fs = object_store.filesystem(url)
    fs.invalidate_cache()
    return sorted(fs.find(url))
