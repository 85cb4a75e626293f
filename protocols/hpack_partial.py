"""HPACK without the whole dynamic table: what an observer that attached late can read.

An HPACK dynamic table is built by every header block since the connection began. A
tracer that attaches mid-connection (or lost a header block) does not know it, so the
``hpack`` library, which needs the exact table, cannot decode later blocks. This
decoder reads them anyway, field by field:

- static-table references and literal values decode as usual;
- a reference into the dynamic table decodes only if the entry was inserted since
  the decoder started (entry ``62 + k`` is always the k-th most recent insertion:
  eviction removes the oldest entries and never moves the newer ones, and an encoder
  never references an evicted entry, so the table's unknown size cannot mislead us);
- every other field is counted as unknown, never guessed.

It reuses ``hpack``'s integer and Huffman decoders and its static table.
"""

from __future__ import annotations

from collections import deque

from hpack.exceptions import HPACKDecodingError
from hpack.hpack import decode_huffman, decode_integer
from hpack.table import HeaderTable

STATIC = HeaderTable.STATIC_TABLE
MAX_REMEMBERED = 4096  # newest insertions kept (a 4 KiB table holds at most 128)

Field = tuple[bytes, bytes]


class PartialDecoder:
    """Decodes header blocks with a dynamic table known only from its newest entries."""

    def __init__(self) -> None:
        # newest first; None: an entry whose content is unknown (its name was a
        # reference we could not resolve)
        self.recent: deque[Field | None] = deque(maxlen=MAX_REMEMBERED)

    def _lookup(self, index: int) -> Field | None:
        if index <= 0:
            raise HPACKDecodingError("HPACK index 0")
        if index <= len(STATIC):
            return STATIC[index - 1]
        k = index - len(STATIC) - 1
        return self.recent[k] if k < len(self.recent) else None

    def _string(self, data: memoryview, pos: int) -> tuple[bytes, int]:
        if pos >= len(data):
            raise HPACKDecodingError("HPACK string past the end of the block")
        huff = data[pos] & 0x80
        length, n = decode_integer(data[pos:], 7)
        pos += n
        if pos + length > len(data):
            raise HPACKDecodingError("HPACK string longer than the block")
        raw = bytes(data[pos:pos + length])
        return (decode_huffman(raw) if huff else raw), pos + length

    def decode(self, block: bytes) -> tuple[list[Field], int]:
        """The fields that could be decoded, and how many could not. Raises
        ``HPACKDecodingError`` if the block is malformed (then the table is unknown)."""
        data = memoryview(block)
        fields: list[Field] = []
        unknown = 0
        pos = 0
        while pos < len(data):
            b = data[pos]
            if b & 0x80:  # indexed field
                index, n = decode_integer(data[pos:], 7)
                pos += n
                f = self._lookup(index)
                if f is None:
                    unknown += 1
                else:
                    fields.append(f)
                continue
            if b & 0xE0 == 0x20:  # dynamic table size update
                size, n = decode_integer(data[pos:], 5)
                pos += n
                if size == 0:
                    self.recent.clear()  # the table is now empty: and known
                continue
            incremental = bool(b & 0x40)
            index, n = decode_integer(data[pos:], 6 if incremental else 4)
            pos += n
            name: bytes | None
            if index == 0:
                name, pos = self._string(data, pos)
            else:
                entry = self._lookup(index)
                name = entry[0] if entry else None
            value, pos = self._string(data, pos)
            if name is None:
                unknown += 1
            else:
                fields.append((name, value))
            if incremental:
                self.recent.appendleft((name, value) if name is not None else None)
        return fields, unknown

    def forget(self) -> None:
        """A header block was missed: nothing inserted so far can be trusted to be at
        the index we think (the missed block inserted an unknown number of entries)."""
        self.recent.clear()
