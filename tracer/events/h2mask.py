"""Masking credential headers inside HTTP/2 header blocks, before a capture is written.

HTTP/1 credentials are text and are masked where they lie (``capture.SecretMasker``).
In HTTP/2 (and so gRPC) headers travel HPACK-coded in HEADERS, CONTINUATION and
PUSH_PROMISE frames, their values often Huffman-coded. This module follows the frames
of each connection direction, collects every header block whole, walks its fields and
overwrites the value of each credential header in place:

- the same number of bytes, so frame lengths and everything after are unchanged;
- the same decoded length, so a replay's HPACK dynamic table evicts exactly as the
  live one did: a literal value keeps its auth scheme and gets ``mask_token`` (as in
  HTTP/1, so the tenant is the same in a replay); a Huffman value keeps its scheme and
  gets characters picked from the HMAC digest whose codes fill the same bits;
- a field whose name cannot be known (a dynamic-table reference from before the
  tracer attached) has its value masked too: a replay cannot name it either.

A header block split over several reads holds those reads back until the block ends
(bounded by ``MAX_HELD``), so the writer may emit a connection's records a little
later than others'. A block that cannot be finished (the connection closed, bytes
were lost, the bound was hit) has its fragment bytes zeroed: nothing of it is kept.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from hpack.exceptions import HPACKDecodingError
from hpack.hpack import decode_huffman, decode_integer
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.table import HeaderTable

from protocols.http2 import (CONTINUATION, END_HEADERS, HEADERS, PADDED, PREFACE,
                             PRIORITY_FLAG, PUSH_PROMISE, find_frame_boundary,
                             looks_like_frames, parse_frame_header)
from tracer.privacy import mask_token, token_span

SECRET_NAMES = frozenset((b"authorization", b"proxy-authorization", b"api-key", b"x-api-key",
                          b"cookie", b"set-cookie"))
MAX_HELD = 1 << 20  # bytes of records held for one unfinished header block
MAX_NAMES = 4096  # newest dynamic-table names kept per direction
_STATIC = HeaderTable.STATIC_TABLE
_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
# printable characters by the length of their Huffman code, to fill a bit budget
_BY_BITS: dict[int, bytes] = {}
for _c in range(0x21, 0x7F):
    _BY_BITS[REQUEST_CODES_LENGTH[_c]] = _BY_BITS.get(REQUEST_CODES_LENGTH[_c], b"") + bytes([_c])
_WIDTHS = sorted(_BY_BITS)

Piece = tuple[bytearray, int, int]  # (record, offset, length)


@dataclass
class _Direction:
    """The frames one endpoint of one connection sends, as far as they have been read."""

    preface_left: int = 0  # client preface bytes still to skip
    header: bytearray = field(default_factory=bytearray)  # a frame header cut by a read
    skip: int = 0  # payload bytes of a frame that holds no header block
    collect: int = 0  # payload bytes of a header-carrying frame still to collect
    ftype: int = 0
    flags: int = 0
    frame: list[Piece] = field(default_factory=list)  # the current frame's payload
    block: list[Piece] = field(default_factory=list)  # the open header block's fragments
    held: list[bytearray] = field(default_factory=list)  # records held for the block
    held_bytes: int = 0
    synced: bool = True
    names: deque[bytes | None] = field(default_factory=lambda: deque(maxlen=MAX_NAMES))


class H2SecretMasker:
    """Masks credential values in HTTP/2 header blocks; one per capture file.

    ``feed(key, record, start, end)`` takes one DATA record (a ``bytearray`` whose
    payload is ``record[start:end]``, masked in place) and returns the records now
    ready to write, in order: usually just that one; none while a header block is
    open; several when one ends."""

    def __init__(self, salt: bytes, max_directions: int = 65536) -> None:
        self.salt = salt
        self.max_directions = max_directions
        # key -> state, or None: a direction seen not to be HTTP/2
        self._dirs: OrderedDict[tuple[int, ...], _Direction | None] = OrderedDict()
        self.masked = 0  # values masked
        self.blocks_cut = 0  # header blocks zeroed (unfinished, or lost bytes)

    def is_http2(self, key: tuple[int, ...], payload: bytes, other: tuple[int, ...]) -> bool:
        """Whether to follow ``key`` (decided on its first record)."""
        if key in self._dirs:
            return self._dirs[key] is not None
        preface = len(payload) > 0 and PREFACE.startswith(bytes(payload[:len(PREFACE)]))
        h2 = preface or self._dirs.get(other) is not None \
            or looks_like_frames(bytes(payload[:1 << 16]))
        d = _Direction(preface_left=len(PREFACE) if preface else 0) if h2 else None
        self._dirs[key] = d
        if len(self._dirs) > self.max_directions:
            _, old = self._dirs.popitem(last=False)
            if old is not None and old.held:
                self._cut(old)
        return h2

    def feed(self, key: tuple[int, ...], record: bytearray, start: int, end: int,
             complete: bool = True) -> list[bytearray]:
        """Mask ``record[start:end]`` (the next bytes of direction ``key``;
        ``complete`` False when bytes were lost before them) and return the records
        that may be written now."""
        d = self._dirs.get(key)
        if d is None:
            return [record]
        self._dirs.move_to_end(key)
        if not complete:
            out = self._cut(d)
            d.synced, d.header, d.skip, d.collect, d.preface_left = False, bytearray(), 0, 0, 0
            d.names.clear()
            return out + self._walk(d, record, start, end)
        return self._walk(d, record, start, end)

    def close(self, key: tuple[int, ...]) -> list[bytearray]:
        """The connection direction ended: what it still holds, its open block cut."""
        d = self._dirs.pop(key, None)
        return self._cut(d) if d is not None else []

    def flush(self) -> list[bytearray]:
        """Everything still held (the capture is closing)."""
        out: list[bytearray] = []
        for key in list(self._dirs):
            out += self.close(key)
        return out

    # ---- frames ------------------------------------------------------------------

    def _walk(self, d: _Direction, p: bytearray, i: int, n: int) -> list[bytearray]:
        if not d.synced:
            at = find_frame_boundary(bytes(p[i:n]))
            if at < 0:
                return self._release(d, p)
            d.synced, i = True, i + at
        while i < n:
            if d.preface_left:
                k = min(d.preface_left, n - i)
                d.preface_left -= k
                i += k
            elif d.skip:
                k = min(d.skip, n - i)
                d.skip -= k
                i += k
            elif d.collect:
                k = min(d.collect, n - i)
                d.frame.append((p, i, k))
                d.collect -= k
                i += k
                if not d.collect:
                    self._frame_done(d)
            else:
                k = min(9 - len(d.header), n - i)
                d.header += p[i:i + k]
                i += k
                if len(d.header) == 9:
                    length, ftype, flags, _ = parse_frame_header(d.header)
                    d.header = bytearray()
                    if ftype in (HEADERS, CONTINUATION, PUSH_PROMISE):
                        d.ftype, d.flags, d.collect, d.frame = ftype, flags, length, []
                        if not length:
                            self._frame_done(d)
                    else:
                        d.skip = length
        return self._release(d, p)

    def _release(self, d: _Direction, p: bytearray) -> list[bytearray]:
        """``p`` and what was held, unless a header block (or a frame of one) is open."""
        open_block = bool(d.block or d.frame or d.collect or d.header)
        if open_block:
            d.held.append(p)
            d.held_bytes += len(p)
            if d.held_bytes <= MAX_HELD:
                return []
            out = self._cut(d)
            d.synced, d.header, d.skip, d.collect = False, bytearray(), 0, 0
            d.names.clear()
            return out
        out, d.held, d.held_bytes = d.held + [p], [], 0
        return out

    def _cut(self, d: _Direction) -> list[bytearray]:
        """Zero an unfinished header block's bytes and let its records go."""
        if d.block or d.frame:
            for buf, off, k in d.block + d.frame:
                buf[off:off + k] = bytes(k)
            self.blocks_cut += 1
        d.block, d.frame = [], []
        out, d.held, d.held_bytes = d.held, [], 0
        return out

    def _frame_done(self, d: _Direction) -> None:
        """A header-carrying frame is whole: add its fragment to the block."""
        pieces, d.frame = d.frame, []
        total = sum(k for _, _, k in pieces)
        start, end = 0, total
        if d.ftype != CONTINUATION:
            if d.flags & PADDED:
                start, end = 1, total - (_byte(pieces, 0) if total else 0)
            if d.ftype == HEADERS and d.flags & PRIORITY_FLAG:
                start += 5
            if d.ftype == PUSH_PROMISE:
                start += 4
        if start > end:  # malformed: a replay refuses it too; keep nothing of it
            for buf, off, k in pieces:
                buf[off:off + k] = bytes(k)
            self.blocks_cut += 1
            d.block = []
            return
        d.block += _slice(pieces, start, end)
        if d.flags & END_HEADERS:
            block, d.block = d.block, []
            self._mask_block(d, block)

    # ---- HPACK fields ------------------------------------------------------------

    def _mask_block(self, d: _Direction, pieces: list[Piece]) -> None:
        data = bytearray().join(buf[off:off + k] for buf, off, k in pieces)
        spans: list[tuple[int, int, bool, bytes]] = []  # (start, end, huffman, decoded)
        pos = 0
        try:
            while pos < len(data):
                b = data[pos]
                if b & 0x80:  # indexed field: no string
                    _, k = decode_integer(data[pos:], 7)
                    pos += k
                    continue
                if b & 0xE0 == 0x20:  # dynamic table size update
                    _, k = decode_integer(data[pos:], 5)
                    pos += k
                    continue
                indexing = bool(b & 0x40)
                index, k = decode_integer(data[pos:], 6 if indexing else 4)
                pos += k
                if index:
                    name = self._name(d, index)
                else:
                    raw, huff, pos, _ = _string(data, pos)
                    name = decode_huffman(raw) if huff else raw
                raw, huff, pos, sstart = _string(data, pos)
                if name is None or name.lower() in SECRET_NAMES:
                    spans.append((sstart, pos, huff, decode_huffman(raw) if huff else raw))
                if indexing:
                    d.names.appendleft(name)
        except (HPACKDecodingError, IndexError):
            # a block a decoder refuses: keep none of its strings
            for buf, off, k in pieces:
                buf[off:off + k] = bytes(k)
            self.blocks_cut += 1
            d.names.clear()
            return
        for start, end, huff, value in spans:
            new = self._masked(value, end - start, huff)
            for (buf, off, k), (s, e) in zip(*_where(pieces, start, end)):
                buf[off:off + k] = new[s:e]
            self.masked += 1

    def _name(self, d: _Direction, index: int) -> bytes | None:
        if index <= len(_STATIC):
            return _STATIC[index - 1][0]
        k = index - len(_STATIC) - 1
        return d.names[k] if k < len(d.names) else None

    def _masked(self, value: bytes, nbytes: int, huffman: bool) -> bytes:
        """``nbytes`` coded bytes that decode to as many characters as ``value``: the
        auth scheme kept, the key masked."""
        a, b = token_span(value)
        if not huffman:
            return value[:a] + mask_token(value[a:b], self.salt) + value[b:]
        tail = value[b:]
        fixed = sum(REQUEST_CODES_LENGTH[c] for c in value[:a] + tail)
        chars = _fill(8 * nbytes - fixed, b - a,
                      hmac.new(self.salt, value[a:b], hashlib.sha256).digest())
        out = _HUFFMAN.encode(value[:a] + chars + tail) if chars is not None else b""
        if len(out) != nbytes:
            # a key of characters with codes longer than any printable one: no fill
            # of the same length exists; zeros keep nothing (a replay counts the
            # string as undecodable)
            out = bytes(nbytes)
        return out


def _fill(bits: int, count: int, digest: bytes) -> bytes | None:
    """``count`` printable characters whose Huffman codes take ``bits - 7`` to ``bits``
    bits (the rest is padding), each picked among its width's characters by
    ``digest``; None if no such characters exist."""
    lo, hi = _WIDTHS[0], _WIDTHS[-1]
    if not count * lo <= bits <= count * hi + 7:
        return None
    out = bytearray()
    left = bits
    for i in range(count):
        rest = count - i - 1
        # the widest code that leaves the others at least the narrowest each
        w = max(x for x in _WIDTHS if x <= max(lo, left - rest * lo))
        pool = _BY_BITS[w]
        out.append(pool[digest[i % len(digest)] % len(pool)])
        left -= w
    return bytes(out) if 0 <= left <= 7 else None


def _string(data: bytearray, pos: int) -> tuple[bytes, bool, int, int]:
    """An HPACK string at ``pos``: (its coded bytes, Huffman?, the end, where the
    bytes start)."""
    if pos >= len(data):
        raise HPACKDecodingError("HPACK string past the end of the block")
    huff = bool(data[pos] & 0x80)
    length, k = decode_integer(data[pos:], 7)
    start = pos + k
    if start + length > len(data):
        raise HPACKDecodingError("HPACK string longer than the block")
    return bytes(data[start:start + length]), huff, start + length, start


def _byte(pieces: list[Piece], at: int) -> int:
    for buf, off, k in pieces:
        if at < k:
            return buf[off + at]
        at -= k
    raise IndexError(at)


def _slice(pieces: list[Piece], start: int, end: int) -> list[Piece]:
    """The pieces covering bytes ``start:end`` of their concatenation."""
    out, pos = [], 0
    for buf, off, k in pieces:
        a, b = max(start, pos), min(end, pos + k)
        if a < b:
            out.append((buf, off + a - pos, b - a))
        pos += k
    return out


def _where(pieces: list[Piece], start: int, end: int
           ) -> tuple[list[Piece], list[tuple[int, int]]]:
    """The pieces covering ``start:end``, and each one's range within that span."""
    got = _slice(pieces, start, end)
    ranges, s = [], 0
    for _, _, k in got:
        ranges.append((s, s + k))
        s += k
    return got, ranges
