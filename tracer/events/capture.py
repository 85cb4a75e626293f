"""Capture files: the event stream of a run, written to disk and read back for replay.

Layout (gzip-compressed): one JSON header line, then framed items. Each frame is a
tag byte, a little-endian u32 length and the body:

- ``W``: one ring-buffer record, byte for byte; decoded by ``schema.decode`` exactly
  as the live run decoded it.
- ``J``: a user-space event as JSON ``{"type": <class name>, ...fields}``.

The header carries the wire and schema versions, the capture id (which seeds span
ids, so a replay reproduces the live run's ids) and the host. Readers refuse
versions they do not know, and report a truncated tail instead of failing.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import socket
import struct
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

from tracer.events import schema, wire

MAGIC = "tokentrace-capture"
FORMAT_VERSION = 1
_FRAME = struct.Struct("<cI")


class CaptureError(ValueError):
    """The file is not a capture this version can read."""


def new_header(**extra: Any) -> dict[str, Any]:
    h: dict[str, Any] = {
        "format": MAGIC,
        "format_version": FORMAT_VERSION,
        "wire_version": wire.WIRE_VERSION,
        "schema_version": schema.SCHEMA_VERSION,
        "capture_id": uuid.uuid4().hex,
        "host": socket.gethostname(),
    }
    h.update(extra)
    return h


def event_to_json(ev: Any) -> dict[str, Any]:
    d = {"type": type(ev).__name__}
    for f in dataclasses.fields(ev):
        v = getattr(ev, f.name)
        d[f.name] = list(v) if isinstance(v, tuple) else v
    return d


def event_from_json(d: dict[str, Any]) -> Any:
    cls = schema.USER_EVENTS.get(d.get("type", ""))
    if cls is None:
        raise CaptureError(f"unknown user event type {d.get('type')!r}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


class CaptureWriter:
    """Append capture items to a file; usable as a capture sink."""

    def __init__(self, path: str | Path, header: dict[str, Any] | None = None) -> None:
        self.header = header or new_header()
        self._f: IO[bytes] = gzip.open(path, "wb", compresslevel=6)
        self._f.write(json.dumps(self.header).encode() + b"\n")
        self.items = 0

    def __call__(self, item: bytes | Any) -> None:
        self.write(item)

    def write(self, item: bytes | Any) -> None:
        if isinstance(item, (bytes, bytearray)):
            body, tag = bytes(item), b"W"
        else:
            body, tag = json.dumps(event_to_json(item), separators=(",", ":")).encode(), b"J"
        self._f.write(_FRAME.pack(tag, len(body)))
        self._f.write(body)
        self.items += 1

    def close(self) -> None:
        self._f.close()


class CaptureReader:
    """Iterate a capture's items: raw record bytes, or user events."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.truncated = False
        try:
            self._f: IO[bytes] = gzip.open(self.path, "rb")
            line = self._f.readline()
            self.header = json.loads(line)
        except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CaptureError(f"{self.path}: not a tokentrace capture ({e})") from e
        if not isinstance(self.header, dict) or self.header.get("format") != MAGIC:
            raise CaptureError(f"{self.path}: not a tokentrace capture (bad header)")
        for key, have in (("format_version", (FORMAT_VERSION,)),
                          ("wire_version", wire.READABLE_WIRE_VERSIONS),
                          ("schema_version", (schema.SCHEMA_VERSION,))):
            if self.header.get(key) not in have:
                raise CaptureError(
                    f"{self.path}: {key} {self.header.get(key)} is not one of {have}; "
                    "replay it with the tokentrace version that recorded it"
                )

    def __iter__(self) -> Iterator[bytes | Any]:
        try:
            while True:
                head = self._f.read(_FRAME.size)
                if not head:
                    return
                if len(head) < _FRAME.size:
                    self.truncated = True
                    return
                tag, n = _FRAME.unpack(head)
                body = self._f.read(n)
                if len(body) < n:
                    self.truncated = True
                    return
                if tag == b"W":
                    yield body
                elif tag == b"J":
                    yield event_from_json(json.loads(body))
                else:
                    raise CaptureError(f"{self.path}: unknown frame tag {tag!r}")
        except (EOFError, OSError, gzip.BadGzipFile):
            self.truncated = True  # a capture cut off mid-write: keep what was read
        finally:
            self._f.close()
