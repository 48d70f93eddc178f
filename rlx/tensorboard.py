"""TensorBoard scalars without TensorFlow: a minimal event-file writer (and reader).

  writer = SummaryWriter(os.path.join(workdir, "tb"))
  writer.scalars(step, {"reward/mean": 0.4, "eval/band_accuracy": 0.7})
  writer.close()
  # then: tensorboard --logdir WORKDIR/tb

The file is what TensorFlow's writer produces: TFRecord framing (uint64 length, masked CRC32C
of the length, the record, masked CRC32C of the record) around serialized `Event` protos
(tensorflow/core/util/event.proto) holding `Summary.Value.simple_value` scalars. The few proto
fields needed are encoded by hand, so there is no dependency at all.

Resuming: `SummaryWriter(logdir, purge_step=k)` first writes a SessionLog START event at step
k, which tells TensorBoard to drop the events of earlier files with step >= k (the steps the
resumed run writes again), as metrics.jsonl does.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any, Iterator, Mapping

# ---- CRC32C (Castagnoli), as TFRecord uses it -----------------------------------------------


def _crc32c_table() -> list[int]:
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    table.append(c)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  table = _CRC_TABLE
  for b in data:
    crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data +
          struct.pack("<I", masked_crc32c(data)))


# ---- protobuf wire format (just what Event / Summary need) -----------------------------------


def _varint(n: int) -> bytes:
  if n < 0:
    n += 1 << 64  # int64 negatives are 10-byte varints
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint((field << 3) | wire_type)


def _bytes_field(field: int, data: bytes) -> bytes:
  return _key(field, 2) + _varint(len(data)) + data


# Event: wall_time=1 (double), step=2 (int64), file_version=3 (string), summary=5 (Summary),
# session_log=7 (SessionLog). Summary: value=1 (repeated Value). Value: tag=1 (string),
# simple_value=2 (float). SessionLog: status=1 (enum, START=1).
def encode_event(wall_time: float, step: int, *, file_version: str | None = None,
                 scalars: Mapping[str, float] | None = None,
                 session_start: bool = False) -> bytes:
  out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(int(step))
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    summary = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value))
        for tag, value in scalars.items())
    out += _bytes_field(5, summary)
  if session_start:
    out += _bytes_field(7, _key(1, 0) + _varint(1))
  return out


def _scalar(value: Any) -> float | None:
  """A float for numbers (incl. numpy scalars and 0-d arrays); None for anything else."""
  if isinstance(value, bool):
    return float(value)
  try:
    if hasattr(value, "ndim") and value.ndim != 0:
      return None
    if isinstance(value, (str, bytes)):
      return None
    return float(value)
  except (TypeError, ValueError):
    return None


class SummaryWriter:
  """Writes scalar summaries to one new event file in `logdir`.

  The file is created with the first scalars written, so a run that stops before writing any
  (a rejected config, a damaged workdir) leaves no empty events file behind. A write that
  fails (a full disk) raises rlx.metrics.WriteError: one line naming the file and the OS error.
  """

  _counter = 0

  def __init__(self, logdir: str, *, purge_step: int | None = None, flush_every_s: float = 10):
    self.logdir = os.fspath(logdir)
    self.path: str | None = None  # set when the file is created
    self._purge_step = purge_step
    self._f = None
    self._closed = False
    self._flush_every_s = flush_every_s
    self._last_flush = time.monotonic()

  def _new_file(self) -> None:
    os.makedirs(self.logdir, exist_ok=True)
    SummaryWriter._counter += 1
    # TensorBoard (and read_scalars) replay a logdir's files in name order, so a resumed run's
    # file must sort after every earlier one. The classic name (whole seconds, then pid and an
    # unpadded counter) does not: two writers in one second sort by pid, and counter 10 sorts
    # before 9. Microseconds at a fixed width do; a newest file from a clock ahead of ours
    # (another host, a step back of the clock) gets our name appended to its own.
    existing = sorted(f for f in os.listdir(self.logdir) if "tfevents" in f)
    name = (f"events.out.tfevents.{time.time_ns() // 1000:016d}.{socket.gethostname()}."
            f"{os.getpid()}.{SummaryWriter._counter:06d}")
    if existing and name <= existing[-1]:
      name = f"{existing[-1]}.{name[len('events.out.tfevents.'):]}"
    self.path = os.path.join(self.logdir, name)
    self._f = open(self.path, "wb")
    self._last_flush = time.monotonic()
    header = frame_record(encode_event(time.time(), 0, file_version="brain.Event:2"))
    if self._purge_step is not None:
      header += frame_record(encode_event(time.time(), self._purge_step, session_start=True))
    self._f.write(header)
    self._f.flush()

  def _failed(self, e: OSError):
    from rlx.metrics import WriteError  # pylint: disable=g-import-not-at-top
    return WriteError(self.path or self.logdir, e)

  def _write(self, event: bytes) -> None:
    if self._closed:
      raise ValueError(f"SummaryWriter({self.logdir!r}) is closed.")
    try:
      if self._f is None:
        self._new_file()
      self._f.write(frame_record(event))
    except OSError as e:
      raise self._failed(e) from e

  def scalars(self, step: int, values: Mapping[str, Any]) -> None:
    """Writes the numeric entries of `values` at `step` (non-numbers are skipped)."""
    clean = {}
    for tag, value in values.items():
      v = _scalar(value)
      if v is not None:
        clean[str(tag)] = v
    if clean:
      self._write(encode_event(time.time(), step, scalars=clean))
    if time.monotonic() - self._last_flush > self._flush_every_s:
      self.flush()

  def flush(self) -> None:
    if self._f is not None:
      try:
        self._f.flush()
      except OSError as e:
        raise self._failed(e) from e
      self._last_flush = time.monotonic()

  def close(self) -> None:
    self._closed = True
    f, self._f = self._f, None
    if f is not None:
      try:
        f.close()
      except OSError as e:
        raise self._failed(e) from e

  def __enter__(self) -> "SummaryWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ---- reading back (tests, tools) -------------------------------------------------------------


def read_records(path: str) -> Iterator[bytes]:
  """The records of a TFRecord file, CRCs checked; stops quietly at a torn last record."""
  with open(path, "rb") as f:
    while True:
      header = f.read(12)
      if len(header) < 12:
        return
      (length,), (len_crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
      if masked_crc32c(header[:8]) != len_crc:
        raise ValueError(f"{path}: corrupt record length at offset {f.tell() - 12}.")
      data = f.read(length)
      footer = f.read(4)
      if len(data) < length or len(footer) < 4:
        return
      if masked_crc32c(data) != struct.unpack("<I", footer)[0]:
        raise ValueError(f"{path}: corrupt record data at offset {f.tell() - length - 4}.")
      yield data


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
  i = 0
  while i < len(buf):
    key, i = _read_varint(buf, i)
    field, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _read_varint(buf, i)
    elif wire == 1:
      value, i = buf[i:i + 8], i + 8
    elif wire == 2:
      n, i = _read_varint(buf, i)
      value, i = buf[i:i + n], i + n
    elif wire == 5:
      value, i = buf[i:i + 4], i + 4
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}")
    yield field, wire, value


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
  shift = result = 0
  while True:
    b = buf[i]
    i += 1
    result |= (b & 0x7F) << shift
    shift += 7
    if not b & 0x80:
      return result, i


def decode_event(data: bytes) -> dict[str, Any]:
  """{'wall_time', 'step', 'file_version'?, 'scalars': {tag: value}, 'session_start'?}."""
  event: dict[str, Any] = {"wall_time": 0.0, "step": 0, "scalars": {}}
  for field, _, value in _fields(data):
    if field == 1:
      event["wall_time"] = struct.unpack("<d", value)[0]
    elif field == 2:
      event["step"] = value - (1 << 64) if value >= 1 << 63 else value
    elif field == 3:
      event["file_version"] = value.decode()
    elif field == 5:
      for vf, _, v in _fields(value):
        if vf != 1:
          continue
        tag, simple = None, None
        for f2, _, x in _fields(v):
          if f2 == 1:
            tag = x.decode()
          elif f2 == 2:
            simple = struct.unpack("<f", x)[0]
        if tag is not None and simple is not None:
          event["scalars"][tag] = simple
    elif field == 7:
      event["session_start"] = any(f == 1 and v == 1 for f, _, v in _fields(value))
  return event


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} over all event files in logdir (oldest file first).

  A SessionLog START at step k drops the values read so far with step >= k, as TensorBoard does.
  """
  out: dict[str, list[tuple[int, float]]] = {}
  files = sorted(f for f in os.listdir(logdir) if "tfevents" in f)
  for name in files:
    for record in read_records(os.path.join(logdir, name)):
      event = decode_event(record)
      if event.get("session_start"):
        out = {t: [(s, v) for s, v in vals if s < event["step"]] for t, vals in out.items()}
      for tag, value in event["scalars"].items():
        out.setdefault(tag, []).append((event["step"], value))
  return out
