"""The early access check of gs:// and s3:// run directories against local HTTP endpoints that
fail: a transient error (5xx, 429, SlowDown, a refused connection, a hung server, no answer from
the metadata service) is retried with backoff and then reported as `TransientStorageError`, exit
75 ("restart me"); a definite answer (403 AccessDenied, 404 NoSuchBucket, 400) is `ConfigError`,
exit 2, at once. Either way one line on stderr, no traceback, nothing written, and no user info of
an endpoint URL in it. No client library is mocked: s3fs/botocore and gcsfs talk HTTP to the
servers started here.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import sys
import threading
import time
import types
from typing import Callable, Iterator

import pytest
from helpers import TINY, free_port

from jaxtrain.commands import cli
from jaxtrain.storage import object_store
from jaxtrain.storage.object_store import TransientStorageError
from jaxtrain.config import ConfigError
from jaxtrain.runtime.exit_codes import EXIT_RESTART, EXIT_USAGE

ATTEMPTS = 4  # RETRY_ATTEMPTS in these tests


def s3_error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>jaxtrain-test</RequestId></Error>").encode()


def gcs_error(status: int, message: str) -> bytes:
    return f'{{"error": {{"code": {status}, "message": "{message}"}}}}'.encode()


EMPTY_LISTING = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                 b'2006-03-01/"><Name>bucket</Name><Prefix></Prefix><KeyCount>0</KeyCount><MaxKeys>1</MaxKeys>'
                 b"<IsTruncated>false</IsTruncated></ListBucketResult>")


class Endpoint:
    """An HTTP server on 127.0.0.1 that gives every request the answer `respond(n)` returns for
    the n-th request (status, body), after `delay_s`; it records each request line and when it came
    (time.monotonic)."""

    def __init__(self, respond: Callable[[int], tuple[int, bytes]], delay_s: float = 0.0):
        self.requests: list[str] = []
        self.arrived: list[float] = []
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                endpoint.arrived.append(time.monotonic())
                endpoint.requests.append(f"{self.command} {self.path}")
                status, body = respond(len(endpoint.requests))
                time.sleep(delay_s)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json" if body[:1] == b"{" else "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up waiting (timeout tests)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Callable[..., Endpoint]]:
    """Start endpoints: `endpoint(status, body)` answers always the same, `endpoint(respond=f)` by request."""
    started: list[Endpoint] = []

    def start(status: int = 200, body: bytes = b"", *, respond=None, delay_s: float = 0.0) -> Endpoint:
        started.append(Endpoint(respond or (lambda n: (status, body)), delay_s=delay_s))
        return started[-1]

    yield start
    for e in started:
        e.close()


def _clear_clients() -> None:
    """Forget every cached client: each test's endpoint is gone after it, and a client cached with
    its address (gcsfs, s3fs, and etils.epath's own cache of them, which Orbax uses) would send the
    next test's requests (test_object_storage's included) to a dead or hung server for ever."""
    object_store._ok.clear()  # a bucket that passed once is not checked again in the process
    from storage_servers import clear_client_caches
    clear_client_caches()


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path) -> Iterator[None]:
    """Fresh clients, short retries, and an environment that points at no real cloud: fake S3
    keys, no AWS profile files, no metadata services."""
    _clear_clients()
    monkeypatch.setattr(object_store, "RETRY_ATTEMPTS", ATTEMPTS)
    monkeypatch.setattr(object_store, "RETRY_FIRST_WAIT_S", 0.01)
    monkeypatch.setattr(object_store, "RETRY_DEADLINE_S", 20.0)
    monkeypatch.setattr(object_store, "PROBE_TIMEOUT_S", 2.0)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3",
                 "AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "jaxtrain-test-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "jaxtrain-test-secret-key")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    yield
    _clear_clients()


def use_s3(monkeypatch, url: str) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)


def use_gcs(monkeypatch, url: str) -> None:
    """gcsfs and tensorstore at `url` (as for the GCS emulator), with gcsfs's own retries made fast."""
    import fsspec.config
    import gcsfs.retry
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.setitem(fsspec.config.conf, "gcs", {"token": "anon"})

    async def no_wait(_seconds: float) -> None:
        pass

    # gcsfs retries 5xx/429 itself, waiting 1, 2, 4, 8, 16 s (plus jitter); its module's only use of
    # asyncio is that sleep.
    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_wait))


def one_line(text: str) -> str:
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    return text.strip()


# ----------------------------------------------------------------------------- S3


@pytest.mark.parametrize("status, body, shown", [
    (503, b"", "HTTP 503"),
    (503, s3_error("SlowDown", "Please reduce your request rate."), "HTTP 503 SlowDown: Please reduce"),
    (500, s3_error("InternalError", "We encountered an internal error."), "HTTP 500 InternalError"),
    (429, b"", "HTTP 429"),
    (400, s3_error("RequestTimeout", "Your socket connection to the server was not read from"), "RequestTimeout"),
])
def test_s3_transient_answers_are_retried_then_transient(monkeypatch, endpoint, status, body, shown):
    server = endpoint(status, body)
    use_s3(monkeypatch, server.url)
    with pytest.raises(TransientStorageError) as e:
        object_store.check_access("s3://bucket/run")
    assert len(server.requests) == ATTEMPTS, server.requests  # one request per attempt: no hidden retries
    assert all(r.startswith("GET /bucket?list-type=2") for r in server.requests), server.requests
    message = one_line(str(e.value))
    assert shown in message and f"gave up after {ATTEMPTS} attempts" in message, message
    assert message.startswith("run.output_dir='s3://bucket/run': ") and server.url in message
    assert ("s3", "bucket") not in object_store._ok


@pytest.mark.parametrize("status, body, shown", [
    (403, s3_error("AccessDenied", "Access Denied"), "HTTP 403 AccessDenied: Access Denied"),
    (403, s3_error("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist"), "InvalidAccessKeyId"),
    (403, s3_error("SignatureDoesNotMatch", "The request signature we calculated does not match"),
     "SignatureDoesNotMatch"),
    (400, s3_error("InvalidBucketName", "The specified bucket is not valid."), "HTTP 400 InvalidBucketName"),
    (404, s3_error("NoSuchBucket", "The specified bucket does not exist"), "bucket 'bucket' does not exist at"),
])
def test_s3_definite_answers_are_config_errors_at_once(monkeypatch, endpoint, status, body, shown):
    server = endpoint(status, body)
    use_s3(monkeypatch, server.url)
    with pytest.raises(ConfigError) as e:
        object_store.check_access("s3://bucket/run", key="checkpoint.init_from")
    assert len(server.requests) == 1, server.requests  # not retried
    message = one_line(str(e.value))
    assert shown in message and message.startswith("checkpoint.init_from='s3://bucket/run': "), message


def test_s3_passes_once_the_endpoint_answers(monkeypatch, endpoint):
    """Two 503s, then the listing: the check passes on its third attempt and is remembered."""
    server = endpoint(respond=lambda n: (503, s3_error("SlowDown", "slow down")) if n <= 2 else (200, EMPTY_LISTING))
    use_s3(monkeypatch, server.url)
    object_store.check_access("s3://bucket/run")
    assert len(server.requests) == 3 and ("s3", "bucket") in object_store._ok
    object_store.check_access("s3://bucket/other")  # remembered: no request
    assert len(server.requests) == 3


def test_refused_connection_is_transient(monkeypatch):
    use_s3(monkeypatch, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(TransientStorageError, match="Could not connect to the endpoint URL"):
        object_store.check_access("s3://bucket/run")


def test_hung_endpoint_times_out_and_is_transient(monkeypatch, endpoint):
    """Each attempt ends at its 0.3 s timeout: both are over long before one answer of the hung
    endpoint would come (20 s; the bound leaves seconds for a loaded machine's client set-up,
    which made a 3 s bound on a 1.5 s delay fail once in a full run)."""
    monkeypatch.setattr(object_store, "PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(object_store, "RETRY_ATTEMPTS", 2)
    server = endpoint(200, EMPTY_LISTING, delay_s=20.0)
    use_s3(monkeypatch, server.url)
    started = time.monotonic()
    with pytest.raises(TransientStorageError, match="gave up after 2 attempts") as e:
        object_store.check_access("s3://bucket/run")
    assert time.monotonic() - started < 20.0, "each attempt must end at its timeout"
    assert len(server.requests) == 2
    assert "timeout" in str(e.value).lower(), e.value


def test_backoff_stops_at_the_deadline(monkeypatch, endpoint):
    """Waits double from RETRY_FIRST_WAIT_S (times 0.5 to 1.5); none starts that would end past the
    deadline, whatever RETRY_ATTEMPTS allows."""
    monkeypatch.setattr(object_store, "RETRY_ATTEMPTS", 50)
    monkeypatch.setattr(object_store, "RETRY_FIRST_WAIT_S", 0.1)
    monkeypatch.setattr(object_store, "RETRY_DEADLINE_S", 1.0)
    server = endpoint(503)
    use_s3(monkeypatch, server.url)
    # The waits as the retry loop asks for them (then really taken): on a loaded machine an
    # attempt's own set-up has taken over a second, so the server's clock cannot say when a wait
    # ended, only that attempts came.
    waits: list[tuple[float, float]] = []
    real_sleep = time.sleep
    started = time.monotonic()

    def sleep(seconds: float) -> None:
        if sys._getframe(1).f_code is object_store.check_access.__code__:  # the retry loop's, not a client's
            waits.append((time.monotonic() - started, seconds))
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    with pytest.raises(TransientStorageError):
        object_store.check_access("s3://bucket/run")
    monkeypatch.setattr(time, "sleep", real_sleep)
    # Nominal waits 0.1, 0.2, 0.4, 0.8 s (x 0.5-1.5): at most 4 within the second, each growing, none
    # ending past the deadline; one attempt after each wait.
    assert len(waits) <= 4 and len(server.requests) == len(waits) + 1, (waits, server.requests)
    assert all(0.05 * 2 ** i <= w <= 0.15 * 2 ** i for i, (_, w) in enumerate(waits)), waits
    assert all(at + w <= 1.0 + 0.05 for at, w in waits), waits
def test_no_credentials_is_definite_off_ec2_and_retried_on_ec2(monkeypatch):
    """botocore reports "no credentials" when EC2's metadata service does not answer in time: only
    there is it retried (and then transient); elsewhere it is a user error at once."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    use_s3(monkeypatch, f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(object_store, "_on_ec2", lambda: False)
    with pytest.raises(ConfigError, match="no AWS credentials found"):
        object_store.check_access("s3://bucket/run")
    monkeypatch.setattr(object_store, "_on_ec2", lambda: True)
    with pytest.raises(TransientStorageError, match="instance metadata service.*gave up after 4 attempts"):
        object_store.check_access("s3://bucket/run")


# ----------------------------------------------------------------------------- GCS


def test_gcs_503_is_retried_then_transient_without_traceback(monkeypatch, endpoint, capfd):
    server = endpoint(503, gcs_error(503, "Backend Error"))
    use_gcs(monkeypatch, server.url)
    with pytest.raises(TransientStorageError) as e:
        object_store.check_access("gs://bucket/run")
    message = one_line(str(e.value))
    assert "HTTP 503: Backend Error" in message and f"gave up after {ATTEMPTS} attempts" in message, message
    assert len(server.requests) >= ATTEMPTS  # gcsfs retries inside each attempt too
    assert all(r.startswith("GET /storage/v1/b/bucket/o?maxResults=1") for r in server.requests), server.requests
    assert capfd.readouterr().err == ""  # gcsfs logs each failure it gives up on with a traceback


@pytest.mark.parametrize("status, shown", [(403, "Forbidden"), (404, "bucket 'bucket' does not exist"),
                                           (400, "Bad Request")])
def test_gcs_definite_answers_are_config_errors_at_once(monkeypatch, endpoint, capfd, status, shown):
    server = endpoint(status, gcs_error(status, "invalid: caller does not have storage.objects.list access"))
    use_gcs(monkeypatch, server.url)
    with pytest.raises(ConfigError) as e:
        object_store.check_access("gs://bucket/run")
    assert len(server.requests) == 1 and shown in one_line(str(e.value)), (server.requests, e.value)
    assert capfd.readouterr().err == ""


# ----------------------------------------------------------------------------- classification


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "ListObjectsV2")


def _translated(error: Exception) -> Exception:
    """As s3fs raises it: an OSError (or PermissionError, ...) caused by botocore's ClientError."""
    from s3fs.errors import translate_boto_error
    return translate_boto_error(error)


def _caused(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause
    return outer


def _cases() -> list[tuple[str, Callable[[], BaseException], bool]]:
    import aiohttp
    import botocore.exceptions as bx
    import google.auth.exceptions as gx
    import gcsfs.retry
    return [
        ("s3 503", lambda: _translated(_client_error(503, "503")), True),
        ("s3 SlowDown", lambda: _translated(_client_error(503, "SlowDown")), True),
        ("s3 500", lambda: _translated(_client_error(500, "InternalError")), True),
        ("s3 429", lambda: _client_error(429, "TooManyRequests"), True),
        ("s3 throttling 400", lambda: _client_error(400, "Throttling"), True),
        ("s3 AccessDenied", lambda: _translated(_client_error(403, "AccessDenied")), False),
        ("s3 InvalidAccessKeyId", lambda: _translated(_client_error(403, "InvalidAccessKeyId")), False),
        ("s3 SignatureDoesNotMatch", lambda: _client_error(403, "SignatureDoesNotMatch"), False),
        ("s3 NoSuchBucket", lambda: _translated(_client_error(404, "NoSuchBucket")), False),
        ("s3 400", lambda: _client_error(400, "InvalidRequest"), False),
        ("endpoint down", lambda: bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True),
        ("connect timeout", lambda: bx.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), True),
        ("read timeout", lambda: bx.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), True),
        ("HTTPClientError around a reset", lambda: _caused(bx.HTTPClientError(error="x"), ConnectionResetError()), True),
        ("HTTPClientError around a ValueError", lambda: _caused(bx.HTTPClientError(error="x"), ValueError("bad")),
         False),
        ("no credentials", lambda: bx.NoCredentialsError(), False),
        ("gcs 503", lambda: gcsfs.retry.HttpError({"code": 503, "message": "Backend Error"}), True),
        ("gcs 429", lambda: gcsfs.retry.HttpError({"code": 429, "message": "rate"}), True),
        ("gcs 401", lambda: gcsfs.retry.HttpError({"code": 401, "message": "Invalid Credentials"}), False),
        ("gcs 403", lambda: OSError("Forbidden: b/bucket/o\nno access"), False),
        ("gcs 404", lambda: FileNotFoundError("b/bucket/o"), False),
        ("aiohttp connection", lambda: aiohttp.ClientConnectionError("reset"), True),
        ("asyncio timeout", lambda: asyncio.TimeoutError(), True),
        ("metadata server timeout", lambda: _caused(gx.RefreshError("metadata"), gx.TransportError("timed out")), True),
        ("no Google credentials", lambda: gx.DefaultCredentialsError("none"), False),
        ("connection refused", lambda: ConnectionRefusedError(111, "refused"), True),
        ("garbled JSON", lambda: _garbled_json(), True),
        ("unknown", lambda: RuntimeError("something else"), True),
    ]


def _garbled_json() -> Exception:
    import json
    try:
        json.loads("{")
    except ValueError as e:
        return e
    raise AssertionError


@pytest.mark.parametrize("case", range(len(_cases())), ids=[c[0] for c in _cases()])
def test_classification(case):
    name, make, transient = _cases()[case]
    assert object_store.is_transient(make()) is transient, name


# ----------------------------------------------------------------------------- user info, the CLI


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_endpoint_user_info_never_reaches_an_error_line(monkeypatch, endpoint, capsys, tmp_path, scheme):
    monkeypatch.chdir(tmp_path)
    server = endpoint(503, b"")
    url = server.url.replace("http://", "http://someone:hunter2-secret@")
    if scheme == "s3":
        use_s3(monkeypatch, url)
        with pytest.raises(ConfigError, match="AWS_ENDPOINT_URL at http://127.0.0.1:.* must not contain user info"):
            object_store.check_access("s3://bucket/run")
    else:
        use_gcs(monkeypatch, url)
        with pytest.raises(TransientStorageError) as e:
            object_store.check_access("gs://bucket/run")
        assert "hunter2" not in str(e.value) and "someone" not in str(e.value)
        _clear_clients()
    for verb in (["checkpoints", f"{scheme}://bucket/run"],
                 ["train", "--config", TINY, f"run.output_dir={scheme}://bucket/run",
                  "checkpoint.compilation_cache_dir=null"]):
        code = cli.main(verb)
        out = capsys.readouterr()
        assert code == (EXIT_USAGE if scheme == "s3" else EXIT_RESTART), out.err
        assert "hunter2" not in out.err + out.out and "someone" not in out.err + out.out, out.err
        one_line(out.err)
        _clear_clients()
    assert os.listdir(tmp_path) == []


def test_redact_strips_user_info_of_every_url():
    text = 'Could not connect to "http://u:p%40ss@10.0.0.1:9000/b?x=1" nor https://tok@host/ (s3://bucket/run)'
    assert object_store._redact(text) == 'Could not connect to "http://10.0.0.1:9000/b?x=1" nor https://host/ (s3://bucket/run)'


@pytest.mark.parametrize("status, body, code, first", [
    (503, s3_error("SlowDown", "Please reduce your request rate."), EXIT_RESTART,
     "jaxtrain: storage unavailable (transient), restart me: "),
    (403, s3_error("AccessDenied", "Access Denied"), EXIT_USAGE, "jaxtrain: error: "),
])
def test_cli_train_exit_code_one_line_nothing_written(monkeypatch, endpoint, capsys, tmp_path, status, body, code,
                                                      first):
    """`jaxtrain train` with run.output_dir in a bucket the endpoint refuses: 503 -> 75 after the
    retries, 403 -> 2 at once; one stderr line, nothing written."""
    monkeypatch.chdir(tmp_path)
    server = endpoint(status, body)
    use_s3(monkeypatch, server.url)
    rc = cli.main(["train", "--config", TINY, "run.output_dir=s3://bucket/run", "checkpoint.compilation_cache_dir=null",
                   "train.steps=2", "model.num_layers=1"])
    err = one_line(capsys.readouterr().err)
    assert rc == code and err.startswith(first + "run.output_dir='s3://bucket/run': "), (rc, err)
    assert len(server.requests) == (ATTEMPTS if status == 503 else 1)
    assert all(r.startswith("GET ") for r in server.requests), server.requests  # read only
    assert os.listdir(tmp_path) == []
