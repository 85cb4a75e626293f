"""Typed events of a streamed response's token writes staged in the kernel
(bpf/sockets.c, "runs").

Once the agent has read a streamed response's token chunks, it arms the connection
with their template: the bytes around the JSON string that carries each token's text
(``RunArmed``, written to the capture when the kernel map is written). The kernel then
sends the connection's writes that are exactly such a chunk as ``TokenRun`` records,
up to ``RUN_MAX`` writes each: when each write returned and how long it was, never its
text. With the template the agent knows everything else a write said: its chunk's size
line, its SSE event, and whether its string was empty (not a token).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import NamedTuple

from tracer.events import wire

C = wire.CONSTANTS
RUN_MAX = C["RUN_MAX"]
_HEADER = struct.Struct("<IIIiQQII")  # kind .. n, as wire.RUN lays them out
_TS = struct.Struct(f"<{RUN_MAX}Q")
_LENS = struct.Struct(f"<{RUN_MAX}H")
_TS_AT = wire.RUN.offsets["ts"]
_LENS_AT = wire.RUN.offsets["len"]
assert _HEADER.size == _TS_AT, "RUN's header layout changed: update _HEADER"


class TokenRun(NamedTuple):
    """Writes ``lens[i]`` bytes long that returned at ``ts[i]``, one after the other on
    connection ``key`` from byte ``stream_off`` of its output, each one chunk of the
    template armed as ``arm`` (``RunArmed``)."""

    pid: int
    tid: int
    fd: int
    conn_id: int
    stream_off: int
    arm: int
    ts: tuple[int, ...]
    lens: tuple[int, ...]

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.fd, self.conn_id)


@dataclass(frozen=True, slots=True)
class RunArmed:
    """At ``ts`` the kernel was told the token chunks of connection (pid, fd, conn_id):
    ``head`` + a JSON string + ``tail`` (the SSE event's bytes, UTF-8; the chunk's size
    line and CRLF around them). ``arm`` numbers the template in ``TokenRun.arm``."""

    ts: int
    pid: int
    fd: int
    conn_id: int
    arm: int
    head: str
    tail: str

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.fd, self.conn_id)


def unpack(buf: bytes) -> tuple[int, int, int, int, int, int, tuple[int, ...], tuple[int, ...]]:
    """A RUN record's fields (pid, tid, fd, conn_id, stream_off, arm, ts, lens), its
    arrays cut to its ``n`` writes. Raises ``ValueError`` on a malformed record."""
    if len(buf) < wire.RUN.header_size:
        raise ValueError(f"RUN record of {len(buf)} bytes, needs {wire.RUN.header_size}")
    _, pid, tid, fd, conn_id, stream_off, arm, n = _HEADER.unpack_from(buf, 0)
    if not 1 <= n <= RUN_MAX:
        raise ValueError(f"RUN record of {n} writes (1..{RUN_MAX})")
    lens = _LENS.unpack_from(buf, _LENS_AT)[:n]
    if 0 in lens:
        raise ValueError("RUN record with an empty write")
    return pid, tid, fd, conn_id, stream_off, arm, _TS.unpack_from(buf, _TS_AT)[:n], lens


def _decode(buf: bytes) -> TokenRun:
    try:
        return TokenRun(*unpack(buf))
    except ValueError as e:
        raise wire.WireError(str(e)) from None


def pack(pid: int, tid: int, fd: int, conn_id: int, stream_off: int, arm: int,
         ts: list[int], lens: list[int]) -> bytes:
    """The RUN record the kernel would send for these writes (captures made by tools)."""
    n = len(ts)
    assert 1 <= n <= RUN_MAX and len(lens) == n
    return (_HEADER.pack(C["KIND_RUN"], pid, tid, fd, conn_id, stream_off, arm, n)
            + _TS.pack(*ts, *[0] * (RUN_MAX - n)) + _LENS.pack(*lens, *[0] * (RUN_MAX - n))
            + b"\0" * (wire.RUN.size - wire.RUN.header_size))


@functools.lru_cache(maxsize=4096)  # per token write; a stream's lengths repeat
def chunk_size(length: int) -> int:
    """The data size of a chunk whose whole framing (hex size line, data, CRLF) is
    ``length`` bytes; 0 if none is."""
    for digits in (1, 2, 3, 4):
        size = length - digits - 4
        if size > 0 and len(f"{size:x}") == digits:
            return size
    return 0


def chunk(head: bytes, tail: bytes, length: int) -> bytes | None:
    """A write of ``length`` bytes of this template, as it was but for its text: the
    size line, ``head``, a JSON string of the same length (``"`` + ``x``... + ``"``),
    ``tail``, CRLF. None if no chunk of the template is that long."""
    size = chunk_size(length)
    text = size - len(head) - len(tail)
    if text < 2:
        return None
    return (f"{size:x}\r\n".encode() + head + b'"' + b"x" * (text - 2) + b'"' + tail
            + b"\r\n")


DECODERS = {C["KIND_RUN"]: _decode}
