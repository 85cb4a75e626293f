"""The one definition of every record that crosses the BPF ring buffer.

Each record is declared here once, as a list of typed fields. From that list this
module generates (a) the C struct and ``#define`` text that is prepended to every BPF
program, with ``_Static_assert`` lines so the compiler proves the layout matches, and
(b) the ``struct.Struct`` that Python uses to decode the bytes. A record may end in a
variable-length byte tail (the payload); only ``tail_len`` of it is sent.

Bump ``WIRE_VERSION`` whenever a layout changes: captures carry it, and replay refuses
captures whose version it does not know.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

WIRE_VERSION = 1

# Sizes of the C scalar types used on the wire (x86-64 and arm64 alike).
_SCALARS: dict[str, tuple[str, int]] = {
    "u8": ("B", 1),
    "u16": ("H", 2),
    "u32": ("I", 4),
    "u64": ("Q", 8),
    "s32": ("i", 4),
    "s64": ("q", 8),
}

# Constants shared by C and Python. Names are emitted as ``#define TT_<NAME>``.
CONSTANTS: dict[str, int] = {
    # record kinds (first u32 of every record)
    "KIND_CONN": 1,
    "KIND_DATA": 2,
    "KIND_PROC": 3,
    "KIND_KBURST": 4,
    "KIND_KNAME": 5,
    "KIND_NCCL": 6,
    "KIND_VERBS": 7,
    "KIND_MEM": 8,
    "KIND_SYNC": 9,
    # payload chunking: bytes per DATA record and the loop bound per syscall
    "CHUNK": 16384,
    "MAX_ITER": 64,
    "MAX_IOV": 32,
    # DATA.direction
    "DIR_IN": 1,
    "DIR_OUT": 2,
    # DATA.flags
    "FLAG_LAST": 1,
    "FLAG_TRUNCATED": 2,
    "FLAG_EOF": 4,
    "FLAG_ERROR": 8,
    # CONN.op
    "CONN_ACCEPT": 1,
    "CONN_CONNECT": 2,
    "CONN_CLOSE": 3,
    "CONN_PEER": 4,  # addresses seen in the kernel at a socket's first read; ret = local port
    # conn roles (kernel map and CONN.role)
    "ROLE_UNKNOWN": 0,
    "ROLE_SERVER": 1,
    "ROLE_CLIENT": 2,
    # PROC.op
    "PROC_FORK": 1,
    "PROC_EXEC": 2,
    "PROC_EXIT": 3,
    # syscalls as recorded in DATA.syscall (not kernel numbers: stable across arches)
    "SYS_READ": 1,
    "SYS_WRITE": 2,
    "SYS_READV": 3,
    "SYS_WRITEV": 4,
    "SYS_RECVFROM": 5,
    "SYS_SENDTO": 6,
    "SYS_RECVMSG": 7,
    "SYS_SENDMSG": 8,
    # drop/loss counters (index into the per-CPU `counters` array)
    "CNT_LOST_CONN": 0,
    "CNT_LOST_DATA": 1,
    "CNT_LOST_PROC": 2,
    "CNT_TRUNCATED": 3,
    "CNT_IOV_CUT": 4,
    "CNT_INFLIGHT_FULL": 5,
    "CNT_CONNS_FULL": 6,
    "CNT_LOST_GPU": 7,
    "CNT_BURSTS_FULL": 8,
    "CNT_NAMES_FULL": 9,
    "N_COUNTERS": 16,
}

COUNTER_NAMES: dict[int, str] = {
    v: k[4:].lower() for k, v in CONSTANTS.items() if k.startswith("CNT_")
}

SYSCALL_NAMES: dict[int, str] = {
    v: k[4:].lower() for k, v in CONSTANTS.items() if k.startswith("SYS_")
}


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str  # one of _SCALARS, or "u8[N]"/"char[N]" for fixed arrays
    doc: str = ""

    @property
    def array_len(self) -> int | None:
        if "[" not in self.ctype:
            return None
        n = self.ctype[self.ctype.index("[") + 1 : -1]
        return CONSTANTS[n] if n in CONSTANTS else int(n)

    @property
    def base(self) -> str:
        return self.ctype.split("[", 1)[0]

    @property
    def size(self) -> int:
        n = self.array_len
        if n is None:
            return _SCALARS[self.ctype][1]
        return n  # arrays are byte arrays

    @property
    def align(self) -> int:
        return 1 if self.array_len is not None else _SCALARS[self.ctype][1]


class Record:
    """A wire record: C struct text plus a Python decoder for its fixed header."""

    def __init__(self, cname: str, kind: str, fields: list[Field], tail: Field | None = None):
        self.cname = cname
        self.kind = CONSTANTS[kind]
        self.fields = fields
        self.tail = tail
        self.offsets: dict[str, int] = {}
        fmt = "<"
        off = 0
        max_align = 1
        for f in fields:
            pad = (-off) % f.align
            if pad:
                fmt += f"{pad}x"
                off += pad
            self.offsets[f.name] = off
            fmt += f"{f.size}s" if f.array_len is not None else _SCALARS[f.ctype][0]
            off += f.size
            max_align = max(max_align, f.align)
        if tail is not None:
            pad = (-off) % tail.align
            off += pad
            fmt += f"{pad}x" if pad else ""
            self.offsets[tail.name] = off
        self.header = struct.Struct(fmt)
        self.header_size = off
        full = off + (tail.size if tail else 0)
        self.size = full + ((-full) % max_align)
        self.names = [f.name for f in fields]

    def c_struct(self) -> str:
        lines = [f"struct {self.cname} {{"]
        for f in self.fields + ([self.tail] if self.tail else []):
            comment = f"  /* {f.doc} */" if f.doc else ""
            if f.array_len is not None:
                dim = f.ctype[f.ctype.index("[") + 1 : -1]
                dim = f"TT_{dim}" if dim in CONSTANTS else dim
                lines.append(f"    {f.base} {f.name}[{dim}];{comment}")
            else:
                lines.append(f"    {f.ctype} {f.name};{comment}")
        lines.append("};")
        for name, off in self.offsets.items():
            lines.append(
                f'_Static_assert(__builtin_offsetof(struct {self.cname}, {name}) == {off}, '
                f'"{self.cname}.{name} layout differs from tracer/events/wire.py");'
            )
        lines.append(
            f'_Static_assert(sizeof(struct {self.cname}) == {self.size}, '
            f'"{self.cname} size differs from tracer/events/wire.py");'
        )
        lines.append(f"#define TT_{self.cname.upper()}_HDR {self.header_size}")
        return "\n".join(lines)

    def unpack(self, buf: bytes) -> dict[str, object]:
        """Decode the fixed part; the tail (if any) is ``buf[header_size:]``."""
        return dict(zip(self.names, self.header.unpack_from(buf, 0)))


CONN = Record(
    "tt_conn",
    "KIND_CONN",
    [
        Field("kind", "u32"),
        Field("pid", "u32", "tgid"),
        Field("tid", "u32"),
        Field("fd", "s32"),
        Field("ts", "u64", "CLOCK_MONOTONIC ns at syscall exit (close: at entry)"),
        Field("conn_id", "u64", "monotonic ns when the connection was first seen"),
        Field("ret", "s32", "syscall return value; CONN_PEER: the local port"),
        Field("listen_fd", "s32", "accept: the listening fd; else -1"),
        Field("op", "u16", "TT_CONN_*"),
        Field("role", "u16", "TT_ROLE_*"),
        Field("family", "u16", "AF_INET/AF_INET6/AF_UNIX from the sockaddr, 0 if unknown"),
        Field("port", "u16", "peer port, host byte order"),
        Field("addr", "u8[16]", "peer IPv4 (first 4 bytes) or IPv6 address"),
    ],
)

DATA = Record(
    "tt_data",
    "KIND_DATA",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("fd", "s32"),
        Field("conn_id", "u64"),
        Field("ts_enter", "u64"),
        Field("ts_exit", "u64"),
        Field("ret", "s64", "syscall return: bytes moved, 0 at EOF, -errno"),
        Field("offset", "u32", "offset of this chunk within the syscall's bytes"),
        Field("len", "u32", "bytes of payload in this record"),
        Field("syscall", "u16", "TT_SYS_*"),
        Field("direction", "u8", "TT_DIR_IN (read side) or TT_DIR_OUT"),
        Field("flags", "u8", "TT_FLAG_*"),
        Field("pad", "u32"),
        Field("stream_off", "u64", "bytes this direction of the connection moved before this syscall"),
    ],
    tail=Field("payload", "u8[CHUNK]"),
)

PROC = Record(
    "tt_proc",
    "KIND_PROC",
    [
        Field("kind", "u32"),
        Field("pid", "u32", "the process the event is about"),
        Field("tid", "u32", "thread that caused it"),
        Field("ppid", "u32", "fork: the parent tgid"),
        Field("ts", "u64"),
        Field("op", "u16", "TT_PROC_*"),
        Field("pad", "u16"),
        Field("exit_code", "s32"),
        Field("comm", "char[16]"),
    ],
)

RECORDS: dict[int, Record] = {r.kind: r for r in (CONN, DATA, PROC)}


def register(record: Record) -> Record:
    """Add a record kind defined by another concern (GPU probes) to the registry."""
    RECORDS[record.kind] = record
    return record


def c_definitions() -> str:
    """C text with every constant and record struct, prepended to BPF programs."""
    out = [f"/* generated from tracer/events/wire.py, wire version {WIRE_VERSION} */"]
    out += [f"#define TT_{k} {v}" for k, v in CONSTANTS.items()]
    out += [r.c_struct() for r in RECORDS.values()]
    return "\n".join(out) + "\n"


def kind_of(buf: bytes) -> int:
    """The record kind: the first u32 of every record."""
    return struct.unpack_from("<I", buf, 0)[0]
