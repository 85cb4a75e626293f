"""Typed events: the only thing that crosses from capture to analysis.

Two sources produce them: BPF records decoded from the ring buffer (``ConnEvent``,
``DataEvent``, ``ProcEvent``, and the GPU records in ``tracer.events.gpu``), and the
user-space side of capture, which reads what BPF cannot see cheaply from /proc
(``ProcessInfo``, ``SocketInfo``) and reports loss (``DropReport``). All are immutable:
frozen dataclasses with slots, and ``DataEvent`` (the most frequent) a named tuple. Timestamps are CLOCK_MONOTONIC nanoseconds; the capture's
``ClockSync`` maps them to wall-clock time.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from tracer.events import wire
from tracer.events.wire import WireError  # noqa: F401  (re-exported: callers catch schema.WireError)

SCHEMA_VERSION = 1
_DIR_IN = wire.CONSTANTS["DIR_IN"]
_FLAG_LAST = wire.CONSTANTS["FLAG_LAST"]
_FLAG_TRUNCATED = wire.CONSTANTS["FLAG_TRUNCATED"]
_FLAG_EOF = wire.CONSTANTS["FLAG_EOF"]
_FLAG_ERROR = wire.CONSTANTS["FLAG_ERROR"]


def _addr_text(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    if family == socket.AF_INET6:
        addr = ipaddress.IPv6Address(raw[:16])
        return str(addr.ipv4_mapped or addr)
    return ""


@dataclass(frozen=True, slots=True)
class ConnEvent:
    """A socket of a traced process was accepted, connected or closed."""

    pid: int
    tid: int
    fd: int
    ts: int
    conn_id: int
    op: int  # wire.CONSTANTS["CONN_*"]
    role: int  # ROLE_SERVER for accepted sockets, ROLE_CLIENT for connected ones
    ret: int
    listen_fd: int
    family: int
    peer_addr: str
    peer_port: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.fd, self.conn_id)


class DataEvent(NamedTuple):
    """One chunk of bytes that a traced process read from or wrote to a socket.

    ``ret`` is the syscall's whole return value; a syscall that moved more than one
    chunk yields several events with increasing ``offset``. ``truncated`` means bytes
    past the capture limit were moved but not captured (``ret`` still counts them).
    ``eof`` marks a read that returned 0; ``error`` a read/write that failed (-errno
    in ``ret``).

    A named tuple rather than a frozen dataclass: one is decoded per socket syscall,
    the agent's most frequent record, and a tuple is built five times faster (immutable
    all the same).
    """

    pid: int
    tid: int
    fd: int
    conn_id: int
    ts_enter: int
    ts_exit: int
    ret: int
    offset: int
    syscall: int
    direction: int
    flags: int
    payload: bytes
    stream_off: int = 0  # bytes this direction moved before this syscall

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.fd, self.conn_id)

    @property
    def ts(self) -> int:
        """When the bytes were in hand: the syscall's exit."""
        return self.ts_exit

    @property
    def position(self) -> int:
        """Offset of this chunk's first byte in its direction of the connection."""
        return self.stream_off + self.offset

    @property
    def inbound(self) -> bool:
        return self.direction == _DIR_IN

    @property
    def last(self) -> bool:
        return bool(self.flags & _FLAG_LAST)

    @property
    def truncated(self) -> bool:
        return bool(self.flags & _FLAG_TRUNCATED)

    @property
    def eof(self) -> bool:
        return bool(self.flags & _FLAG_EOF)

    @property
    def error(self) -> bool:
        return bool(self.flags & _FLAG_ERROR)

    @property
    def tls_plain(self) -> bool:
        """Plaintext from the TLS probes (SSL_read/SSL_write), not a syscall's bytes."""
        return bool(self.flags & wire.CONSTANTS["FLAG_TLS"])

    @property
    def cipher(self) -> bool:
        """A ciphertext syscall of a socket whose plaintext the TLS probes follow: sent
        without payload (``ret`` and ``stream_off`` are kept)."""
        return bool(self.flags & wire.CONSTANTS["FLAG_CIPHER"])


@dataclass(frozen=True, slots=True)
class ProcEvent:
    """A traced process forked a child, exec'd a new program, or exited."""

    pid: int
    tid: int
    ppid: int
    ts: int
    op: int  # wire.CONSTANTS["PROC_*"]
    exit_code: int
    comm: str


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """What /proc says of a traced process, read when it is first seen."""

    pid: int
    ts: int
    comm: str
    exe: str
    cmdline: tuple[str, ...]
    ppid: int = 0
    container_id: str = ""
    maps: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SocketInfo:
    """Addresses of a connection as /proc knows them (local side, and peer when the
    syscall did not carry it). ``existing`` marks a socket found open at attach."""

    pid: int
    fd: int
    conn_id: int
    ts: int
    family: int
    local_addr: str
    local_port: int
    peer_addr: str
    peer_port: int
    existing: bool = False
    role: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.fd, self.conn_id)


@dataclass(frozen=True, slots=True)
class DropReport:
    """Cumulative loss counters at ``ts``: kernel-side (ring buffer full, truncation)
    and user-side (parse failures). Names are ``wire.COUNTER_NAMES`` values."""

    ts: int
    counters: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClockSync:
    """Maps monotonic ns to wall-clock ns: wall = mono + offset_ns."""

    mono_ns: int
    wall_ns: int

    @property
    def offset_ns(self) -> int:
        return self.wall_ns - self.mono_ns


@dataclass(frozen=True, slots=True)
class TracingPaused:
    """The agent took its probes out (``paused``) or put them back at ``ts``
    (``tokentrace run``: SIGUSR1/SIGUSR2 or ``--control``). Nothing is captured in
    between: requests open at a pause end there, incomplete; sockets are adopted
    afresh at the resume, as at attach. ``switch_s``: how long taking the probes out
    (or putting them back) took. ``duty``: the ``run --duty-cycle`` fraction in force
    from this switch on (tracer/duty.py), 0 for none; a pause with it is the cycle's,
    not one by hand: the requests it cuts are counted apart."""

    ts: int
    paused: bool
    switch_s: float = 0.0
    duty: float = 0.0


Event = (ConnEvent | DataEvent | ProcEvent | ProcessInfo | SocketInfo | DropReport | ClockSync
         | TracingPaused)

# user-space event classes by name, for the capture file's JSON records
USER_EVENTS: dict[str, type] = {
    cls.__name__: cls for cls in (ProcessInfo, SocketInfo, DropReport, ClockSync, TracingPaused)
}


def _decode_conn(buf: bytes) -> ConnEvent:
    f = wire.CONN.unpack(buf)
    return ConnEvent(
        pid=f["pid"], tid=f["tid"], fd=f["fd"], ts=f["ts"], conn_id=f["conn_id"],
        op=f["op"], role=f["role"], ret=f["ret"], listen_fd=f["listen_fd"],
        family=f["family"], peer_addr=_addr_text(f["family"], f["addr"]),
        peer_port=f["port"],
    )


_new_tuple = tuple.__new__  # DataEvent's own __new__ without its keyword handling
_UNPACK_DATA = wire.DATA.header.unpack_from
_DATA_HDR = wire.DATA.header_size
assert wire.DATA.names == ["kind", "pid", "tid", "fd", "conn_id", "ts_enter", "ts_exit", "ret",
                           "offset", "len", "syscall", "direction", "flags", "pad",
                           "stream_off"], "_decode_data reads DATA's fields by position"


def _decode_data(buf: bytes) -> DataEvent:
    # once per socket syscall: one unpack into a tuple, fields by position
    (_, pid, tid, fd, conn_id, ts_enter, ts_exit, ret, offset, n, syscall, direction, flags,
     _, stream_off) = _UNPACK_DATA(buf, 0)
    if len(buf) < _DATA_HDR + n:
        raise WireError(f"data record carries {len(buf) - _DATA_HDR} payload bytes, says {n}")
    payload = buf[_DATA_HDR:_DATA_HDR + n]
    if type(payload) is not bytes:
        payload = bytes(payload)
    return _new_tuple(DataEvent, (pid, tid, fd, conn_id, ts_enter, ts_exit, ret, offset, syscall,
                                  direction, flags, payload, stream_off))


def _decode_proc(buf: bytes) -> ProcEvent:
    f = wire.PROC.unpack(buf)
    return ProcEvent(
        pid=f["pid"], tid=f["tid"], ppid=f["ppid"], ts=f["ts"], op=f["op"],
        exit_code=f["exit_code"], comm=f["comm"].split(b"\0", 1)[0].decode("utf-8", "replace"),
    )


DECODERS = {
    wire.CONSTANTS["KIND_CONN"]: _decode_conn,
    wire.CONSTANTS["KIND_DATA"]: _decode_data,
    wire.CONSTANTS["KIND_PROC"]: _decode_proc,
}


def register_decoder(kind: int, fn) -> None:  # type: ignore[no-untyped-def]
    """Let another concern (GPU probes) decode its own record kinds."""
    DECODERS[kind] = fn


_KIND_DATA = wire.CONSTANTS["KIND_DATA"]
_UNPACK_KIND = struct.Struct("<I").unpack_from


def decode(buf: bytes):  # type: ignore[no-untyped-def]
    """Decode one ring-buffer record into its typed event."""
    if len(buf) < 4:
        raise WireError(f"record of {len(buf)} bytes is shorter than its kind field")
    kind = _UNPACK_KIND(buf, 0)[0]
    if kind == _KIND_DATA and len(buf) >= _DATA_HDR:  # most records
        return _decode_data(buf)
    fn = DECODERS.get(kind)
    if fn is None:
        raise WireError(f"unknown record kind {kind}")
    rec = wire.RECORDS[kind]
    if len(buf) < rec.header_size:
        raise WireError(f"{rec.cname} record of {len(buf)} bytes, header needs {rec.header_size}")
    return fn(buf)


# GPU records decode through the same entry point.
from tracer.events import gpu as _gpu  # noqa: E402  (needs the names above)

DECODERS.update(_gpu.DECODERS)
USER_EVENTS[_gpu.GpuSampling.__name__] = _gpu.GpuSampling
# a host stub symbolised in user space (tracer/probes/symbols.py) names its kernel
USER_EVENTS[_gpu.KernelName.__name__] = _gpu.KernelName

# The kernel's hold on a request's bytes (bpf/netwait.c), and the capture's timing mode.
from tracer.events import netwait as _netwait  # noqa: E402

DECODERS.update(_netwait.DECODERS)
USER_EVENTS[_netwait.NetTimingMode.__name__] = _netwait.NetTimingMode

# The TLS probes' records (bpf/tls.c) and the libraries the capture found (user space).
from tracer.events import tls as _tls  # noqa: E402

DECODERS.update(_tls.DECODERS)
USER_EVENTS[_tls.TlsLibrary.__name__] = _tls.TlsLibrary
# Launch-site stacks (bpf/stacks.c): counts per burst, and stacks resolved in user space.
from tracer.events import stacks as _stacks  # noqa: E402

DECODERS.update(_stacks.DECODERS)
USER_EVENTS[_stacks.StackFrames.__name__] = _stacks.StackFrames
USER_EVENTS[_stacks.StackSampling.__name__] = _stacks.StackSampling
# A streamed response's token writes staged in the kernel (bpf/sockets.c), and the
# templates the agent armed them with.
from tracer.events import runs as _runs  # noqa: E402

DECODERS.update(_runs.DECODERS)
USER_EVENTS[_runs.RunArmed.__name__] = _runs.RunArmed
