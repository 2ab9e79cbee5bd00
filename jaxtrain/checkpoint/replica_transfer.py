"""The local tier's replicas over the network, for hosts whose local disks are private.

Every process of a multi-process job with the local tier runs one small TCP server (daemon
threads). A writer sends each local checkpoint to its holders (`put`); at a restart, a process
whose own copy is gone reads its shards back from the holder's server (`get`). The server only
moves bytes: what a `put` means on disk (the checks before the commit, the rename, retention) and
what a `get` reads are the local tier's callbacks.

Protocol, one request per connection: a 4-byte big-endian length, a JSON header
(`token`, `op`, `owner`, `step`, and for a put the manifest and data lengths); the answers have the
same framing (`{"ok": true}` or `{"error": "..."}`). A put waits for the header's answer before it
sends the payload (so a refused one, a wrong token, is told so rather than cut off mid-send), then
for the commit's; a get's answer carries the lengths, then the manifest and data. The token, drawn by process 0 and shared through the
coordination service, keeps anything but the job's own processes from writing into a node's
local storage or reading its shards.
"""

from __future__ import annotations

import json
import secrets
import socket
import socketserver
import struct
import threading
from typing import Callable, Sequence

_LENGTH = struct.Struct("!I")
MAX_HEADER = 1 << 16  # headers are a few hundred bytes; anything longer is not one of ours
_CHUNK = 1 << 22  # receive in 4 MiB pieces

PutFn = Callable[[int, int, bytes, memoryview], None]  # (owner, step, manifest, data); raises to refuse
GetFn = Callable[[int, int], tuple[bytes, bytes]]  # (owner, step) -> (manifest, data); raises if absent


class TransferError(OSError):
    """A replica could not be sent or fetched (peer unreachable, refused, or cut off)."""


def new_token() -> str:
    return secrets.token_hex(16)


def _send(sock: socket.socket, header: dict, payloads: Sequence[bytes | memoryview] = ()) -> None:
    text = json.dumps(header).encode()
    sock.sendall(_LENGTH.pack(len(text)) + text)
    for payload in payloads:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def _recv_header(sock: socket.socket) -> dict:
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if n > MAX_HEADER:
        raise TransferError(f"header of {n} bytes")
    header = json.loads(bytes(_recv_exact(sock, n)))
    if not isinstance(header, dict):
        raise TransferError("header is not a JSON object")
    return header


class ReplicaServer:
    """Accepts puts of peers' local checkpoints and answers gets, on `port` (0: any free one)."""

    def __init__(self, token: str, on_put: PutFn, on_get: GetFn, *, host: str = "", port: int = 0,
                 timeout_s: float = 300.0):
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._token, self._on_put, self._on_get, self.timeout_s = token, on_put, on_get, timeout_s
        self._server = Server((host, port), Handler)
        self.port: int = self._server.server_address[1]
        self.refused = 0  # requests with a wrong token (tests and logs read it)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="jaxtrain-replica-server")
        self._thread.start()

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        try:
            header = _recv_header(sock)
            if not secrets.compare_digest(str(header.get("token", "")), self._token):
                self.refused += 1
                _send(sock, {"error": "wrong token"})
                return
            owner, step = int(header["owner"]), int(header["step"])
            if header.get("op") == "put":
                _send(sock, {"ok": True})  # send the payload
                manifest = bytes(_recv_exact(sock, int(header["manifest_bytes"])))
                data = _recv_exact(sock, int(header["data_bytes"]))
                try:
                    self._on_put(owner, step, manifest, memoryview(data))
                except Exception as e:  # noqa: BLE001 - refused: the sender reports it
                    _send(sock, {"error": f"{type(e).__name__}: {e}"})
                    return
                _send(sock, {"ok": True})
            elif header.get("op") == "get":
                try:
                    manifest, data = self._on_get(owner, step)
                except Exception as e:  # noqa: BLE001 - the fetcher reports it
                    _send(sock, {"error": f"{type(e).__name__}: {e}"})
                    return
                _send(sock, {"ok": True, "manifest_bytes": len(manifest), "data_bytes": len(data)}, [manifest, data])
            else:
                _send(sock, {"error": f"unknown op {header.get('op')!r}"})
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a peer that went away, or a stranger: nothing was committed

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _connect(address: tuple[str, int], timeout_s: float) -> socket.socket:
    try:
        sock = socket.create_connection(address, timeout=timeout_s)
    except OSError as e:
        raise TransferError(f"peer {address[0]}:{address[1]} unreachable: {e}") from None
    sock.settimeout(timeout_s)
    return sock


def put(address: tuple[str, int], token: str, owner: int, step: int, manifest: bytes,
        buffers: Sequence[memoryview], timeout_s: float) -> None:
    """Send `owner`'s local checkpoint of `step` (its manifest and the data's buffers, in order) to
    the holder at `address`; returns once the holder committed it. Raises TransferError."""
    size = sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in buffers)
    with _connect(address, timeout_s) as sock:
        try:
            _send(sock, {"token": token, "op": "put", "owner": owner, "step": step,
                         "manifest_bytes": len(manifest), "data_bytes": size})
            answer = _recv_header(sock)
            if answer.get("ok"):
                for payload in (manifest, *buffers):
                    sock.sendall(payload)
                answer = _recv_header(sock)
        except (OSError, ValueError) as e:
            raise TransferError(f"sending step {step} to {address[0]}:{address[1]}: {type(e).__name__}: {e}") from None
    if not answer.get("ok"):
        raise TransferError(f"{address[0]}:{address[1]} refused step {step}: {answer.get('error')}")


def get(address: tuple[str, int], token: str, owner: int, step: int, timeout_s: float) -> tuple[bytes, bytearray]:
    """`owner`'s local checkpoint of `step` as held at `address`: (manifest, data). Raises TransferError."""
    with _connect(address, timeout_s) as sock:
        try:
            _send(sock, {"token": token, "op": "get", "owner": owner, "step": step})
            answer = _recv_header(sock)
            if not answer.get("ok"):
                raise TransferError(f"{address[0]}:{address[1]} has no step {step} of process {owner}: "
                                    f"{answer.get('error')}")
            manifest = bytes(_recv_exact(sock, int(answer["manifest_bytes"])))
            return manifest, _recv_exact(sock, int(answer["data_bytes"]))
        except TransferError:
            raise
        except (OSError, ValueError, KeyError) as e:
            raise TransferError(f"fetching step {step} from {address[0]}:{address[1]}: "
                                f"{type(e).__name__}: {e}") from None
