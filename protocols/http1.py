"""HTTP/1.1 for an observer, sans-I/O, on httptools (llhttp).

``HTTP1Connection`` watches both directions of one connection: feed it the bytes the
client sent and the bytes the server sent, each with a timestamp, and it hands back
typed events. Requests are numbered (``exchange``) in the order they arrive and each
response is paired with the oldest unanswered request, which is how HTTP/1.1
keep-alive and pipelining work.

An observer, unlike an endpoint, must survive what it did not see: it may attach in
the middle of a connection, and the capture may skip bytes (``lost``). It then
*hunts* for the next message start line and carries on; exchanges that straddled the
hole end ``incomplete`` rather than being stitched to the wrong bytes. Malformed bytes
from a peer give a ``ProtocolError`` event and a hunt; they never raise.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import NamedTuple

import httptools

Headers = tuple[tuple[str, str], ...]


# ---- events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """A request head: ``method`` and ``target`` as sent; header names lower-cased."""

    exchange: int
    ts: int
    method: str
    target: str
    version: str
    headers: Headers


@dataclass(frozen=True, slots=True)
class Response:
    """A final (non-1xx) response head for ``exchange``."""

    exchange: int
    ts: int
    status: int
    reason: str
    version: str
    headers: Headers


class Data(NamedTuple):
    """Body bytes (de-chunked) of the request (``from_client``) or response. (A named
    tuple: one per streamed chunk, built faster than a frozen dataclass.)"""

    exchange: int
    ts: int
    data: bytes
    from_client: bool


@dataclass(frozen=True, slots=True)
class EndOfMessage:
    """The request or response of ``exchange`` is complete. ``incomplete`` says some of
    its bytes were never seen (capture gap, or attach mid-message)."""

    exchange: int
    ts: int
    from_client: bool
    incomplete: bool = False


@dataclass(frozen=True, slots=True)
class ProtocolError:
    """Bytes from a peer that are not HTTP/1.1; the direction hunts for a new message."""

    ts: int
    from_client: bool
    message: str


@dataclass(frozen=True, slots=True)
class Abandoned:
    """``exchange`` can no longer be followed (its bytes were lost); ``reason`` says why."""

    exchange: int
    ts: int
    reason: str


@dataclass(frozen=True, slots=True)
class Upgraded:
    """The connection switched protocols (101 or CONNECT); later bytes are not HTTP/1."""

    exchange: int
    ts: int
    protocol: str


Event = Request | Response | Data | EndOfMessage | ProtocolError | Abandoned | Upgraded

# ---- start-line recognisers (for hunting and sniffing) -------------------------------

METHODS = (b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"HEAD", b"OPTIONS", b"TRACE",
           b"CONNECT")
REQUEST_LINE = re.compile(rb"(?:" + b"|".join(METHODS) + rb") [!-~]+ HTTP/1\.[01]\r?\n")
STATUS_LINE = re.compile(rb"HTTP/1\.[01] [1-5][0-9][0-9][^\r\n]*\r?\n")
CHUNK_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,8})\r\n")  # no extensions: the common form
HUNT_KEEP = 8192  # bytes kept while hunting, so a start line split over reads is found
BARRIER = -2  # a hole in the request stream, in the pairing queue
MAX_HEAD = 64 * 1024  # start line and headers of one message (about: checked per read)
MAX_UNANSWERED = 1024  # pipelined requests awaiting a response, per connection


def looks_like_request(data: bytes) -> bool:
    """Whether ``data`` starts with a request method and a space."""
    return any(data.startswith(m + b" ") for m in METHODS)


def looks_like_response(data: bytes) -> bool:
    return data.startswith(b"HTTP/1.")


# ---- one direction ------------------------------------------------------------------


@dataclass
class _Message:
    """Bookkeeping for the message being parsed in one direction."""

    exchange: int = -1
    url: bytearray = field(default_factory=bytearray)
    status_text: bytearray = field(default_factory=bytearray)
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_length: int | None = None
    chunked: bool = False
    body_seen: int = 0
    in_body: bool = False
    incomplete: bool = False
    is_head_response: bool = False


class _Direction:
    """Parser state for the bytes one peer sends."""

    def __init__(self, conn: "HTTP1Connection", from_client: bool, synced: bool) -> None:
        self.conn = conn
        self.from_client = from_client
        self.hunting = not synced
        self.hunt_buf = bytearray()
        self.head_buf = bytearray()  # response to HEAD: headers collected by hand
        self.head_bytes = 0  # bytes fed while the current message's head is unfinished
        self.body_left: int | None = None  # body bytes framed by hand after a gap
        self.upgraded = False
        self.msg: _Message | None = None
        self.ts = 0
        self.out: list[Event] = []
        self.parser = self._new_parser()
        # the parser stands at the start of a chunk-size line of a chunked body: the
        # last callback was the head or a chunk's end, and no byte came after it
        self.at_chunk_start = False
        self._last_cb = ""

    def _new_parser(self) -> httptools.HttpRequestParser | httptools.HttpResponseParser:
        cls = httptools.HttpRequestParser if self.from_client else httptools.HttpResponseParser
        return cls(self)

    # httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.msg = _Message()
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        if self.msg is not None:
            self.msg.url += url

    def on_status(self, status: bytes) -> None:
        if self.msg is not None:
            self.msg.status_text += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.msg is None:
            return
        n = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        self.msg.headers.append((n, v))
        if n == "content-length":
            t = v.strip()
            # isdigit() alone takes "²"; and a length of thousands of digits is no length
            if t.isascii() and t.isdigit() and len(t) <= 18:
                self.msg.content_length = int(t)
        elif n == "transfer-encoding" and "chunked" in v.lower():
            self.msg.chunked = True

    def on_chunk_header(self) -> None:
        self._last_cb = "size"

    def on_chunk_complete(self) -> None:
        self._last_cb = "chunk"

    def on_headers_complete(self) -> None:
        self._last_cb = "head"
        m = self.msg
        if m is None:
            return
        version = self.parser.get_http_version()
        headers = tuple(m.headers)
        if self.from_client:
            method = self.parser.get_method().decode("latin-1")
            m.exchange = self.conn._open_exchange(method, self.ts)
            self.out.append(Request(m.exchange, self.ts, method, m.url.decode("latin-1"),
                                    version, headers))
        else:
            status = self.parser.get_status_code()
            if 100 <= status < 200 and status != 101:
                m.exchange = -1  # informational: the final response is still to come
            else:
                m.exchange = self.conn._answer_exchange(self.ts)
                if m.exchange >= 0:
                    self.out.append(Response(m.exchange, self.ts, status,
                                             m.status_text.decode("latin-1"), version, headers))
        m.in_body = True

    def on_body(self, body: bytes) -> None:
        self._last_cb = "body"
        m = self.msg
        if m is None or m.exchange < 0:
            return
        m.body_seen += len(body)
        self.out.append(Data(m.exchange, self.ts, bytes(body), self.from_client))

    def on_message_complete(self) -> None:
        m = self.msg
        self.msg = None
        if m is None or m.exchange < 0:
            return
        self.out.append(EndOfMessage(m.exchange, self.ts, self.from_client, m.incomplete))
        if not self.from_client:
            self.conn._finish_exchange(m.exchange)

    # feeding ------------------------------------------------------------------------

    def feed(self, data: bytes, ts: int) -> None:
        self.ts = ts
        if self.upgraded or not data:
            return
        if self.at_chunk_start and self._whole_chunk(data):
            return
        self.at_chunk_start = False
        if self.hunting:
            data = self._hunt(data)
            if not data:
                return
        if self.body_left is not None:
            data = self._body_by_hand(data)
            if not data:
                return
        if not self.from_client and self.msg is None and self.conn._next_is_head():
            data = self._feed_head_response(data)
            if not data:
                return
        self._last_cb = ""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as up:
            self._upgrade(up)
            return
        except httptools.HttpParserError as e:
            self._broken(f"malformed HTTP/1 {'request' if self.from_client else 'response'}: {e}")
            return
        m = self.msg
        # A complete size line always makes a callback, and a partial one cannot end in
        # CRLF: so a feed whose last callback ended the head or a chunk, and that ends
        # in CRLF, left the parser where the next chunk's size line starts.
        self.at_chunk_start = (m is not None and m.chunked and m.in_body and m.exchange >= 0
                               and (self._last_cb == "chunk" or (self._last_cb == "head"
                                                                 and m.body_seen == 0))
                               and data.endswith(b"\r\n") and not self.hunting
                               and self.body_left is None)
        if m is not None and not m.in_body:
            # llhttp keeps a header line until it ends, and we keep every header: a
            # peer that never ends its head must not grow either without bound
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:
                self.conn.stats["http1_head_over_budget"] += 1
                self._broken(f"{'request' if self.from_client else 'response'} head over "
                             f"{MAX_HEAD} bytes")

    def _whole_chunk(self, data: bytes) -> bool:
        """``data`` is exactly one whole chunk and the parser stands where it starts:
        its Data event, without the parser (see ``take_chunk``)."""
        body = self.take_chunk(data, self.ts)
        if body is None:
            return False
        self.out.append(Data(self.msg.exchange, self.ts, body, self.from_client))  # type: ignore[union-attr]
        return True

    def take_chunk(self, data: bytes, ts: int) -> bytes | None:
        """If the parser stands at the start of a chunk of a chunked body and ``data``
        is exactly one whole chunk (size line without extensions, data, CRLF): take it
        as llhttp would (which would end where it began, at the next size line) and
        return its data, for the body of ``msg.exchange``; else None, nothing taken."""
        if not self.at_chunk_start:
            return None
        m = CHUNK_SIZE_LINE.match(data)
        if m is None:
            return None
        start = m.end()
        size = int(m.group(1), 16)
        if size == 0 or len(data) != start + size + 2 or not data.endswith(b"\r\n"):
            return None
        self.ts = ts
        self.msg.body_seen += size  # type: ignore[union-attr]
        return data[start:start + size]

    def take_chunks(self, sizes: list[int], ts: int) -> bool:
        """``take_chunk`` of whole chunks known only by their data sizes (the kernel
        checked each one's framing: tracer/events/runs.py), the last taken at ``ts``.
        True: taken; False: the parser does not stand at a chunk's start, nothing done."""
        if not self.at_chunk_start or self.msg is None or 0 in sizes:
            return False
        self.ts = ts
        self.msg.body_seen += sum(sizes)
        return True

    def _body_by_hand(self, data: bytes) -> bytes:
        """After a capture gap inside a body of known length: pass on the body's bytes,
        end the message (incomplete) where the length says, return the bytes after it."""
        m = self.msg
        assert m is not None and self.body_left is not None
        n = min(self.body_left, len(data))
        if n and m.exchange >= 0:
            self.out.append(Data(m.exchange, self.ts, bytes(data[:n]), self.from_client))
        m.body_seen += n
        self.body_left -= n
        if self.body_left == 0:
            self._end_by_hand()
        return data[n:]

    def _end_by_hand(self) -> None:
        m = self.msg
        self.msg = None
        self.body_left = None
        self.parser = self._new_parser()  # the old one is still inside the body
        if m is not None and m.exchange >= 0:
            self.out.append(EndOfMessage(m.exchange, self.ts, self.from_client, True))
            if not self.from_client:
                self.conn._finish_exchange(m.exchange)

    def _feed_head_response(self, data: bytes) -> bytes:
        """A response to HEAD has headers only; llhttp cannot be told, so cut it here."""
        self.head_buf += data
        end = self.head_buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head_buf) > 65536:
                self.head_buf.clear()
                self._broken("response header block over 64 KiB")
            return b""
        head, rest = bytes(self.head_buf[: end + 4]), bytes(self.head_buf[end + 4 :])
        self.head_buf.clear()
        parser = self.parser
        try:
            parser.feed_data(head)
        except httptools.HttpParserError as e:
            self._broken(f"malformed HTTP/1 response: {e}")
            return b""
        m = self.msg
        if m is not None and m.exchange >= 0:
            self.out.append(EndOfMessage(m.exchange, self.ts, False, m.incomplete))
            self.conn._finish_exchange(m.exchange)
        self.msg = None
        self.parser = self._new_parser()
        return rest

    def _upgrade(self, up: httptools.HttpParserUpgrade) -> None:
        exchange = self.msg.exchange if self.msg else self.conn.next_request - 1
        proto = ""
        if self.msg:
            proto = dict(self.msg.headers).get("upgrade", "")
        self.upgraded = True
        self.out.append(Upgraded(exchange, self.ts, proto or "unknown"))

    def _broken(self, message: str) -> None:
        self.out.append(ProtocolError(self.ts, self.from_client, message))
        self._abandon_current("malformed bytes")
        if self.from_client:
            self.conn._request_gap(self.ts)
        self._start_hunt()

    def _abandon_current(self, reason: str) -> None:
        """Stop following the message in progress. A request keeps its place in the
        pairing queue (its response may still be seen); a response ends its exchange."""
        m = self.msg
        self.msg = None
        if m is None or m.exchange < 0:
            return
        if self.from_client:
            self.out.append(EndOfMessage(m.exchange, self.ts, True, incomplete=True))
        else:
            self.out.append(Abandoned(m.exchange, self.ts, reason))
            self.conn._finish_exchange(m.exchange)

    def _start_hunt(self) -> None:
        self.hunting = True
        self.hunt_buf.clear()
        self.head_buf.clear()
        self.body_left = None
        self.parser = self._new_parser()

    def _hunt(self, data: bytes) -> bytes:
        """Skip to the next start line; return the bytes from it on (or b'')."""
        self.hunt_buf += data
        pattern = REQUEST_LINE if self.from_client else STATUS_LINE
        m = pattern.search(self.hunt_buf)
        if m is None:
            if len(self.hunt_buf) > HUNT_KEEP:
                del self.hunt_buf[: len(self.hunt_buf) - HUNT_KEEP]
            return b""
        rest = bytes(self.hunt_buf[m.start():])
        self.hunt_buf.clear()
        self.hunting = False
        return rest

    def lost(self, nbytes: int, ts: int) -> None:
        """``nbytes`` of this direction were never captured."""
        self.ts = ts
        self.at_chunk_start = False
        if self.upgraded or self.hunting:
            return
        m = self.msg
        if (m is not None and m.in_body and not m.chunked and m.content_length is not None
                and m.body_seen + nbytes <= m.content_length):
            # The hole is inside a body of known length: frame the rest of it by hand
            # (never allocating the hole: its size comes from the capture, and what
            # the length allows from the peer) and report the message incomplete.
            m.incomplete = True
            m.body_seen += nbytes
            self.body_left = m.content_length - m.body_seen
            if self.body_left == 0:
                self._end_by_hand()
            return
        self._abandon_current(f"capture missed {nbytes} bytes")
        if self.from_client:
            self.conn._request_gap(ts)
        else:
            self.conn._abandon_unanswered(ts, f"capture missed {nbytes} response bytes")
        self._start_hunt()

    def close(self, ts: int) -> None:
        """The connection ended: a body delimited by close is now complete."""
        self.ts = ts
        self.at_chunk_start = False
        m = self.msg
        if m is None or self.upgraded:
            return
        if (not self.from_client and m.in_body and m.content_length is None
                and not m.chunked and m.exchange >= 0):
            self.msg = None
            self.out.append(EndOfMessage(m.exchange, ts, False, m.incomplete))
            self.conn._finish_exchange(m.exchange)
        else:
            self._abandon_current("connection closed mid-message")


# ---- the connection -----------------------------------------------------------------


class HTTP1Connection:
    """Both directions of one HTTP/1.x connection, seen from outside.

    ``synced`` says whether the observer saw the connection from its first byte; if
    not, each direction hunts for a start line before parsing.
    """

    def __init__(self, synced: bool = True, stats: Counter[str] | None = None) -> None:
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.next_request = 0
        self.unanswered: deque[tuple[int, str, int]] = deque()
        self._client = _Direction(self, True, synced)
        self._server = _Direction(self, False, synced)
        self._out: list[Event] = []

    @property
    def buffered(self) -> int:
        """Bytes held outside the parser: start lines being hunted, HEAD heads."""
        return sum(len(d.hunt_buf) + len(d.head_buf) for d in (self._client, self._server))

    def direction(self, from_client: bool) -> _Direction:
        """The parser state of one peer's bytes."""
        return self._client if from_client else self._server

    def receive(self, data: bytes, ts: int, from_client: bool) -> list[Event]:
        """Bytes one peer sent, captured at ``ts``; returns the events they complete."""
        d = self._client if from_client else self._server
        d.feed(data, ts)
        return self._drain()

    def lost(self, nbytes: int, ts: int, from_client: bool) -> list[Event]:
        """The capture missed ``nbytes`` that one peer sent."""
        (self._client if from_client else self._server).lost(nbytes, ts)
        return self._drain()

    def close(self, ts: int) -> list[Event]:
        """The connection closed; finish or abandon whatever was open."""
        self._client.close(ts)
        self._server.close(ts)
        out = self._drain()
        while self.unanswered:
            ex, _, _ = self.unanswered.popleft()
            if ex != BARRIER:
                out.append(Abandoned(ex, ts, "connection closed before the response"))
        return out

    @property
    def upgraded(self) -> bool:
        return self._client.upgraded or self._server.upgraded

    def _drain(self) -> list[Event]:
        out = self._client.out + self._server.out
        if len(self._client.out) and len(self._server.out):
            out.sort(key=lambda e: e.ts)
        self._client.out = []
        self._server.out = []
        return out

    # pairing, called by the directions -----------------------------------------------
    #
    # ``unanswered`` holds (exchange, method, ts) for requests awaiting a response, and
    # BARRIER entries where request bytes were lost: whole requests may hide in such a
    # hole, and their responses must not be paired with the requests seen after it.

    def _open_exchange(self, method: str, ts: int) -> int:
        ex = self.next_request
        self.next_request += 1
        if len(self.unanswered) >= MAX_UNANSWERED:
            # a client pipelining without end, or responses we cannot see: give up on
            # the oldest (its response, if it comes, pairs with nothing we hold)
            old, _, _ = self.unanswered.popleft()
            self.stats["http1_unanswered_evicted"] += 1
            if old != BARRIER:
                self._client.out.append(Abandoned(old, ts, "too many requests awaiting a "
                                                           "response on this connection"))
        self.unanswered.append((ex, method, ts))
        return ex

    def _answer_exchange(self, ts: int) -> int:
        """The exchange a response starting at ``ts`` answers, or -1 if unknowable."""
        while self.unanswered and self.unanswered[0][0] == BARRIER:
            # A response written before the first request after the hole was read
            # answers a request we never saw.
            if len(self.unanswered) > 1 and self.unanswered[1][2] <= ts:
                self.unanswered.popleft()
                continue
            return -1
        if not self.unanswered:
            return -1  # a response to a request we never saw: ignore its events
        return self.unanswered[0][0]

    def _finish_exchange(self, exchange: int) -> None:
        if self.unanswered and self.unanswered[0][0] == exchange:
            self.unanswered.popleft()

    def _next_is_head(self) -> bool:
        return bool(self.unanswered) and self.unanswered[0][1] == "HEAD"

    def _request_gap(self, ts: int) -> None:
        self.unanswered.append((BARRIER, "", ts))

    def _abandon_unanswered(self, ts: int, reason: str) -> None:
        """Response bytes were lost: no waiting request can be paired with certainty."""
        while self.unanswered:
            ex, _, _ = self.unanswered.popleft()
            if ex != BARRIER:
                self._server.out.append(Abandoned(ex, ts, reason))
