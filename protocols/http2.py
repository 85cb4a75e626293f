"""HTTP/2 for an observer, sans-I/O: bytes of both directions in, typed frame events out.

``H2Observer`` watches one connection as a third party (not an endpoint): feed it the
bytes the client sent and the bytes the server sent, each with a timestamp, and it
hands back events. It holds one HPACK decoder per direction (the ``hpack`` library)
and applies ``SETTINGS_HEADER_TABLE_SIZE`` when the peer acknowledges it, so header
blocks decode exactly when the observer saw the connection from its first byte (h2c
with prior knowledge: the client's preface, then frames).

An observer must also survive what it did not see. When it attaches mid-connection,
or the capture skips bytes (``lost``), it resynchronises on frame boundaries (a chain
of plausible frame headers), and decodes later header blocks with
``hpack_partial.PartialDecoder``: static-table and literal fields decode, references
to dynamic-table entries it never saw are counted in ``Headers.unknown_fields``, never
guessed. A malformed peer gives a ``ProtocolError`` event and a resync; nothing here
raises on bad bytes.
"""

from __future__ import annotations

import struct
from collections import Counter, deque
from dataclasses import dataclass

from hpack import Decoder
from hpack.exceptions import HPACKError

from protocols.hpack_partial import PartialDecoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, \
    WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_MAX_FRAME_SIZE = 0x5

DEFAULT_MAX_FRAME = 16384
MAX_FRAME = (1 << 24) - 1
# A side whose SETTINGS were never seen (late attach) may have been allowed frames up to
# MAX_FRAME; the observer believes frames up to this, the rest is a resync.
UNKNOWN_MAX_FRAME = 1 << 20
UNSYNCED_KEEP = 4 * DEFAULT_MAX_FRAME  # bytes held while hunting for a frame boundary
MAX_HEADER_BLOCK = 1 << 20  # a header block larger than this is dropped, not buffered

Headers_ = tuple[tuple[str, str], ...]

# Per frame type: flags that may be set, whether the stream id must be zero (True),
# non-zero (False) or either (None), and a payload length check.
_FRAME_RULES: dict[int, tuple[int, bool | None, object]] = {
    DATA: (END_STREAM | PADDED, False, None),
    HEADERS: (END_STREAM | END_HEADERS | PADDED | PRIORITY_FLAG, False, None),
    PRIORITY: (0, False, 5),
    RST_STREAM: (0, False, 4),
    SETTINGS: (ACK, True, "settings"),
    PUSH_PROMISE: (END_HEADERS | PADDED, False, None),
    PING: (ACK, True, 8),
    GOAWAY: (0, True, "goaway"),
    WINDOW_UPDATE: (0, None, 4),
    CONTINUATION: (END_HEADERS, False, None),
}


# ---- events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Preface:
    """The client's connection preface (``PRI * HTTP/2.0 ...``)."""

    ts: int


@dataclass(frozen=True, slots=True)
class Settings:
    """A SETTINGS frame: ``values`` as (identifier, value) pairs; ``ack`` if it
    acknowledges the peer's settings (then ``values`` is empty)."""

    ts: int
    from_client: bool
    ack: bool
    values: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Headers:
    """A complete header block (HEADERS plus any CONTINUATION) on ``stream_id``.

    ``headers`` are (name, value) in order, names as sent (lower case in HTTP/2);
    ``unknown_fields`` counts fields that could not be decoded (a dynamic-table entry
    the observer never saw, or a malformed block: then at least 1)."""

    ts: int
    from_client: bool
    stream_id: int
    headers: Headers_
    end_stream: bool
    unknown_fields: int = 0
    # the stream offset of the block's first frame header, where the caller gave
    # offsets (``H2Observer.receive``); None if it did not
    offset: int | None = None


@dataclass(frozen=True, slots=True)
class PushPromise:
    """A server push announcing ``promised_stream_id`` with its request headers."""

    ts: int
    from_client: bool
    stream_id: int
    promised_stream_id: int
    headers: Headers_
    unknown_fields: int = 0


@dataclass(frozen=True, slots=True)
class Data:
    """DATA payload of ``stream_id`` (padding removed); ``flow_length`` is the frame's
    whole length, as counted by flow control."""

    ts: int
    from_client: bool
    stream_id: int
    data: bytes
    end_stream: bool
    flow_length: int


@dataclass(frozen=True, slots=True)
class StreamReset:
    """RST_STREAM: ``stream_id`` ended abruptly with HTTP/2 ``error_code``."""

    ts: int
    from_client: bool
    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class GoAway:
    """GOAWAY: streams above ``last_stream_id`` were not and will not be processed."""

    ts: int
    from_client: bool
    last_stream_id: int
    error_code: int
    debug: bytes


@dataclass(frozen=True, slots=True)
class WindowUpdate:
    """WINDOW_UPDATE for ``stream_id`` (0: the connection)."""

    ts: int
    from_client: bool
    stream_id: int
    increment: int


@dataclass(frozen=True, slots=True)
class Ping:
    """PING (or its ``ack``) with 8 opaque bytes."""

    ts: int
    from_client: bool
    ack: bool
    opaque: bytes


@dataclass(frozen=True, slots=True)
class Lost:
    """``nbytes`` of this direction were never seen. ``stream_id`` names the only
    stream they belonged to when known (the hole was inside one frame); None means any
    stream open in this direction may have lost bytes."""

    ts: int
    from_client: bool
    nbytes: int
    stream_id: int | None


@dataclass(frozen=True, slots=True)
class ProtocolError:
    """Bytes from a peer that are not valid HTTP/2; this direction resynchronises."""

    ts: int
    from_client: bool
    message: str


Event = (Preface | Settings | Headers | PushPromise | Data | StreamReset | GoAway
         | WindowUpdate | Ping | Lost | ProtocolError)


# ---- frame headers ------------------------------------------------------------------


def parse_frame_header(buf: bytes | bytearray | memoryview, i: int = 0
                       ) -> tuple[int, int, int, int]:
    """(length, type, flags, stream_id) of the 9-byte frame header at ``buf[i:]``."""
    hi, lo, ftype, flags, sid = struct.unpack_from(">BHBBI", buf, i)
    return (hi << 16) | lo, ftype, flags, sid & 0x7FFFFFFF


def plausible_frame_header(buf: bytes | bytearray | memoryview, i: int,
                           max_frame: int = MAX_FRAME) -> bool:
    """Whether the 9 bytes at ``buf[i:]`` read as a frame header a peer could send:
    a known type, only that type's flags, the reserved bit clear, the right kind of
    stream id and a length the type allows."""
    length, ftype, flags, _ = parse_frame_header(buf, i)
    rules = _FRAME_RULES.get(ftype)
    if rules is None or length > max_frame or buf[i + 5] & 0x80:
        return False
    allowed, zero_stream, size = rules
    if flags & ~allowed:
        return False
    sid = struct.unpack_from(">I", buf, i + 5)[0]
    if zero_stream is not None and (sid == 0) != zero_stream:
        return False
    if size == "settings":
        return length % 6 == 0 and not (flags & ACK and length)
    if size == "goaway":
        return length >= 8
    return size is None or length == size


RESYNC_MAX_STREAM = 1 << 24  # stream ids believed while resynchronising (8M calls)


def likely_frame_header(buf: bytes | bytearray | memoryview, i: int,
                        max_frame: int = MAX_FRAME) -> bool:
    """Stricter than ``plausible_frame_header``, for finding frame boundaries in bytes
    of unknown alignment: also no empty DATA without END_STREAM, no empty header
    frame, no zero WINDOW_UPDATE, and stream ids below ``RESYNC_MAX_STREAM``."""
    if not plausible_frame_header(buf, i, max_frame):
        return False
    length, ftype, flags, sid = parse_frame_header(buf, i)
    if sid >= RESYNC_MAX_STREAM:
        return False
    if ftype == DATA and length == 0 and not flags & END_STREAM:
        return False
    if ftype in (HEADERS, CONTINUATION, PUSH_PROMISE) and length == 0:
        return False
    if ftype == WINDOW_UPDATE and len(buf) >= i + 13:
        return struct.unpack_from(">I", buf, i + 9)[0] & 0x7FFFFFFF != 0
    return True


def find_frame_boundary(buf: bytes | bytearray, start: int = 0, max_frame: int = MAX_FRAME
                        ) -> int:
    """The first offset from ``start`` where a chain of likely frame headers runs to
    the end of ``buf`` (exactly, or through at least two whole frames into a partial
    one), else -1. A CONTINUATION cannot start a chain: its HEADERS was not seen."""
    n = len(buf)
    for i in range(start, n - 8):
        if not likely_frame_header(buf, i, max_frame):
            continue
        if buf[i + 3] == CONTINUATION:
            continue
        j, whole = i, 0
        while j + 9 <= n and likely_frame_header(buf, j, max_frame):
            j += 9 + parse_frame_header(buf, j)[0]
            if j <= n:
                whole += 1
        if j == n or (whole >= 2 and j > n):
            return i
    return -1


def looks_like_frames(data: bytes) -> bool:
    """Whether ``data`` (the first bytes seen of a connection found open) starts with
    HTTP/2 frames: the preface, or a chain of plausible frame headers from offset 0."""
    if data.startswith(PREFACE[: len(data)]):
        return True
    return len(data) >= 9 and find_frame_boundary(data[: 4 * DEFAULT_MAX_FRAME], 0) == 0 \
        and _chain_has_streams(data)


def server_settings_first(data: bytes) -> bool:
    """Whether a server's first bytes are HTTP/2 frames starting with SETTINGS (an h2c
    server may send its SETTINGS before the client's preface arrives)."""
    return len(data) >= 9 and data[3] == SETTINGS and find_frame_boundary(data[:UNSYNCED_KEEP]) == 0


def _chain_has_streams(data: bytes) -> bool:
    """At least one frame of the chain at 0 is a stream frame or SETTINGS: a chain of
    only PING/WINDOW_UPDATE-looking bytes is too weak to call HTTP/2."""
    j = 0
    while j + 9 <= len(data):
        length, ftype, _, _ = parse_frame_header(data, j)
        if ftype in (DATA, HEADERS, SETTINGS, RST_STREAM, GOAWAY):
            return True
        j += 9 + length
    return False


def header_block_sender(data: bytes) -> str | None:
    """Who sent the first header block in ``data`` (frames from offset 0): "client" if
    it carries ``:method``, "server" if ``:status``, None if undecided."""
    j = 0
    while j + 9 <= len(data):
        length, ftype, flags, _ = parse_frame_header(data, j)
        payload = data[j + 9: j + 9 + length]
        if ftype == HEADERS and len(payload) == length:
            block = _strip_headers_payload(payload, flags)
            if block is not None:
                try:
                    fields, _ = PartialDecoder().decode(block)
                except (HPACKError, IndexError, ValueError):
                    return None
                names = {f[0] for f in fields}
                if b":method" in names or b":path" in names:
                    return "client"
                if b":status" in names:
                    return "server"
            return None
        j += 9 + length
    return None


def _strip_headers_payload(payload: bytes, flags: int) -> bytes | None:
    """A HEADERS payload without padding and priority fields (None if malformed)."""
    start, end = 0, len(payload)
    if flags & PADDED:
        if not payload:
            return None
        start, end = 1, len(payload) - payload[0]
    if flags & PRIORITY_FLAG:
        start += 5
    return payload[start:end] if start <= end else None


# ---- one direction ------------------------------------------------------------------


class _Side:
    """What the observer knows about the bytes one endpoint sends."""

    def __init__(self, synced: bool, expect_preface: bool) -> None:
        self.buf = bytearray()
        self.synced = synced
        self.expect_preface = expect_preface and synced
        self.skip = 0  # bytes of a frame whose middle was lost, still to come
        self.skip_stream: int | None = None
        self.hpack: Decoder | None = _decoder() if synced else None
        self.partial = PartialDecoder()
        self.block: bytearray | None = None  # header block awaiting CONTINUATION
        self.block_stream = 0
        self.block_end_stream = False
        self.block_promised: int | None = None
        self.block_too_big = False
        self.block_offset: int | None = None  # where the block's HEADERS frame began
        # stream offset just past the last byte received, once the caller gave one
        self.end: int | None = None
        # the largest frame this side may send: SETTINGS_MAX_FRAME_SIZE of its peer,
        # enforced (a longer frame is a protocol error, never buffered)
        self.max_frame = DEFAULT_MAX_FRAME if synced else UNKNOWN_MAX_FRAME
        self.pending_table_sizes: deque[int | None] = deque()  # our SETTINGS, unacked


def _decoder() -> Decoder:
    d = Decoder()
    d.max_header_list_size = 1 << 24  # an observer enforces nothing
    return d


class H2Observer:
    """Both directions of one HTTP/2 connection, as a third party sees them.

    ``synced``: the observer sees the connection from its first byte (then the
    client's first bytes must be the preface). ``stats`` collects counts (frames,
    header blocks, undecodable header blocks, bytes skipped while resynchronising)."""

    def __init__(self, synced: bool = True, stats: Counter[str] | None = None) -> None:
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.sides = {True: _Side(synced, True), False: _Side(synced, False)}

    @property
    def buffered(self) -> int:
        """Bytes held: unfinished frames and header blocks awaiting CONTINUATION."""
        return sum(len(s.buf) + len(s.block or b"") for s in self.sides.values())

    # ---- input --------------------------------------------------------------------

    def receive(self, data: bytes, ts: int, from_client: bool,
                offset: int | None = None) -> list[Event]:
        """Bytes one endpoint sent (``from_client``), in order, stamped ``ts``.
        ``offset``: where ``data`` begins in that direction's byte stream, if the
        caller knows (then header blocks say where they began: ``Headers.offset``)."""
        side = self.sides[from_client]
        out: list[Event] = []
        if offset is not None:
            side.end = offset + len(data)
        elif side.end is not None:
            side.end += len(data)
        if side.skip:
            n = min(side.skip, len(data))
            side.skip -= n
            data = data[n:]
        side.buf += data
        if side.expect_preface:
            have = bytes(side.buf[: len(PREFACE)])
            if not PREFACE.startswith(have):
                out.append(ProtocolError(ts, from_client, "client did not send the preface"))
                self._unsync(side)
            elif len(have) < len(PREFACE):
                return out
            else:
                del side.buf[: len(PREFACE)]
                side.expect_preface = False
                out.append(Preface(ts))
        self._frames(side, ts, from_client, out)
        return out

    def lost(self, nbytes: int, ts: int, from_client: bool) -> list[Event]:
        """``nbytes`` of this direction were never captured (a capture gap)."""
        side = self.sides[from_client]
        self.stats["http2_bytes_lost"] += nbytes
        if side.end is not None:
            side.end += nbytes
        if side.skip:  # already inside a damaged frame
            if nbytes <= side.skip:
                side.skip -= nbytes
                return [Lost(ts, from_client, nbytes, side.skip_stream)]
            nbytes -= side.skip
            side.skip = 0
        if side.synced and len(side.buf) >= 9:
            length, ftype, _, sid = parse_frame_header(side.buf, 0)
            missing = 9 + length - len(side.buf)
            if nbytes <= missing:  # the hole is inside this frame: the next one is known
                side.skip = missing - nbytes
                side.skip_stream = sid or None
                side.buf.clear()
                if ftype in (HEADERS, CONTINUATION, PUSH_PROMISE):
                    self._table_unknown(side)
                    side.block = None
                return [Lost(ts, from_client, nbytes, sid if ftype == DATA else None)]
        self._unsync(side)
        return [Lost(ts, from_client, nbytes, None)]

    # ---- framing ------------------------------------------------------------------

    def _unsync(self, side: _Side) -> None:
        side.synced = False
        side.expect_preface = False
        side.skip = 0
        side.block = None
        self._table_unknown(side)

    def _table_unknown(self, side: _Side) -> None:
        if side.hpack is not None:
            self.stats["http2_hpack_tables_lost"] += 1
        side.hpack = None
        side.partial.forget()

    def _frames(self, side: _Side, ts: int, fc: bool, out: list[Event]) -> None:
        buf = side.buf
        base = None if side.end is None else side.end - len(buf)  # buf[0]'s offset
        pos = 0
        while True:
            if not side.synced:
                i = find_frame_boundary(buf, pos, side.max_frame)
                if i < 0:
                    keep = max(pos, len(buf) - UNSYNCED_KEEP)
                    self.stats["http2_bytes_skipped"] += keep - pos
                    pos = keep
                    break
                self.stats["http2_bytes_skipped"] += i - pos
                self.stats["http2_resyncs"] += 1
                pos = i
                side.synced = True
            if len(buf) - pos < 9:
                break
            length, ftype, flags, sid = parse_frame_header(buf, pos)
            if length > side.max_frame:
                self.stats["http2_frames_over_max_size"] += 1
                out.append(ProtocolError(ts, fc, f"frame of {length} bytes over the peer's "
                                                 f"maximum of {side.max_frame} (type {ftype}, "
                                                 f"stream {sid})"))
                self._unsync(side)
                pos += 1
                continue
            if ftype in _FRAME_RULES and not plausible_frame_header(buf, pos):
                out.append(ProtocolError(ts, fc, f"implausible frame header (type {ftype}, "
                                                 f"length {length}, stream {sid})"))
                self._unsync(side)
                pos += 1
                continue
            if len(buf) - pos < 9 + length:
                break
            payload = bytes(buf[pos + 9: pos + 9 + length])
            if ftype in (HEADERS, PUSH_PROMISE):
                side.block_offset = None if base is None else base + pos
            pos += 9 + length
            self.stats["http2_frames"] += 1
            self._frame(side, ts, fc, ftype, flags, sid, payload, out)
        del buf[:pos]

    def _frame(self, side: _Side, ts: int, fc: bool, ftype: int, flags: int, sid: int,
               payload: bytes, out: list[Event]) -> None:
        if side.block is not None and not (ftype == CONTINUATION and sid == side.block_stream):
            out.append(ProtocolError(ts, fc, f"header block of stream {side.block_stream} "
                                             "interrupted before END_HEADERS"))
            side.block = None
            self._table_unknown(side)
        if ftype == DATA:
            body = _unpad(payload, flags)
            if body is None:
                out.append(ProtocolError(ts, fc, f"DATA padding longer than the frame "
                                                 f"(stream {sid})"))
                return
            out.append(Data(ts, fc, sid, body, bool(flags & END_STREAM), len(payload)))
        elif ftype in (HEADERS, PUSH_PROMISE):
            block = (_strip_headers_payload(payload, flags) if ftype == HEADERS
                     else _unpad(payload, flags))
            promised = None
            if ftype == PUSH_PROMISE and block is not None:
                if len(block) < 4:
                    block = None
                else:
                    promised = struct.unpack_from(">I", block)[0] & 0x7FFFFFFF
                    block = block[4:]
            if block is None:
                out.append(ProtocolError(ts, fc, f"malformed header frame on stream {sid}"))
                self._table_unknown(side)
                return
            side.block = bytearray(block)
            side.block_stream = sid
            side.block_end_stream = bool(flags & END_STREAM)
            side.block_promised = promised
            side.block_too_big = False
            if flags & END_HEADERS:
                self._end_block(side, ts, fc, out)
        elif ftype == CONTINUATION:
            if side.block is None:
                # its HEADERS was never seen (attach or loss): the fields it adds to the
                # table are unknown
                self.stats["http2_header_blocks_undecodable"] += 1
                self._table_unknown(side)
                return
            if len(side.block) + len(payload) > MAX_HEADER_BLOCK:
                side.block_too_big = True
            else:
                side.block += payload
            if flags & END_HEADERS:
                self._end_block(side, ts, fc, out)
        elif ftype == RST_STREAM:
            out.append(StreamReset(ts, fc, sid, struct.unpack(">I", payload)[0]))
        elif ftype == SETTINGS:
            self._settings(side, ts, fc, flags, payload, out)
        elif ftype == PING:
            out.append(Ping(ts, fc, bool(flags & ACK), payload))
        elif ftype == GOAWAY:
            last, code = struct.unpack_from(">II", payload)
            out.append(GoAway(ts, fc, last & 0x7FFFFFFF, code, payload[8:]))
        elif ftype == WINDOW_UPDATE:
            out.append(WindowUpdate(ts, fc, sid, struct.unpack(">I", payload)[0] & 0x7FFFFFFF))
        # PRIORITY and unknown frame types carry nothing an observer needs

    def _settings(self, side: _Side, ts: int, fc: bool, flags: int, payload: bytes,
                  out: list[Event]) -> None:
        peer = self.sides[not fc]
        if flags & ACK:
            # the sender acknowledges the peer's oldest unacknowledged SETTINGS: from now
            # on the peer's decoder (of what this side sends) allows that table size
            if peer.pending_table_sizes:
                size = peer.pending_table_sizes.popleft()
                if size is not None and side.hpack is not None:
                    side.hpack.max_allowed_table_size = size
            out.append(Settings(ts, fc, True, ()))
            return
        values = tuple(struct.unpack_from(">HI", payload, k) for k in range(0, len(payload), 6))
        size = None
        for ident, value in values:
            if ident == SETTINGS_HEADER_TABLE_SIZE:
                size = value
                # lenient until acknowledged: an observer must not reject what the
                # endpoint accepts
                if peer.hpack is not None:
                    peer.hpack.max_allowed_table_size = max(
                        peer.hpack.max_allowed_table_size, value)
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                peer.max_frame = max(DEFAULT_MAX_FRAME, min(value, MAX_FRAME))
        side.pending_table_sizes.append(size)
        out.append(Settings(ts, fc, False, values))

    def _end_block(self, side: _Side, ts: int, fc: bool, out: list[Event]) -> None:
        block = bytes(side.block or b"")
        side.block = None
        self.stats["http2_header_blocks"] += 1
        fields: list[tuple[bytes, bytes]] = []
        unknown = 0
        if side.block_too_big:
            unknown = 1
            self._table_unknown(side)
        elif side.hpack is not None:
            try:
                fields = [(bytes(n), bytes(v)) for n, v in side.hpack.decode(block, raw=True)]
            except (HPACKError, IndexError, ValueError, TypeError) as e:
                out.append(ProtocolError(ts, fc, f"HPACK: {e}"))
                self._table_unknown(side)
                unknown = 1
        else:
            try:
                fields, unknown = side.partial.decode(block)
            except (HPACKError, IndexError, ValueError) as e:
                out.append(ProtocolError(ts, fc, f"HPACK: {e}"))
                side.partial.forget()
                unknown = max(unknown, 1)
        if unknown:
            self.stats["http2_header_blocks_undecodable"] += 1
            self.stats["http2_header_fields_unknown"] += unknown
        headers = tuple((n.decode("latin-1"), v.decode("utf-8", "replace")) for n, v in fields)
        if side.block_promised is not None:
            out.append(PushPromise(ts, fc, side.block_stream, side.block_promised, headers,
                                   unknown))
        else:
            out.append(Headers(ts, fc, side.block_stream, headers, side.block_end_stream,
                               unknown, side.block_offset))


def _unpad(payload: bytes, flags: int) -> bytes | None:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] > len(payload) - 1:
        return None
    return payload[1: len(payload) - payload[0]]
