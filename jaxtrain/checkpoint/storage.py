"""Object storage (gs://, s3://) for run directories: cloud settings from the environment, the
early access check, tensorstore's S3 kvstore spec, and files that are only appended to.

Everything reads the usual variables of each cloud and nothing else; no secret is ever written
into the run directory, an event or a log line:
  gs://  credentials: GOOGLE_APPLICATION_CREDENTIALS, or the metadata server (GCE/GKE/TPU VMs);
         emulators: STORAGE_EMULATOR_HOST (gcsfs: small files, listing) and
         TENSORSTORE_GCS_HTTP_URL (tensorstore: the arrays).
  s3://  credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, or AWS_PROFILE /
         an instance or task role; region: AWS_REGION or AWS_DEFAULT_REGION, else the bucket's own
         region as the server reports it; S3-compatible stores (MinIO, Ceph, moto):
         AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL.

Small files (metrics.jsonl, events.jsonl, TensorBoard event files) cannot be appended to on an
object store, so `AppendOnlyFile` keeps the whole file in memory and rewrites the object: in
the background (at most once every `flush_interval_s`), and at once when `flush()` is called.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

from jaxtrain.config import ConfigError
from jaxtrain.checkpoint.paths import is_remote

SCHEMES = ("gs", "s3")
_ok: set[tuple[str, str]] = set()  # buckets that passed check_access in this process
_EXTRAS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}  # scheme -> (module fsspec needs, pip extra)


def split_url(url: str) -> tuple[str, str, str]:
    """'s3://bucket/a/b' -> ('s3', 'bucket', 'a/b')."""
    scheme, _, rest = os.fspath(url).partition("://")
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key.strip("/")


def filesystem(url: str) -> Any:
    """The fsspec filesystem of a gs:// or s3:// URL (gcsfs / s3fs, configured by the environment)."""
    import fsspec
    return fsspec.filesystem(split_url(url)[0])


# ----------------------------------------------------------------------------- S3 settings


def s3_endpoint() -> Optional[str]:
    """The endpoint of an S3-compatible store, or None for AWS itself (the same variables as the AWS CLI)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_region() -> Optional[str]:
    """The region named by the environment (AWS_REGION, then AWS_DEFAULT_REGION), or None."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None


def s3_kvstore(url: str) -> dict:
    """Tensorstore kvstore spec for an s3:// URL, from the environment.

    Tensorstore's `s3://` URL form does not read AWS_ENDPOINT_URL, so the endpoint is spelled out.
    The region is put in the spec only when the environment names one: without `aws_region`,
    tensorstore asks the server for the bucket's region (a HEAD on the bucket, read from the
    `x-amz-bucket-region` header; with a custom endpoint it falls back to us-east-1 when the
    server does not say). A guessed default would sign every request for the wrong region on AWS
    when the bucket lives elsewhere, and the first save would fail.
    Credentials are never put in the spec: tensorstore reads them itself, from the environment
    variables when they are set (its 'default' chain would also try ~/.aws files and log an
    error line for each one missing), else through the default chain (profile, ECS, IMDS).
    """
    _, bucket, key = split_url(url)
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key + "/" if key else ""}
    if s3_region():
        spec["aws_region"] = s3_region()
    if s3_endpoint():
        spec["endpoint"] = s3_endpoint()
    env = os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
    spec["aws_credentials"] = {"type": "environment" if env else "default"}
    return spec


# ----------------------------------------------------------------------------- access check


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _check_credentials(scheme: str, where: str) -> None:
    """Raise ConfigError when the cloud SDK finds no credentials at all (emulators need none)."""
    if scheme == "gs":
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            return
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
        try:
            google.auth.default()
        except DefaultCredentialsError:
            raise ConfigError(f"{where}: no Google Cloud credentials found; set GOOGLE_APPLICATION_CREDENTIALS "
                              "to a service-account key file, or run where the metadata server provides "
                              "them (GCE, GKE, TPU VMs)") from None
    else:
        import botocore.session
        if botocore.session.get_session().get_credentials() is None:
            raise ConfigError(f"{where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or run with an instance/task role)")


def check_access(url: str, *, key: str = "run.output_dir") -> None:
    """Fail early, with one line, when `url` cannot be used: an unsupported scheme, a missing
    client library, no credentials, or a bucket that does not exist or cannot be listed.

    Reads only (one listing); nothing is written. Local paths pass without a look. A success is
    remembered for the process, so callers may check the same bucket freely.

    Args:
      url: a run directory, checkpoints folder or checkpoint URL.
      key: the config key it came from, named in the message.
    Raises:
      ConfigError: what is wrong and which variables to set.
    """
    if not is_remote(url):
        return
    scheme, bucket, _ = split_url(url)
    where = f"{key}='{url}'"
    if scheme not in SCHEMES:
        raise ConfigError(f"{where}: only local paths, gs:// and s3:// URLs are supported")
    if not bucket:
        raise ConfigError(f"{where} names no bucket (expected {scheme}://BUCKET/PATH)")
    emulated = [bool(os.environ.get(k)) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")]
    if scheme == "gs" and emulated[0] != emulated[1]:
        # gcsfs (small files, listings) reads one, tensorstore (the arrays) the other: with only
        # one set, half of every checkpoint would go to the emulator and half to the real GCS.
        raise ConfigError(f"{where}: set both STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL to the "
                          "GCS emulator's URL, or neither")
    if (scheme, bucket) in _ok:
        return
    module, extra = _EXTRAS[scheme]
    try:
        __import__(module)
    except ImportError:
        raise ConfigError(f"{where}: {scheme}:// needs {module}; pip install 'jaxtrain[{extra}]'") from None
    _check_credentials(scheme, where)
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") if scheme == "gs" else s3_endpoint()
    at = f" at {endpoint}" if endpoint else ""
    try:
        exists = filesystem(url).exists(f"{scheme}://{bucket}")
    except Exception as e:  # credentials refused, endpoint down, ...: the client says which
        raise ConfigError(f"{where}: cannot list bucket '{bucket}'{at}: {_first_line(e)}") from None
    if not exists:
        raise ConfigError(f"{where}: bucket '{bucket}' does not exist{at}, or these credentials cannot see it")
    _ok.add((scheme, bucket))


# ----------------------------------------------------------------------------- small files


def write_text(path: str, text: str) -> None:
    """Write a whole small file, local or remote (one object write: readers see old or new)."""
    if is_remote(path):
        filesystem(path).pipe_file(path, text.encode())
    else:
        with open(path, "w") as f:
            f.write(text)


def read_bytes(path: str) -> bytes:
    """The contents of a local file or an object."""
    if is_remote(path):
        return filesystem(path).cat_file(path)
    with open(path, "rb") as f:
        return f.read()


def is_file(path: str) -> bool:
    """True when a local file or an object exists at `path` (listings are read fresh)."""
    if is_remote(path):
        fs = filesystem(path)
        fs.invalidate_cache()  # gcsfs/s3fs cache listings per process; another writer may have added it
        return fs.isfile(path)
    return os.path.isfile(path)


def makedirs(path: str) -> None:
    """Create a local directory (object stores have no directories: nothing to do)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


class AppendOnlyFile:
    """A file that is only appended to: a local file, or an object that is rewritten whole.

    Locally every `write` goes to the OS at once (what a kill leaves is every line written).
    On gs:// and s3:// the contents are kept in memory, starting from the object's current
    contents (a resumed run appends to its earlier lines); a background thread uploads them
    as soon as they change but at most once every `flush_interval_s`; `flush()` uploads at once
    and waits.
    A kill loses what was written since the last upload. Rewriting costs O(size) per upload,
    which is fine for logs of a few MB; one writer per file (process 0).
    """

    def __init__(self, path: str, *, flush_interval_s: float = 5.0):
        self.path = os.fspath(path)
        self.remote = is_remote(self.path)
        if not self.remote:
            self._file = open(self.path, "ab")
            return
        self._fs = filesystem(self.path)
        self._data = bytearray(self._fs.cat_file(self.path) if self._fs.exists(self.path) else b"")
        self._uploaded = len(self._data)  # bytes in the object (it only grows)
        self._lock = threading.Lock()  # guards _data, _uploaded
        self._upload_lock = threading.Lock()  # one upload at a time, in order
        self._wake = threading.Event()
        self._closed = False
        self._interval = flush_interval_s
        self.background_error: Optional[BaseException] = None  # the last failed background upload
        self._thread = threading.Thread(target=self._uploader, name=f"jaxtrain-upload-{os.path.basename(self.path)}",
                                        daemon=True)
        self._thread.start()

    def write(self, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        if not self.remote:
            self._file.write(data)
            self._file.flush()
            return
        with self._lock:
            self._data += data
        self._wake.set()

    def flush(self) -> None:
        """Make everything written so far durable (locally: in the OS; remotely: uploaded)."""
        if not self.remote:
            self._file.flush()
            return
        self._upload()

    def _upload(self) -> None:
        with self._upload_lock:
            with self._lock:
                if len(self._data) == self._uploaded:
                    return
                snapshot = bytes(self._data)
            self._fs.pipe_file(self.path, snapshot)  # one object write: readers see old or new
            with self._lock:
                self._uploaded = len(snapshot)

    def _uploader(self) -> None:
        last = 0.0
        while not self._closed:
            self._wake.wait()
            # Coalesce: at most one upload per interval, however many writes came meanwhile.
            time.sleep(max(0.0, last + self._interval - time.monotonic()))
            if self._closed:
                return  # close() uploads the rest itself
            self._wake.clear()
            last = time.monotonic()
            try:
                self._upload()
                self.background_error = None
            except Exception as e:  # retried at the next interval; flush() and close() raise their own
                self.background_error = e
                self._wake.set()

    def close(self) -> None:
        """Upload what is left (remote) and release the file."""
        if not self.remote:
            self._file.close()
            return
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._upload()
