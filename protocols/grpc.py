"""gRPC over HTTP/2 for an observer, sans-I/O: frame events in, calls and messages out.

``GrpcConnection`` feeds an ``http2.H2Observer`` and follows every stream as a call:
the request headers (``:path`` = ``/package.Service/Method``), the length-prefixed
messages in each direction (1 byte compressed flag, 4 bytes big-endian length, then
the message, split across DATA frames at any byte), the response headers and the
``grpc-status``/``grpc-message`` trailers (or a trailers-only response: one HEADERS
block with END_STREAM). Unary, client-, server-streaming and bidi calls are the same
thing here: messages in each direction, each stamped with the time its last byte was
seen. Compressed messages (flag set) are inflated with the direction's declared
``grpc-encoding`` (``gzip``, ``deflate``), bounded by ``MAX_MESSAGE``; what cannot be
inflated is counted and keeps no bytes.

A stream that is not gRPC (other content type, or plain HTTP/2) is still a call, with
its headers and byte counts and no messages. A stream whose start was never seen (the
observer attached late) is counted, not reported: its method would be a guess.

After a late attach, a client that reuses its HPACK dynamic table (grpc-core does,
for every call on a channel) sends header blocks of which nothing but ``:method`` can
be decoded: neither ``:path`` nor ``content-type``. Such a call is taken for gRPC by
its request bytes alone when they are length-prefixed messages that fill its first
DATA frame exactly, or run past a full-size one (``grpc_framed``;
``Call.framing_inferred``, a ``CallRecognised`` event before its first message). Its method stays unknown here; the layer above may
name it from its messages (``protocols.kserve``), and says so.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from urllib.parse import unquote

from protocols import http2

GRPC_PATH = re.compile(r"/[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)+/[A-Za-z_][\w]*")
MAX_MESSAGE = 8 * 1024 * 1024  # bytes kept per message (longer ones: length only)
# open streams followed per connection; past it the least recently active one ends
# (servers advertise SETTINGS_MAX_CONCURRENT_STREAMS of about 100)
MAX_STREAMS = 1024
# zlib window bits per grpc-encoding: gRPC's "deflate" is the zlib format (RFC 1950,
# as grpc-core writes it); 32 + 15 also accepts a gzip header, 31 gzip only
ENCODINGS = {"gzip": 31, "deflate": 47}

# gRPC status codes (grpc/doc/statuscodes.md)
STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
# codes that mean the server failed (OpenTelemetry RPC conventions, server spans)
SERVER_ERROR_CODES = frozenset({2, 4, 12, 13, 14, 15})


def ascii_int(text: str | None, max_digits: int = 10) -> int | None:
    """``text`` (surrounding spaces allowed) as a non-negative decimal integer of at
    most ``max_digits`` ASCII digits, else None. ``str.isdigit`` alone accepts ``"²"``
    and other digits ``int()`` refuses, and any number of them."""
    if text is None:
        return None
    t = text.strip()
    if not t or len(t) > max_digits or not t.isascii() or not t.isdigit():
        return None
    return int(t)


@dataclass(frozen=True, slots=True)
class Message:
    """One length-prefixed gRPC message; ``length`` is its length on the wire.
    ``data`` is the message (inflated when ``compressed``), or None with the reason in
    ``unreadable``: longer than ``MAX_MESSAGE``, or compressed and not inflatable.
    ``ts`` is when its last byte was seen, ``first_ts`` its first."""

    from_client: bool
    first_ts: int
    ts: int
    compressed: bool
    length: int
    data: bytes | None
    unreadable: str | None = None


@dataclass
class Call:
    """One HTTP/2 stream seen from its request headers: a gRPC call when
    ``is_grpc``. Header values are decoded ones only (see ``unknown_header_fields``)."""

    stream_id: int
    start_ns: int
    request_headers: dict[str, str]
    unknown_header_fields: int = 0
    start_off: int | None = None  # its HEADERS frame's stream offset, where given
    request_end_ns: int | None = None
    response_start_ns: int | None = None
    end_ns: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    trailers: dict[str, str] = field(default_factory=dict)
    trailers_only: bool = False
    http_status: int | None = None
    grpc_status: int | None = None
    grpc_message: str | None = None
    reset_code: int | None = None  # RST_STREAM error code, if the stream was reset
    reset_by_client: bool | None = None
    request_messages: int = 0
    response_messages: int = 0
    compressed_messages: int = 0
    request_bytes: int = 0  # DATA payload bytes
    response_bytes: int = 0
    request_incomplete: bool = False  # bytes of this call were lost
    response_incomplete: bool = False
    error: str | None = None
    # gRPC by its request's framing alone: its :path and content-type were unknown
    framing_inferred: bool = False
    # ``/package.Service/Method`` told by the layer above from the call's messages
    # (its :path was unknown); None: not inferred
    inferred_path: str | None = None

    @property
    def path(self) -> str | None:
        return self.request_headers.get(":path") or self.inferred_path

    @property
    def is_grpc(self) -> bool:
        """``content-type: application/grpc...``; or, when the content type could not
        be decoded (a late attach), a decoded ``:path`` of the gRPC form
        ``/package.Service/Method`` (see ``content_type_unknown``), or neither decoded
        and the request framed as gRPC (``framing_inferred``)."""
        ct = self.request_headers.get("content-type")
        if ct is not None:
            return ct.startswith("application/grpc")
        if self.framing_inferred:
            return True
        return self.content_type_unknown and bool(GRPC_PATH.fullmatch(self.path or ""))

    @property
    def content_type_unknown(self) -> bool:
        return "content-type" not in self.request_headers and self.unknown_header_fields > 0

    @property
    def headers_unknown(self) -> bool:
        """Neither ``:path`` nor ``content-type`` decoded, some fields not: a late
        attach's call on a connection that reuses its header table."""
        h = self.request_headers
        return self.content_type_unknown and ":path" not in h

    @property
    def service_method(self) -> tuple[str | None, str | None]:
        """(``package.Service``, ``Method``) from ``:path``, or (None, None). Split
        before percent-decoding: a ``%2F`` stays inside its part."""
        p = self.path
        if not p or not p.startswith("/") or p.count("/") != 2:
            return None, None
        svc, meth = (unquote(part) for part in p[1:].split("/"))
        return (svc or None), (meth or None)


@dataclass(frozen=True, slots=True)
class CallStarted:
    call: Call


@dataclass(frozen=True, slots=True)
class CallRecognised:
    """A call that started with unknown headers is gRPC by its framing
    (``Call.framing_inferred``): its messages follow."""

    call: Call


@dataclass(frozen=True, slots=True)
class CallMessage:
    call: Call
    message: Message


@dataclass(frozen=True, slots=True)
class CallResponseHeaders:
    call: Call


@dataclass(frozen=True, slots=True)
class CallEnded:
    """The call is over (trailers, reset, or the connection went away)."""

    call: Call


CallEvent = CallStarted | CallRecognised | CallMessage | CallResponseHeaders | CallEnded


class MessageReader:
    """Splits one direction of one stream into length-prefixed messages."""

    def __init__(self, from_client: bool) -> None:
        self.from_client = from_client
        self.buf = bytearray()
        self.need = 5  # bytes wanted for the current prefix or message
        self.prefix: tuple[bool, int] | None = None
        self.first_ts = 0
        self.dropping = 0  # bytes of an oversized message still to skip
        self.broken = False  # bytes were lost: message boundaries unknown

    def feed(self, data: bytes, ts: int) -> list[Message]:
        out: list[Message] = []
        if self.broken:
            return out
        pos = 0
        while pos < len(data):
            if self.prefix is None:
                if not self.buf:
                    self.first_ts = ts
                take = min(5 - len(self.buf), len(data) - pos)
                self.buf += data[pos:pos + take]
                pos += take
                if len(self.buf) < 5:
                    break
                flag, length = struct.unpack(">BI", self.buf)
                self.buf.clear()
                self.prefix = (bool(flag & 1), length)
                self.dropping = length if length > MAX_MESSAGE else 0
            compressed, length = self.prefix
            if self.dropping:
                n = min(self.dropping, len(data) - pos)
                self.dropping -= n
                pos += n
                if self.dropping:
                    break
                out.append(Message(self.from_client, self.first_ts, ts, compressed, length, None,
                                   "message too large to keep"))
                self.prefix = None
                continue
            take = min(length - len(self.buf), len(data) - pos)
            self.buf += data[pos:pos + take]
            pos += take
            if len(self.buf) == length:
                out.append(Message(self.from_client, self.first_ts, ts, compressed, length,
                                   bytes(self.buf)))
                self.buf.clear()
                self.prefix = None
        return out

    @property
    def partial(self) -> bool:
        """A message was started and not finished."""
        return bool(self.buf) or self.prefix is not None


class _Stream:
    def __init__(self, call: Call) -> None:
        self.call = call
        self.readers = {True: MessageReader(True), False: MessageReader(False)}
        self.response_head_seen = False
        self.last_ts = call.start_ns  # its last frame

    @property
    def damaged(self) -> bool:
        """Bytes of it were lost: its end may be among them."""
        return self.call.request_incomplete or self.call.response_incomplete


class GrpcConnection:
    """Calls on one HTTP/2 connection, from both directions' bytes."""

    def __init__(self, synced: bool = True, stats: Counter[str] | None = None) -> None:
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.h2 = http2.H2Observer(synced, self.stats)
        self.streams: dict[int, _Stream] = {}

    @property
    def buffered(self) -> int:
        """Bytes held: the HTTP/2 observer's and every open stream's unfinished messages."""
        return self.h2.buffered + sum(len(r.buf) for st in self.streams.values()
                                      for r in st.readers.values())

    def receive(self, data: bytes, ts: int, from_client: bool,
                offset: int | None = None) -> list[CallEvent]:
        """Bytes one endpoint sent; ``offset``: where they begin in its byte stream,
        if known (then ``Call.start_off`` is where each call's HEADERS began)."""
        return self._events(self.h2.receive(data, ts, from_client, offset))

    def lost(self, nbytes: int, ts: int, from_client: bool) -> list[CallEvent]:
        return self._events(self.h2.lost(nbytes, ts, from_client))

    def close(self, ts: int, reason: str = "connection closed before the call ended"
              ) -> list[CallEvent]:
        """The connection is gone: every open call ends, incomplete."""
        out: list[CallEvent] = []
        for sid in list(self.streams):
            out.append(self._end(sid, ts, reason))
        return out

    def expire(self, ts: int, idle_ns: int, damaged_idle_ns: int) -> list[CallEvent]:
        """End the calls with no frame for ``idle_ns`` (``damaged_idle_ns`` for calls
        that lost bytes: their end was probably in the hole), incomplete."""
        out: list[CallEvent] = []
        for sid, st in list(self.streams.items()):
            if st.last_ts < ts - (damaged_idle_ns if st.damaged else idle_ns):
                self.stats["grpc_streams_expired"] += 1
                out.append(self._end(sid, ts, "stream idle past the tracer's timeout "
                                              "(its end was not seen)"))
        return out

    # ---- frame events -> call events ------------------------------------------------

    def _events(self, events: list[http2.Event]) -> list[CallEvent]:
        out: list[CallEvent] = []
        for e in events:
            st = self.streams.get(getattr(e, "stream_id", 0))
            if st is not None:
                st.last_ts = e.ts
            if isinstance(e, http2.Headers):
                self._headers(e, out)
            elif isinstance(e, http2.Data):
                self._data(e, out)
            elif isinstance(e, http2.StreamReset):
                st = self.streams.get(e.stream_id)
                if st is not None:
                    st.call.reset_code = e.error_code
                    st.call.reset_by_client = e.from_client
                    out.append(self._end(e.stream_id, e.ts,
                                         f"stream reset by the {'client' if e.from_client else 'server'}"
                                         f" (HTTP/2 error {e.error_code})"))
            elif isinstance(e, http2.GoAway):
                for sid in [s for s in self.streams if s > e.last_stream_id]:
                    out.append(self._end(sid, e.ts, "refused by GOAWAY"))
            elif isinstance(e, http2.Lost):
                self._lost(e)
            elif isinstance(e, http2.ProtocolError):
                self.stats["http2_protocol_errors"] += 1
        return out

    def _headers(self, e: http2.Headers, out: list[CallEvent]) -> None:
        st = self.streams.get(e.stream_id)
        hdrs: dict[str, str] = {}
        for name, value in e.headers:
            hdrs.setdefault(name, value)
        if e.from_client:
            if st is None:
                if e.stream_id % 2 == 0:
                    self.stats["http2_client_even_streams"] += 1
                    return
                if len(self.streams) >= MAX_STREAMS:
                    oldest = min(self.streams, key=lambda s: self.streams[s].last_ts)
                    self.stats["grpc_streams_evicted"] += 1
                    out.append(self._end(oldest, e.ts, "too many open streams on this "
                                                       "connection to follow them all"))
                call = Call(e.stream_id, e.ts, hdrs, e.unknown_fields, start_off=e.offset)
                self.streams[e.stream_id] = _Stream(call)
                self.stats["http2_streams"] += 1
                out.append(CallStarted(call))
                if e.end_stream:
                    call.request_end_ns = e.ts
                return
            # request trailers (rare in gRPC)
            st.call.unknown_header_fields += e.unknown_fields
            if e.end_stream:
                st.call.request_end_ns = e.ts
            return
        if st is None:
            self.stats["http2_streams_unseen_start"] += 1
            return
        call = st.call
        call.unknown_header_fields += e.unknown_fields
        if not st.response_head_seen:
            st.response_head_seen = True
            call.response_start_ns = e.ts
            call.response_headers = hdrs
            call.http_status = ascii_int(hdrs.get(":status"), 3)
            if e.end_stream:
                call.trailers_only = True
                call.trailers = hdrs
            out.append(CallResponseHeaders(call))
        elif e.end_stream or not hdrs.get(":status", "").startswith("1"):
            call.trailers = hdrs
        if e.end_stream:
            out.append(self._end(e.stream_id, e.ts, None))

    def _data(self, e: http2.Data, out: list[CallEvent]) -> None:
        st = self.streams.get(e.stream_id)
        if st is None:
            self.stats["http2_data_unseen_stream"] += len(e.data)
            return
        call = st.call
        first = e.from_client and call.request_bytes == 0
        if e.from_client:
            call.request_bytes += len(e.data)
        else:
            call.response_bytes += len(e.data)
        if first and call.headers_unknown and not call.is_grpc and grpc_framed(e.data):
            call.framing_inferred = True
            self.stats["grpc_calls_by_framing"] += 1
            out.append(CallRecognised(call))
        if call.is_grpc:
            for m in st.readers[e.from_client].feed(e.data, e.ts):
                if m.from_client:
                    call.request_messages += 1
                else:
                    call.response_messages += 1
                if m.compressed:
                    call.compressed_messages += 1
                    m = self._inflate(call, m)
                out.append(CallMessage(call, m))
        if e.end_stream:
            if e.from_client:
                call.request_end_ns = e.ts
                if st.readers[True].partial:
                    call.request_incomplete = True
            else:
                out.append(self._end(e.stream_id, e.ts, None))

    def _inflate(self, call: Call, m: Message) -> Message:
        """``m`` with its bytes inflated per its direction's ``grpc-encoding``, or
        with no bytes and the reason (counted)."""
        if m.data is None:
            return m
        hdrs = call.request_headers if m.from_client else call.response_headers
        enc = hdrs.get("grpc-encoding")
        data, why = decompress(m.data, enc)
        if data is None:
            self.stats[f"grpc_decompress_{why}"] += 1
            return replace(m, data=None, unreadable=f"{enc or 'unknown'} message {why}"
                           .replace("_", " "))
        self.stats["grpc_messages_decompressed"] += 1
        return replace(m, data=data)

    def _lost(self, e: http2.Lost) -> None:
        targets = ([e.stream_id] if e.stream_id is not None else list(self.streams))
        for sid in targets:
            st = self.streams.get(sid)
            if st is None:
                continue
            st.readers[e.from_client].broken = True
            if e.from_client:
                st.call.request_incomplete = True
            else:
                st.call.response_incomplete = True

    def _end(self, sid: int, ts: int, error: str | None) -> CallEnded:
        st = self.streams.pop(sid)
        call = st.call
        call.end_ns = ts
        if st.readers[False].partial:
            call.response_incomplete = True
        t = call.trailers
        call.grpc_status = ascii_int(t.get("grpc-status"))
        if "grpc-message" in t:
            call.grpc_message = unquote(t["grpc-message"])
        if error is not None:
            call.error = error
            if call.response_start_ns is None or call.grpc_status is None:
                call.response_incomplete = True
        elif call.is_grpc and call.grpc_status is None and call.unknown_header_fields == 0:
            call.error = "the response ended without grpc-status"
        return CallEnded(call)


MIN_MAX_FRAME = 16384  # the smallest SETTINGS_MAX_FRAME_SIZE a peer may set


def grpc_framed(data: bytes) -> bool:
    """``data`` (a request's first DATA frame) is length-prefixed gRPC messages: each a
    flag byte of 0 or 1 and a 4-byte length, the last one ending exactly at the frame's
    end, or, in a frame of at least the 16 KiB every peer allows, running past it (a
    message too large for one frame). gRPC clients write a message in one frame while
    it fits; a prefix split from its message is not taken."""
    pos, n = 0, len(data)
    if n < 5:
        return False
    while pos + 5 <= n:
        flag, length = struct.unpack_from(">BI", data, pos)
        if flag > 1 or length > MAX_MESSAGE:
            return False
        pos += 5 + length
    return pos == n or (pos > n and n >= MIN_MAX_FRAME)


def decompress(data: bytes, encoding: str | None, limit: int | None = None
               ) -> tuple[bytes | None, str | None]:
    """Inflate one compressed message: (bytes, None), or (None, why) where why is
    ``unknown_encoding`` (not declared, or not one of ``ENCODINGS``), ``corrupt``
    (not a whole valid stream) or ``too_large`` (more than ``limit``, default
    ``MAX_MESSAGE``, bytes once inflated: never inflated past that)."""
    wbits = ENCODINGS.get((encoding or "").strip().lower())
    if wbits is None:
        return None, "unknown_encoding"
    limit = MAX_MESSAGE if limit is None else limit
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error:
        return None, "corrupt"
    if len(out) > limit:
        return None, "too_large"
    if not d.eof or d.unused_data:
        return None, "corrupt"
    return out, None


def status_name(code: int | None) -> str | None:
    if code is None:
        return None
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else str(code)
