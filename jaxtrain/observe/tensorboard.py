"""TensorBoard scalars without TensorFlow, tensorboardX or torch: the event-file format by hand.

An event file is a sequence of records `len (u64) | masked_crc32c(len) | data | masked_crc32c(data)`
whose data is a serialized `tensorflow.Event` protobuf. We write only two kinds: the file-version
header and scalar summaries, so the protobuf encoding is a few lines. (tensorboardX would do the
same but imports torch when it is installed: seconds of startup on every restart.)
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from jaxtrain.storage import appended_log, small_files
from jaxtrain.storage.paths import join


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord uses."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint((number << 3) | wire_type) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _text_value(tag: str, text: str) -> bytes:
    """A Summary.Value for TensorBoard's text tab: a scalar string tensor (TensorProto dtype 7,
    DT_STRING; an empty shape) with the `text` plugin named in its metadata."""
    plugin = _bytes_field(1, _bytes_field(1, b"text"))  # SummaryMetadata.plugin_data.plugin_name
    tensor = _field(1, 0, _varint(7)) + _bytes_field(2, b"") + _bytes_field(8, text.encode("utf-8"))
    return _bytes_field(1, tag.encode()) + _bytes_field(9, plugin) + _bytes_field(8, tensor)


def _event(step: int, *, file_version: str | None = None, scalars: dict[str, float] | None = None,
           texts: dict[str, str] | None = None) -> bytes:
    msg = _field(1, 1, struct.pack("<d", time.time())) + _field(2, 0, _varint(step))  # wall_time, step
    if file_version is not None:
        msg += _bytes_field(3, file_version.encode())
    if scalars or texts:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", value)))  # tag, simple_value
            for tag, value in (scalars or {}).items())
        values += b"".join(_bytes_field(1, _text_value(tag, text)) for tag, text in (texts or {}).items())
        msg += _bytes_field(5, values)  # Event.summary
    return msg


class ScalarWriter:
    """Appends scalar summaries to `events.out.tfevents.*` files in `log_dir`.

    Locally: one file per writer, `events.out.tfevents.<time>.<host>.<pid>`. `log_dir` may be a
    gs:// or s3:// URL (TensorBoard reads both): objects cannot be appended to, so the records
    go to a series of bounded event files `events.out.tfevents.<time>.<host>.<pid>.<n>` (n =
    000001, ...), each starting with its own file-version record, uploaded in the background
    (see `jaxtrain.storage.appended_log.AppendOnlyFile`; sealed files are never rewritten).
    TensorBoard reads every event file of a folder, in the order of their names, which is the
    order they were written.
    """

    def __init__(self, log_dir: str | Path, *, flush_interval_s: float = 5.0,
                 uploader: appended_log.Uploader | None = None):
        log_dir = os.fspath(log_dir)
        small_files.makedirs(log_dir)
        stem = f"events.out.tfevents.{{}}.{socket.gethostname()}.{os.getpid()}"
        self._file = appended_log.AppendOnlyFile(
            join(log_dir, stem.format(int(time.time()))), flush_interval_s=flush_interval_s, uploader=uploader,
            header=lambda: _record(_event(0, file_version="brain.Event:2")),
            # Remote: named when each starts, so that names sort in writing order (fixed-width time, then n).
            segment_name=lambda n: join(log_dir, stem.format(int(time.time())) + f".{n:06d}"))
        self.path = self._file.path

    @property
    def background_error(self) -> BaseException | None:
        """The last failed background upload (remote), else None."""
        return getattr(self._file, "background_error", None)

    def _write(self, data: bytes) -> None:
        self._file.write(_record(data))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._write(_event(step, scalars=values))

    def texts(self, step: int, values: dict[str, str]) -> None:
        """Text summaries (TensorBoard's text tab), one per tag."""
        self._write(_event(step, texts=values))

    def flush(self) -> None:
        """Make the records durable now (a local file is flushed after every record anyway)."""
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked(crc32c(header))) + data + struct.pack("<I", _masked(crc32c(data)))


def read_scalars(path: str | Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) from an event file written by ScalarWriter (a path or a URL), checking every CRC."""
    data, out, pos = small_files.read_bytes(os.fspath(path)), [], 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        (hcrc,) = struct.unpack_from("<I", data, pos + 8)
        if hcrc != _masked(crc32c(data[pos:pos + 8])):
            raise ValueError(f"{path}: corrupt record header at byte {pos}")
        body = data[pos + 12:pos + 12 + length]
        (dcrc,) = struct.unpack_from("<I", data, pos + 12 + length)
        if dcrc != _masked(crc32c(body)):
            raise ValueError(f"{path}: corrupt record at byte {pos}")
        out += _parse_scalars(body)
        pos += 16 + length
    return out


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes):
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            n, i = _read_varint(buf, i)
            value, i = buf[i:i + n], i + n
        yield number, value


def _parse_scalars(event: bytes) -> list[tuple[int, str, float]]:
    fields = list(_fields(event))
    step = next((v for n, v in fields if n == 2), 0)
    out = []
    for n, summary in fields:
        if n == 5:
            for _, value in _fields(summary):
                parts = dict(_fields(value))
                out.append((step, parts[1].decode(), struct.unpack("<f", parts[2])[0]))
    return out
