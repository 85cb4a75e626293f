"""Line numbers of CPython code objects from their line tables, read out of process.

Two formats (pure functions of bytes, checked against the interpreter's own
``co_positions``/``co_lines`` in tests):

- 3.10 ``co_linetable`` (``Objects/lnotab_notes.txt``): (bytecode delta: unsigned
  byte, line delta: signed byte) pairs, each pair one range of its bytecode delta's
  bytes at the line so far plus its line delta (as ``advance()`` in CPython 3.10's
  ``codeobject.c`` reads them): a line delta of 0 is a range at the same line (a
  one-line body, the 254-byte chunks of a longer range), -128 a range with no line,
  and a pair with a bytecode delta of 0 only moves the line (deltas over 127).
- 3.11+ location table (``Objects/locations.md``): one entry per run of code units,
  first byte ``1cccclll`` (code, length - 1); code 15 no location, 14 the long form
  (signed varint line delta, then end line, column, end column varints), 13 a line
  delta and no column, 10-12 a line delta of code - 10 and two column bytes, 0-9 the
  same line and one column byte. Varints are 6-bit groups, least significant first,
  0x40 meaning more follow; a signed varint keeps its sign in the lowest bit.
"""

from __future__ import annotations

from typing import Iterator


def ranges_310(table: bytes, firstlineno: int) -> Iterator[tuple[int, int, int]]:
    """(start byte, end byte, line) ranges of a 3.10 line table."""
    line, end = firstlineno, 0
    for i in range(0, len(table) - 1, 2):
        sdelta = table[i]
        ldelta = table[i + 1] - 256 if table[i + 1] >= 128 else table[i + 1]
        start, end = end, end + sdelta
        if ldelta == -128:
            continue  # a range with no line (the line so far stays)
        line += ldelta
        if end > start:
            yield start, end, line


def line_310(table: bytes, firstlineno: int, byte_offset: int) -> int | None:
    """The line of the instruction at ``byte_offset`` (3.10: f_lasti x 2)."""
    if byte_offset < 0:
        return firstlineno
    for start, end, line in ranges_310(table, firstlineno):
        if start <= byte_offset < end:
            return line
    return None


def _varint(table: bytes, i: int) -> tuple[int, int]:
    val = shift = 0
    while i < len(table):
        b = table[i]
        i += 1
        val |= (b & 63) << shift
        shift += 6
        if not b & 64:
            break
    return val, i


def _svarint(table: bytes, i: int) -> tuple[int, int]:
    val, i = _varint(table, i)
    return (-(val >> 1) if val & 1 else val >> 1), i


def ranges_311(table: bytes, firstlineno: int) -> Iterator[tuple[int, int, int | None]]:
    """(first code unit, end code unit, line or None) of a 3.11+ location table."""
    line, unit, i = firstlineno, 0, 0
    while i < len(table):
        head = table[i]
        i += 1
        if not head & 0x80:
            return  # not an entry start: the table is damaged (or read wrongly)
        code = (head >> 3) & 15
        n = (head & 7) + 1
        this: int | None
        if code == 15:
            this = None
        elif code == 14:
            delta, i = _svarint(table, i)
            line += delta
            this = line
            for _ in range(3):  # end line, column, end column
                _, i = _varint(table, i)
        elif code == 13:
            delta, i = _svarint(table, i)
            line += delta
            this = line
        elif code >= 10:
            line += code - 10
            this = line
            i += 2
        else:
            this = line
            i += 1
        yield unit, unit + n, this
        unit += n


def line_311(table: bytes, firstlineno: int, unit: int) -> int | None:
    """The line of the instruction at code unit ``unit`` (3.11+)."""
    if unit < 0:
        return firstlineno
    for start, end, line in ranges_311(table, firstlineno):
        if start <= unit < end:
            return line
        if start > unit:
            break
    return None
