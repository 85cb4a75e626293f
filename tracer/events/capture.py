"""Capture files: the event stream of a run, written to disk and read back for replay.

Layout (gzip-compressed): one JSON header line, then framed items. Each frame is a
tag byte, a little-endian u32 length and the body:

- ``W``: one ring-buffer record, byte for byte; decoded by ``schema.decode`` exactly
  as the live run decoded it.
- ``J``: a user-space event as JSON ``{"type": <class name>, ...fields}``.

The header carries the wire and schema versions, the capture id (which seeds span
ids, so a replay reproduces the live run's ids), the host, the deployment's tenant
salt and whether secrets were masked.

Unless asked to keep secrets, the writer masks before anything reaches the file: the
values of ``Authorization``, ``Proxy-Authorization``, ``api-key``, ``x-api-key``,
``Cookie`` and ``Set-Cookie`` in HTTP/1 bytes (``SecretMasker``: same length, the key
replaced by its HMAC mask so the replay finds the live run's tenants) and secret-looking
command-line arguments of processes. The file is created mode 0600. Readers refuse
versions they do not know, and report a truncated tail instead of failing. A damaged
file never raises past the header: a ``J`` frame that is not a valid event is counted
(``bad_items``) and skipped, and a broken frame or gzip stream ends the reading with
the reason in ``corrupt``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import socket
import struct
import uuid
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any, Iterator

from tracer.events import schema, wire
from tracer.events.h2mask import H2SecretMasker
from tracer.privacy import mask_token, open_private, redact_args, token_span

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
    """A capture header; ``tenant_salt`` is a new random one unless given."""
    h: dict[str, Any] = {
        "format": MAGIC,
        "format_version": FORMAT_VERSION,
        "wire_version": wire.WIRE_VERSION,
        "schema_version": schema.SCHEMA_VERSION,
        "capture_id": uuid.uuid4().hex,
        "host": socket.gethostname(),
        "tenant_salt": uuid.uuid4().hex,
    }
    h.update(extra)
    return h


def tenant_salt(header: dict[str, Any]) -> bytes | None:
    """The tenant salt a capture header names (None: a capture from before salts)."""
    salt = header.get("tenant_salt")
    return salt.encode() if isinstance(salt, str) and salt else None


# ---- masking ---------------------------------------------------------------------------

SECRET_HEADERS = (b"authorization", b"proxy-authorization", b"api-key", b"x-api-key",
                  b"cookie", b"set-cookie")
_SECRET_LINE = re.compile(rb"(?:^|\n)(?:" + b"|".join(SECRET_HEADERS) + rb")[ \t]*:[ \t]*",
                          re.IGNORECASE)
_NAME_CORES = (b"authorization", b"api-key", b"cookie")  # in every name above
_TAIL = 64  # bytes of a read kept to find a header name split across two reads
_C = wire.CONSTANTS
# A TLS connection's plaintext (DATA flagged TLS, from the TLS probes) is a stream of its
# own beside the socket's ciphertext: masking state is kept apart for it.
_TLS_STREAM = 0x10
_DIRECTIONS = (_C["DIR_IN"], _C["DIR_OUT"], _C["DIR_IN"] | _TLS_STREAM,
               _C["DIR_OUT"] | _TLS_STREAM)


def _stream(f: dict[str, Any]) -> int:
    """A DATA record's stream on its connection: its direction, TLS plaintext apart."""
    return int(f["direction"]) | (_TLS_STREAM if int(f["flags"]) & _C["FLAG_TLS"] else 0)


class SecretMasker:
    """Masks credential header values in the HTTP/1 bytes of ring-buffer records.

    A value is masked where it lies, at the same length: the key of a credential
    (after its scheme) by ``mask_token`` under the tenant salt, cookies alike. A value
    split across two reads is masked with ``*`` (its whole key was never in one read);
    such a request has no tenant in a replay. HTTP/2 header blocks (HPACK) are masked
    by ``h2mask.H2SecretMasker``; ``records`` may then hold a read back until its
    header block ends. State is kept per connection direction, for at most
    ``max_streams``."""

    def __init__(self, salt: bytes, max_streams: int = 65536) -> None:
        self.salt = salt
        self.max_streams = max_streams
        self.h2 = H2SecretMasker(salt, max_streams)
        self._next_pos: OrderedDict[tuple[int, int, int, int], int] = OrderedDict()
        # (pid, fd, conn_id, direction) -> (tail of the last read, inside a value)
        self._state: OrderedDict[tuple[int, int, int, int], tuple[bytes, bool]] = OrderedDict()
        self.masked = 0  # values masked

    def records(self, buf: bytes) -> list[bytes]:
        """The records to write now that ``buf`` (one ring-buffer record) came: masked,
        and with any held back for an HTTP/2 header block it completes."""
        if len(buf) >= wire.DATA.header_size and wire.kind_of(buf) == _C["KIND_DATA"]:
            f = wire.DATA.unpack(buf)
            key = (f["pid"], f["fd"], f["conn_id"], _stream(f))
            start = wire.DATA.header_size
            payload = buf[start:start + min(f["len"], len(buf) - start)]
            other = (f["pid"], f["fd"], f["conn_id"], key[3] ^ (_C["DIR_IN"] ^ _C["DIR_OUT"]))
            if self.h2.is_http2(key, payload, other):
                pos = f["stream_off"] + f["offset"]
                complete = self._next_pos.pop(key, pos) == pos
                self._next_pos[key] = pos + len(payload)
                if len(self._next_pos) > self.max_streams:
                    self._next_pos.popitem(last=False)
                return [bytes(r) for r in self.h2.feed(key, bytearray(buf), start,
                                                       start + len(payload), complete)]
        if len(buf) >= wire.CONN.header_size and wire.kind_of(buf) == _C["KIND_CONN"]:
            f = wire.CONN.unpack(buf)
            if f["op"] == _C["CONN_CLOSE"]:
                held: list[bytes] = []
                for d in _DIRECTIONS:
                    key = (f["pid"], f["fd"], f["conn_id"], d)
                    self._next_pos.pop(key, None)
                    held += [bytes(p) for p in self.h2.close(key)]
                return held + [self.record(buf)]
        return [self.record(buf)]

    def flush(self) -> list[bytes]:
        """Records still held (the capture is closing), their open header blocks cut."""
        return [bytes(p) for p in self.h2.flush()]

    def record(self, buf: bytes) -> bytes:
        """``buf`` (one ring-buffer record) with HTTP/1 credential values masked."""
        if len(buf) < 4 or wire.kind_of(buf) != _C["KIND_DATA"]:
            if len(buf) >= wire.CONN.header_size and wire.kind_of(buf) == _C["KIND_CONN"]:
                f = wire.CONN.unpack(buf)
                if f["op"] == _C["CONN_CLOSE"]:
                    for d in _DIRECTIONS:
                        self._state.pop((f["pid"], f["fd"], f["conn_id"], d), None)
            return buf
        start = wire.DATA.header_size
        if len(buf) < start:
            return buf
        if not self._state:  # the common case: no header split over reads pending
            low = buf[start:].lower()
            if not any(n in low for n in _NAME_CORES):
                last = low[low.rfind(b"\n") + 1:]
                if not (last and _name_prefix(last)):
                    return buf
        f = wire.DATA.unpack(buf)
        n = min(f["len"], len(buf) - start)
        key = (f["pid"], f["fd"], f["conn_id"], _stream(f))
        state = self._state.pop(key, None)
        payload = buf[start:start + n]
        if state is None and not _SECRET_LINE.search(payload):
            last = payload[payload.rfind(b"\n") + 1:]
            if last and _name_prefix(last):  # "...\r\nAuthoriz": the rest comes next
                self._remember(key, (last, False))
            return buf
        masked, state = self.mask(payload, state or (b"", False))
        if state[1] or (state[0] and _name_prefix(state[0])):
            self._remember(key, state)
        if masked is payload:
            return buf
        return buf[:start] + masked + buf[start + n:]

    def _remember(self, key: tuple[int, int, int, int], state: tuple[bytes, bool]) -> None:
        self._state[key] = state
        if len(self._state) > self.max_streams:
            self._state.popitem(last=False)

    def mask(self, payload: bytes, state: tuple[bytes, bool]) -> tuple[bytes, tuple[bytes, bool]]:
        """One read's bytes masked, given the state the previous read left."""
        tail, in_value = state
        out = bytearray(payload)
        pos = 0
        if in_value:  # the rest of a value the last read began
            end = _line_end(payload, 0)
            out[:end] = b"*" * end
            pos = end
            if end == len(payload):
                return bytes(out), (b"", True)
        text = tail + payload
        for m in _SECRET_LINE.finditer(text):
            vs = m.end() - len(tail)
            if vs < pos:
                continue
            ve = _line_end(payload, vs)
            if ve == len(payload):  # the value goes on in the next read
                out[vs:] = b"*" * (len(payload) - vs)
                self.masked += 1
                return bytes(out), (b"", True)
            a, b = token_span(payload[vs:ve])
            if b > a:
                out[vs + a:vs + b] = mask_token(payload[vs + a:vs + b], self.salt)
                self.masked += 1
            pos = ve
        nl = payload.rfind(b"\n")
        new_tail = payload[nl + 1:][-_TAIL:] if nl >= 0 else (tail + payload)[-_TAIL:]
        return (bytes(out) if out != payload else payload), (new_tail, False)


def _name_prefix(line: bytes) -> bool:
    """Whether ``line`` (a read's unfinished last line) may be the start of a
    credential header whose value begins in the next read."""
    if len(line) > _TAIL:
        return False
    low = line.lower()
    for h in SECRET_HEADERS:
        if h.startswith(low):
            return True
        if low.startswith(h) and not low[len(h):].strip(b" \t:") and b":" in low[len(h):]:
            return True
        if low.startswith(h) and not low[len(h):].strip(b" \t"):
            return True
    return False


def _line_end(data: bytes, start: int) -> int:
    """Offset of the first CR or LF at or after ``start`` (``len(data)`` if none)."""
    cr, lf = data.find(b"\r", start), data.find(b"\n", start)
    ends = [i for i in (cr, lf) if i >= 0]
    return min(ends) if ends else len(data)


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
    """Append capture items to a file (created 0600); usable as a capture sink.

    ``keep_secrets``: write credential headers and command lines as they were
    (``--capture-secrets``); by default they are masked before writing."""

    def __init__(self, path: str | Path, header: dict[str, Any] | None = None,
                 keep_secrets: bool = False) -> None:
        self.header = header or new_header()
        self.header.setdefault("tenant_salt", uuid.uuid4().hex)
        self.header["secrets_masked"] = not keep_secrets
        salt = tenant_salt(self.header)
        assert salt is not None
        self.masker = None if keep_secrets else SecretMasker(salt)
        self._raw = open_private(path, "wb")
        self._f: IO[bytes] = gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=6)
        self._f.write(json.dumps(self.header).encode() + b"\n")
        self.items = 0

    def __call__(self, item: bytes | Any) -> None:
        self.write(item)

    def write(self, item: bytes | Any) -> None:
        if isinstance(item, (bytes, bytearray)):
            if self.masker is None:
                self._frame(b"W", bytes(item))
                return
            for body in self.masker.records(bytes(item)):
                self._frame(b"W", body)
            return
        if self.masker is not None and isinstance(item, schema.ProcessInfo):
            item = dataclasses.replace(item, cmdline=tuple(redact_args(item.cmdline)))
        self._frame(b"J", json.dumps(event_to_json(item), separators=(",", ":")).encode())

    def _frame(self, tag: bytes, body: bytes) -> None:
        self._f.write(_FRAME.pack(tag, len(body)))
        self._f.write(body)
        self.items += 1

    def close(self) -> None:
        if self.masker is not None:
            for body in self.masker.flush():
                self._frame(b"W", body)
        self._f.close()
        self._raw.close()


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
