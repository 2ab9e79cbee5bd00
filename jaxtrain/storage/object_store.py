"""Object storage (gs://, s3://) for run directories: cloud settings from the environment, the
early access check and tensorstore's S3 kvstore spec. Small files are `small_files`; logs that are
only appended to are `appended_log`.

Everything reads the usual variables of each cloud and nothing else; no secret is ever written
into the run directory, an event or a log line:
  gs://  credentials: GOOGLE_APPLICATION_CREDENTIALS, or the metadata server (GCE/GKE/TPU VMs);
         emulators: STORAGE_EMULATOR_HOST (gcsfs: small files, listing) and
         TENSORSTORE_GCS_HTTP_URL (tensorstore: the arrays).
  s3://  credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, or AWS_PROFILE /
         an instance or task role; region: AWS_REGION or AWS_DEFAULT_REGION, else the bucket's own
         region as the server reports it; S3-compatible stores (MinIO, Ceph, moto):
         AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL.

`check_access` tells a definite "no" (ConfigError, exit 2) from "no answer" (5xx, throttling,
timeouts: retried, then TransientStorageError, exit 75); error lines never show a URL's user info.

"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import time
from typing import Any, Iterator, Optional

from jaxtrain.storage.paths import is_remote
from jaxtrain.config import ConfigError

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


# Retries of the access check (module constants, read at each call, so tests can make them short).
# Waits grow as RETRY_FIRST_WAIT_S * 2**i, each times a random factor in [0.5, 1.5) so that 1,000
# hosts throttled at once do not come back in step: about 1, 2, 4, 8 s between 5 attempts. No wait
# starts that would end past RETRY_DEADLINE_S after the first attempt began.
RETRY_ATTEMPTS = 5
RETRY_FIRST_WAIT_S = 1.0
RETRY_DEADLINE_S = 30.0
PROBE_TIMEOUT_S = 10.0  # per request of the check (connect and read): a hung endpoint is a transient error

# HTTP answers that say "not now" rather than "no": every 5xx, and these.
_TRANSIENT_STATUS = frozenset({408, 429})
# S3 error codes that say "not now" whatever their status (RequestTimeout comes as a 400).
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "TooManyRequests",
    "TooManyRequestsException", "RequestLimitExceeded", "RequestThrottled", "RequestThrottledException",
    "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException", "InternalError",
    "ServiceUnavailable", "PriorRequestNotComplete", "EC2ThrottledException",
})
_USERINFO = re.compile(r"(?<=://)[^/\s@]*@")  # the 'user:password@' of a URL


class TransientStorageError(Exception):
    """The object store gave no definite answer (5xx, throttling, a timeout, a refused or reset
    connection), even after retries.

    Not a user error: the CLI exits 75 ("restart me") so that the job is started again, instead of
    2, which stops it for good. One host of 1,000 that meets a 503 SlowDown at start-up must not end
    the whole job.
    """


def _redact(text: str) -> str:
    """`text` without the user info of any URL in it (an endpoint may be given as user:secret@host)."""
    return _USERINFO.sub("", text)


def _one_line(e: BaseException) -> str:
    """'Type: message' on one line (a multi-line message joined with '; '), user info removed."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = _redact(f"{type(e).__name__}: {'; '.join(lines)}".rstrip(": "))  # before cutting: no half secret
    return text if len(text) <= 400 else text[:397] + "..."


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and what caused it, outermost first (as a traceback prints them; cycles cut)."""
    out: list[BaseException] = []
    x: Optional[BaseException] = e
    while x is not None and all(x is not seen for seen in out) and len(out) < 20:
        out.append(x)
        x = x.__cause__ if x.__cause__ is not None else (None if x.__suppress_context__ else x.__context__)
    return out


def _http_answer(e: BaseException) -> Optional[tuple[int, str, str]]:
    """(HTTP status, error code, message) when `e` carries a server's answer, else None.

    botocore's ClientError (s3fs raises it translated to an OSError, with the ClientError as its
    cause): `.response`; gcsfs's HttpError and google-api-core errors: an int (or digit string)
    `.code`; aiohttp's ClientResponseError: `.status`.
    """
    response = getattr(e, "response", None)
    if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
        error = response.get("Error") or {}
        code, message = str(error.get("Code", "")), str(error.get("Message", ""))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status is None and code.isdigit():
            status = int(code)
        return (int(status), code, message) if status else None
    for attr in ("code", "status"):
        value = getattr(e, attr, None)
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            message = str(getattr(e, "message", "") or e)
            return value, "", message.removesuffix(f", {value}").strip(", ")  # gcsfs appends ', <code>'
    return None


def _transient_types() -> tuple[type, ...]:
    """Exceptions that mean "no answer (yet)": timeouts, refused/reset/dropped connections, and the
    client libraries' names for them (imported only when installed)."""
    types: list[type] = [TimeoutError, ConnectionError]  # builtins: asyncio.TimeoutError is TimeoutError
    for module, names in (("botocore.exceptions", ("ConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                                                  "EndpointConnectionError", "ConnectionClosedError")),
                          ("aiohttp", ("ClientConnectionError", "ServerTimeoutError", "ClientPayloadError")),
                          ("requests.exceptions", ("ConnectionError", "Timeout", "ChunkedEncodingError")),
                          ("google.auth.exceptions", ("TransportError",))):
        types += _installed(module, names)
    return tuple(types)


def _installed(module: str, names: tuple[str, ...]) -> list[type]:
    """The exception classes `names` of `module`, those that exist; none when it is not installed."""
    try:
        mod = __import__(module, fromlist=list(names))
    except ImportError:
        return []
    return [getattr(mod, name) for name in names if hasattr(mod, name)]


def _definite_types() -> tuple[type, ...]:
    """Exceptions that are a definite "no": a retry gives the same answer."""
    types: list[type] = [FileNotFoundError, PermissionError, ImportError]
    for module, names in (("botocore.exceptions", ("NoCredentialsError", "PartialCredentialsError", "NoRegionError",
                                                  "ParamValidationError", "ProfileNotFound", "InvalidConfigError",
                                                  "UnknownCredentialError", "InvalidEndpointConfigurationError",
                                                  "InvalidRegionError")),
                          ("google.auth.exceptions", ("DefaultCredentialsError",))):
        types += _installed(module, names)
    return tuple(types)


def _decisive(e: BaseException) -> tuple[bool, BaseException]:
    """(transient?, the exception that decided it) for an error of the access check.

    The chain is read from its root cause outwards: the innermost exception that says something
    (an HTTP answer, a timeout or connection error, a definite error type) decides, since the
    outer ones are the client libraries' wrappers (s3fs's OSError around a ClientError, botocore's
    HTTPClientError around aiohttp's error, google-auth's RefreshError around a TransportError).
      HTTP: 5xx, 408, 429 and the throttling codes are transient; any other answer (400 bad
        request, 401, 403 AccessDenied / InvalidAccessKeyId / SignatureDoesNotMatch, 404
        NoSuchBucket, 301 wrong region) is definite.
      No answer: timeouts, refused / reset / closed connections are transient.
      Definite: no such bucket or object, permission denied (gcsfs's 'Forbidden' OSError), missing
        library, no or partial credentials, bad parameters, a ValueError (bad URL, bad certificate).
      Anything else is treated as transient: restarting the job costs a few minutes, while calling it
        a user error stops a 1,000-host job for good on one host's hiccup.
    """
    transient, definite = _transient_types(), _definite_types()
    for x in reversed(_chain(e)):
        answer = _http_answer(x)
        if answer is not None:
            status, code, _ = answer
            return (status >= 500 or status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES), x
        if isinstance(x, ConfigError):
            return False, x
        if isinstance(x, transient):
            return True, x
        if isinstance(x, definite) or (type(x) is OSError and str(x).startswith("Forbidden")):
            return False, x
        if isinstance(x, ValueError) and not isinstance(x, (UnicodeError, json.JSONDecodeError)):
            return False, x  # a garbled body (bad JSON, bad UTF-8) may be a proxy's hiccup: not definite
    return True, e


def is_transient(e: BaseException) -> bool:
    """True when `e`, raised by a storage client, is worth retrying (see `_decisive` for the rules)."""
    return _decisive(e)[0]


def _describe(e: BaseException, decisive: BaseException) -> str:
    """One line for an error of the access check: the server's answer when there was one, else
    the outermost message (the client's wording, e.g. 'Could not connect to the endpoint URL')."""
    answer = _http_answer(decisive)
    if answer is None:
        return _one_line(e if str(e).strip() else decisive)
    status, code, message = answer
    head = f"HTTP {status}" + (f" {code}" if code and code != str(status) else "")
    return _redact(f"{head}: {message}" if message else head)


def _not_found(decisive: BaseException) -> bool:
    """The store says the bucket does not exist (or hides it from these credentials)."""
    answer = _http_answer(decisive)
    if answer is not None:
        return answer[0] == 404 or answer[1] == "NoSuchBucket"
    return isinstance(decisive, FileNotFoundError)


def _on_ec2() -> bool:
    """True on an EC2 instance, where botocore asks the instance metadata service for credentials.

    botocore gives that service one try of 1 s and, if it does not answer, reports no credentials
    at all: there "no credentials" may only mean "not yet" (elsewhere it is definite).
    """
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return False
    for path, prefix in (("/sys/devices/virtual/dmi/id/sys_vendor", "amazon ec2"),
                         ("/sys/devices/virtual/dmi/id/board_asset_tag", "i-"), ("/sys/hypervisor/uuid", "ec2")):
        try:
            with open(path) as f:
                if f.read().strip().lower().startswith(prefix):
                    return True
        except OSError:
            pass
    return False


def _check_credentials(scheme: str, where: str) -> None:
    """Raise ConfigError when the cloud SDK finds no credentials at all (emulators need none).

    Other errors of the lookup (a metadata server or STS that does not answer) propagate, for
    `check_access` to classify and retry.
    """
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
            if _on_ec2():  # a fresh session asks the metadata service again at the next attempt
                raise TimeoutError("no AWS credentials from the instance metadata service (it did not answer "
                                   "in time, or the instance has no role)")
            raise ConfigError(f"{where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or run with an instance/task role)")


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Drop a library's log records meanwhile: gcsfs logs every failed request it gives up on with a
    traceback (stderr, via logging's last resort), and the check reports the error in one line."""
    logger = logging.getLogger(logger_name)
    drop = logging.Filter(name="\0")  # matches no record name: drops everything
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _list_bucket(scheme: str, bucket: str) -> None:
    """One listing of at most one object, raising what the client raises.

    A client of its own, with short timeouts and without the client's own retries (check_access
    retries, with one schedule for both clouds), and not cached: `filesystem()`'s clients stay as
    they are. gcsfs has no switch for its retries (6 tries over ~30 s for 5xx, 429 and connection
    errors); on gs:// they come inside each attempt.
    """
    import fsspec
    if scheme == "s3":
        fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs={
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            "connect_timeout": PROBE_TIMEOUT_S, "read_timeout": PROBE_TIMEOUT_S})
        fs.retries = 1  # s3fs's own retry loop
        fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    else:
        import aiohttp
        fs = fsspec.filesystem("gs", skip_instance_cache=True,
                               requests_timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S))
        with _quiet("gcsfs"):
            # Connection: close: the probe's client is never used again, and an idle keep-alive
            # connection left open would hold a single-threaded server (the GCS emulator) for ever.
            fs.call("GET", "b/{}/o", bucket, maxResults=1, json_out=True, headers={"Connection": "close"})


def check_access(url: str, *, key: str = "run.output_dir") -> None:
    """Fail early, with one line, when `url` cannot be used: an unsupported scheme, a missing
    client library, no credentials, or a bucket that does not exist or cannot be listed.

    Reads only (one listing); nothing is written. Local paths pass without a look. A success is
    remembered for the process, so callers may check the same bucket freely.

    Every host runs this at start-up, so an error without a definite answer (5xx, throttling, a
    timeout, a refused connection; see `_decisive`) is retried: up to RETRY_ATTEMPTS attempts with
    exponential backoff and jitter, within about RETRY_DEADLINE_S, then TransientStorageError
    (exit 75: restart the job). Only definite answers are ConfigError (exit 2: stop).

    Args:
      url: a run directory, checkpoints folder or checkpoint URL.
      key: the config key it came from, named in the message.
    Raises:
      ConfigError: what is wrong and which variables to set.
      TransientStorageError: the store did not answer usefully in any attempt.
    """
    if not is_remote(url):
        return
    scheme, bucket, _ = split_url(url)
    where = _redact(f"{key}='{url}'")
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
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") if scheme == "gs" else s3_endpoint()
    at = f" at {_redact(endpoint)}" if endpoint else ""
    if scheme == "s3" and endpoint and _USERINFO.search(endpoint):
        # botocore signs every request in the Authorization header; aiohttp refuses to add the URL's
        # user info to it. Said here, without the secret, rather than as the client's riddle.
        name = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
        raise ConfigError(f"{where}: {name}{at} must not contain user info (user:password@); give S3 "
                          "credentials in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    started = time.monotonic()
    for attempt in range(1, RETRY_ATTEMPTS + 1):
        try:
            _check_credentials(scheme, where)
            _list_bucket(scheme, bucket)
            break
        except ConfigError:
            raise
        except Exception as e:
            transient, decisive = _decisive(e)
            if not transient and _not_found(decisive):
                raise ConfigError(f"{where}: bucket '{bucket}' does not exist{at}, or these credentials "
                                  "cannot see it") from None
            if not transient:
                raise ConfigError(f"{where}: cannot list bucket '{bucket}'{at}: {_describe(e, decisive)}") from None
            wait = RETRY_FIRST_WAIT_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
            elapsed = time.monotonic() - started
            if attempt == RETRY_ATTEMPTS or elapsed + wait > RETRY_DEADLINE_S:
                raise TransientStorageError(
                    f"{where}: no definite answer from bucket '{bucket}'{at}: {_describe(e, decisive)} "
                    f"(gave up after {attempt} attempt{'s' if attempt > 1 else ''} in {elapsed:.1f} s)") from None
            time.sleep(wait)
    _ok.add((scheme, bucket))
