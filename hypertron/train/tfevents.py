"""TensorBoard event files, written directly: the TFRecord framing around ``Event`` protocol buffers
holding scalar summaries, the one kind of record the training loop writes.

A record is its length (little-endian uint64), the masked CRC-32C of those 8 bytes, the serialised
``Event``, and the masked CRC-32C of the ``Event``. The file begins with an ``Event`` holding
``file_version: "brain.Event:2"``; each later one holds a wall time, a step and a ``Summary`` of
``(tag, simple_value)`` values. The fields written (tensorflow/core/util/event.proto and
summary.proto): Event.wall_time = 1 (double), .step = 2 (int64), .file_version = 3 (string),
.summary = 5; Summary.value = 1; Summary.Value.tag = 1 (string), .simple_value = 2 (float).

Written here rather than through ``tensorboardX``, whose package imports ``torch`` when it is
installed: about 3 s of every ``hypertron train`` start on a machine that has it.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: the CRC-32C rotated right by 15 bits plus a constant, mod 2**32."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # int64 as protobuf encodes it: two's complement in 10 bytes when negative
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2, _varint(len(payload)) + payload)


def event(wall_time: float, step: int | None = None, *, file_version: str | None = None,
          scalars: Iterable[tuple[str, float]] = ()) -> bytes:
    """One serialised ``Event``."""
    out = _field(1, 1, struct.pack("<d", wall_time))
    if step is not None:
        out += _field(2, 0, _varint(step))
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    values = b"".join(_length_delimited(1, _length_delimited(1, tag.encode()) + _field(2, 5, struct.pack("<f", value)))
                      for tag, value in scalars)
    if values:
        out += _length_delimited(5, values)
    return out


def record(data: bytes) -> bytes:
    """``data`` in TFRecord framing."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventFile:
    """An event file in ``logdir``, named as TensorBoard looks for them
    (``events.out.tfevents.<seconds>.<host>.<pid>``), flushed every ``flush_secs`` and on close."""

    def __init__(self, logdir: str | Path, flush_secs: float = 10.0):
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = logdir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._file = self.path.open("ab")
        self._flush_secs, self._flushed = flush_secs, now
        self._file.write(record(event(now, step=0, file_version="brain.Event:2")))
        self._file.flush()

    def scalars(self, step: int, values: Iterable[tuple[str, float]]) -> None:
        values = list(values)
        if not values:
            return
        now = time.time()
        self._file.write(record(event(now, step, scalars=values)))
        if now - self._flushed >= self._flush_secs:
            self._file.flush()
            self._flushed = now

    def close(self) -> None:
        self._file.close()
