"""Capture files: the event stream of a run, written to disk and read back for replay.

Layout (gzip-compressed): one JSON header line, then framed items. Each frame is a
tag byte, a little-endian u32 length and the body:

- ``W``: one ring-buffer record, byte for byte; decoded by ``schema.decode`` exactly
  as the live run decoded it.
- ``J``: a user-space event as JSON ``{"type": <class name>, ...fields}``.

The header carries the wire and schema versions, the capture id (which seeds span
ids, so a replay reproduces the live run's ids) and the host. Readers refuse
versions they do not know, and report a truncated tail instead of failing. A damaged
file never raises past the header: a ``J`` frame that is not a valid event is counted
(``bad_items``) and skipped, and a broken frame or gzip stream ends the reading with
the reason in ``corrupt``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import socket
import struct
import uuid
import zlib
from pathlib import Path
from typing import IO, Any, Iterator

from tracer.events import schema, wire

MAGIC = "tokentrace-capture"
FORMAT_VERSION = 1
_FRAME = struct.Struct("<cI")
MAX_HEADER_LINE = 1 << 20
# A frame is a ring-buffer record (16 KiB of payload and a header) or a user event
# (process info with its maps: hundreds of KiB at most); a longer one is damage.
MAX_FRAME_BODY = 64 << 20


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


def _fits(v: Any, annotation: str) -> bool:
    """Whether a JSON value fits a user event field's annotation (as written in the
    schema: ``int``, ``str``, ``bool``, ``float``, ``tuple[str, ...]``,
    ``dict[str, int]``); other annotations are not checked."""
    if annotation == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if annotation == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if annotation in ("str", "bool"):
        return isinstance(v, str if annotation == "str" else bool)
    if annotation == "tuple[str, ...]":
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    if annotation == "dict[str, int]":
        return isinstance(v, dict) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v.values())
    return True


def event_from_json(d: Any) -> Any:
    """The user event a ``J`` frame's JSON describes. Raises ``CaptureError`` if it
    names no known event, lacks a field, or a field has the wrong type."""
    if not isinstance(d, dict):
        raise CaptureError(f"user event is a JSON {type(d).__name__}, not an object")
    cls = schema.USER_EVENTS.get(d.get("type", ""))
    if cls is None:
        raise CaptureError(f"unknown user event type {d.get('type')!r}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            if not _fits(v, str(f.type)):
                raise CaptureError(f"{cls.__name__}.{f.name} is not a {f.type}: {v!r:.40}")
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise CaptureError(f"{cls.__name__}: {e}") from None


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
        self.corrupt: str | None = None  # why reading stopped early, if it did
        self.bad_items = 0  # J frames that were not valid events (skipped)
        try:
            self._f: IO[bytes] = gzip.open(self.path, "rb")
            line = self._f.readline(MAX_HEADER_LINE)
            self.header = json.loads(line)
        except (OSError, EOFError, zlib.error, ValueError, RecursionError) as e:
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
                if tag not in (b"W", b"J") or n > MAX_FRAME_BODY:
                    # the framing is lost: nothing after this can be trusted
                    self.corrupt = (f"unknown frame tag {tag!r}" if tag not in (b"W", b"J")
                                    else f"frame of {n} bytes")
                    return
                body = self._f.read(n)
                if len(body) < n:
                    self.truncated = True
                    return
                if tag == b"W":
                    yield body
                    continue
                try:
                    ev = event_from_json(json.loads(body))
                except (ValueError, RecursionError):  # CaptureError is a ValueError
                    self.bad_items += 1
                    continue
                yield ev
        except (EOFError, OSError, gzip.BadGzipFile):
            self.truncated = True  # a capture cut off mid-write: keep what was read
        except zlib.error as e:
            self.corrupt = f"damaged gzip data: {e}"
        finally:
            self._f.close()
