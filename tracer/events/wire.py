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

WIRE_VERSION = 10
# Versions whose records this code decodes: 2 added the GPU records, 3 the ibverbs
# and KCOUNT records, 4 the KSTUB record, 5 the NETWAIT record, 6 the TLS record and
# DATA's TLS flags (plaintext from the TLS library, ciphertext sent without payload),
# 7 the KSTACKS and STACKDEF records (launch-site stacks), 8 both (6 and 7 were
# written by parallel branches), 9 the RUN record (token writes staged in the
# kernel), 10 NETWAIT's UNSEEN op (an ACK the kernel did not let the probe see);
# none changed an earlier layout.
READABLE_WIRE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)


class WireError(ValueError):
    """A ring-buffer record that cannot be decoded (a tracer bug or a corrupt capture)."""

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
    "KIND_VERBS_CTX": 10,
    "KIND_VERBS_MR": 11,
    "KIND_VERBS_QP": 12,
    "KIND_KCOUNT": 13,
    "KIND_KSTUB": 14,
    "KIND_NETWAIT": 15,
    "KIND_TLS": 16,  # bpf/tls.c: an SSL object tied to its socket, established, freed
    # (17 is TLS's too, unused so far)
    # launch-site stacks (bpf/stacks.c): kinds 18-19
    "KIND_KSTACKS": 18,
    "KIND_STACKDEF": 19,
    # a streamed response's token writes, staged in the kernel (bpf/sockets.c): one
    # record per RUN_MAX writes instead of one each, without their text
    "KIND_RUN": 20,
    "RUN_MAX": 32,  # writes per RUN record
    "RUN_HEAD": 512,  # bytes of an armed template's head at most (a power of two)
    "RUN_TAIL": 512,  # ...and of its tail (HF serve puts the model path after the text)
    "RUN_WRITE_MAX": 1024,  # a write longer than this is never staged
    "RUN_AGE_NS": 250_000_000,  # a run this old is sent at its connection's next write
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
    # TLS plaintext read or written through the TLS library (bpf/tls.c): its own stream
    # offsets, fd and conn_id of the socket the SSL object was tied to
    "FLAG_TLS": 16,
    # the ciphertext syscall of a socket whose plaintext is followed: sent without its
    # payload (ret and stream_off kept for socket timing)
    "FLAG_CIPHER": 32,
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
    "SYS_SSL_READ": 9,  # SSL_read / SSL_read_ex (DATA with FLAG_TLS)
    "SYS_SSL_WRITE": 10,  # SSL_write / SSL_write_ex
    # NETWAIT.op (bpf/netwait.c): when the kernel held a served request's bytes
    "NW_ARRIVAL": 1,  # a read's oldest bytes reached the socket at ts
    "NW_HOLD": 2,  # an ACK at ts found written bytes [aux, stream_off) unsent
    "NW_DEPARTURE": 3,  # bytes up to stream_off left at ts (the last ACK that found them)
    # an ACK came between the socket's probe at ref_ts and this one at ts and was not
    # seen (the kernel skips a tracepoint's program while another BPF program runs on
    # that CPU): bytes [aux, stream_off) left in between, when is not known
    "NW_UNSEEN": 4,
    # a read that returned a burst's oldest bytes also returned a later data segment:
    # bytes from stream_off on reached the socket at ts (the read exited at ref_ts)
    "NW_LATER": 5,
    # NETWAIT.cause: why written bytes were held
    "NW_CAUSE_NAGLE": 1,  # small segments in flight, the rest waits for their ACK
    "NW_CAUSE_CWND": 2,  # congestion window full
    "NW_CAUSE_RWND": 3,  # the peer's receive window full
    "NW_CAUSE_CORK": 4,  # nothing in flight: TCP_CORK, MSG_MORE or pacing
    # NETWAIT.flags
    "NW_FLAG_FIRST": 1,  # the owner's first record for this socket
    "NW_FLAG_ANCHORED": 2,  # stream offsets tied to sequence numbers: departures measurable
    # TLS.op (bpf/tls.c)
    "TLS_BIND": 1,  # the SSL object's socket is (fd, conn_id), learned as TLS.via says
    "TLS_ESTABLISHED": 2,  # its handshake completed (or it moved application data)
    "TLS_FREE": 3,  # SSL_free; TLS_F_FAILED: its handshake began and never completed
    # TLS.via: how the socket was learned
    "TLS_VIA_SET_FD": 1,  # SSL_set_fd(ssl, fd)
    "TLS_VIA_SYSCALL": 2,  # a socket syscall the thread made inside an SSL call
    "TLS_VIA_BIO_IN": 3,  # its read BIO was fed the bytes a socket read just returned
    "TLS_VIA_BIO_OUT": 4,  # a record it wrote to its BIO was sent on the socket
    # TLS.flags
    "TLS_F_FRESH": 1,  # seen from its setup (SSL_set_fd/SSL_set_bio/the handshake)
    "TLS_F_ESTABLISHED": 2,
    "TLS_F_FAILED": 4,
    "TLS_HEAD": 16,  # ciphertext bytes compared to tie a memory BIO to its socket
    # TLS counters (index into bpf/tls.c's per-CPU `tls_counters`; tracer/probes/tls.py
    # reports them as tls.<name>)
    "TLS_CNT_CALLS": 0,  # SSL_read/SSL_write calls of traced processes that moved data
    "TLS_CNT_UNBOUND": 1,  # ...whose SSL object was tied to no socket: not sent
    "TLS_CNT_UNBOUND_BYTES": 2,
    "TLS_CNT_STALE": 3,  # ...tied to a socket since closed (its fd reused): not sent
    "TLS_CNT_NESTED": 4,  # an SSL call inside another on one thread (the inner ignored)
    "TLS_CNT_INFLIGHT_FULL": 5,  # the in-flight call map was full: that call not seen
    "TLS_CNT_STATE_FULL": 6,  # a map of SSL objects, BIOs or sockets was full
    "TLS_CNT_LOST": 7,  # TLS records lost to a full ring buffer
    "TLS_CNT_FAILED_UNBOUND": 8,  # handshakes that failed on an SSL tied to no socket
    "TLS_CNT_BINDS": 9,  # SSL objects tied to a socket
    "TLS_N_COUNTERS": 10,
    # GPU: KBURST.reason (why a thread's burst was flushed)
    "BURST_SYNC": 1,
    "BURST_QUERY": 2,
    "BURST_INTERVAL": 3,
    "BURST_SLOTS": 4,  # wire v2 only: its slots were full (now: overflow goes to KCOUNT)
    "BURST_EXIT": 5,
    "BURST_DRAIN": 6,
    # its device-to-host copy, while the sync probes are off with the launch probes
    # (--gpu-sample, SYNC_GATE): that copy brings a step's results back, so it ends the step
    "BURST_COPY": 7,
    "BURST_SLOTS_N": 16,  # distinct kernel handles per burst before it is flushed
    # GPU: memcpy directions (index into KBURST.copy_bytes)
    "COPY_H2D": 0,
    "COPY_D2H": 1,
    "COPY_D2D": 2,
    "COPY_OTHER": 3,  # unified-address copies (cuMemcpy, cuMemcpyAsync): direction unknown
    "COPY_KINDS": 4,
    # GPU: sync APIs (KBURST.sync_api)
    "SYNC_STREAM": 1,
    "SYNC_EVENT": 2,
    "SYNC_CTX": 3,
    # GPU: KNAME.source
    "NAME_MODULE_GET_FUNCTION": 1,
    "NAME_LIBRARY_GET_KERNEL": 2,
    "NAME_KERNEL_GET_FUNCTION": 3,  # an alias: handle names the same kernel as alias_of
    "NAME_HOST_STUB": 4,  # the ELF symbol of the runtime's host stub (a KSTUB, symbolised)
    # names found in user space for handles resolved before attach (tracer/probes/prenames.py)
    "NAME_REGISTERED_STUB": 5,  # a KSTUB's host stub -> its __cudaRegisterFunction name
    "NAME_STUB_SLOT": 6,  # CUDA 13: the handle a host stub keeps in its static, read from memory
    "NAME_DRIVER_OBJECT": 7,  # a name the driver's object behind the handle points to
    # the same, in no cubin but confirmed by a library's .rodata (tracer/probes/libstrings.py)
    "NAME_DRIVER_STRING": 8,
    "NAME_LEN": 128,
    # launch-site stacks (bpf/stacks.c): what a sampled call was (KSTACKS.whats)
    "STK_KERNEL": 1,  # a kernel launch; handle = the CUfunction/CUkernel
    "STK_GRAPH": 2,  # cuGraphLaunch; handle = the CUgraphExec
    "STK_COPY": 8,  # + TT_COPY_*: a memcpy of that direction
    "STK_NCCL": 16,  # + TT_NCCL_*: an NCCL call
    "STACK_SLOTS_N": 16,  # distinct stacks a thread counts before it sends them
    "PY_FRAMES_N": 64,  # Python frames read per stack (innermost first)
    "STACK_SLICE": 16384,  # bytes of the user stack sent once per new stack (unwinding)
    # STACKDEF.flags
    "STK_PY": 1,  # Python frames were read (the process runs a known interpreter)
    "STK_PY_TRUNCATED": 2,  # more than PY_FRAMES_N Python frames: the outermost are cut
    "STK_PY_NO_THREAD": 4,  # no thread state of the interpreter is this thread's
    "STK_SLICE_CUT": 8,  # the stack slice ended before STACK_SLICE (top of the stack)
    # GPU: MEM.op
    "MEM_ALLOC": 1,
    "MEM_FREE": 2,
    # NCCL.op
    "NCCL_ALLREDUCE": 1,
    "NCCL_ALLGATHER": 2,
    "NCCL_REDUCESCATTER": 3,
    "NCCL_BROADCAST": 4,
    "NCCL_REDUCE": 5,
    "NCCL_SEND": 6,
    "NCCL_RECV": 7,
    "NCCL_GROUP_START": 8,
    "NCCL_GROUP_END": 9,
    "NCCL_COMM_INIT": 10,
    # ibverbs: VERBS.op (what a counter counts; VERBS.opcode then says which verb)
    "VERBS_SEND": 1,  # send-queue work requests, by ibv_wr_opcode: count, bytes, sges
    "VERBS_RECV": 2,  # receive work requests: count, bytes (buffer space), sges
    "VERBS_POST_SEND_CALL": 3,  # ibv_post_send calls: count; extra = chains cut short
    "VERBS_POST_RECV_CALL": 4,  # ibv_post_recv calls: count; extra = chains cut short
    "VERBS_CQE": 5,  # completions, by ibv_wc_opcode (VERBS_OPCODE_ERROR when failed)
    "VERBS_POLL": 6,  # ibv_poll_cq calls (qp 0): errors = negative returns, extra = empty
    "VERBS_OPCODE_ERROR": 0xFFFF,  # a failed completion: its opcode is undefined
    "VERBS_OPCODE_UNREAD": 0xFFFE,  # completions past VERBS_MAX_WC: counted, not read
    "VERBS_MAX_STEPS": 64,  # work requests + sges read per post (more: counted as cut)
    "VERBS_MAX_SGE": 16,  # scatter/gather entries read per work request
    "VERBS_MAX_WC": 64,  # completions read per poll
    # ibverbs: VERBS_MR.op
    "VERBS_REG_MR": 1,
    "VERBS_DEREG_MR": 2,
    # ibverbs: VERBS_CTX.via (the exported call that revealed a device context)
    "VERBS_VIA_OPEN_DEVICE": 1,
    "VERBS_VIA_IMPORT_DEVICE": 2,
    "VERBS_VIA_REG_MR": 3,
    "VERBS_VIA_DEREG_MR": 4,
    "VERBS_VIA_MODIFY_QP": 5,
    "VERBS_VIA_ACK_CQ_EVENTS": 6,
    # run-time settings (index into the `config` array)
    "CFG_CAPTURE_LIMIT": 0,
    "CFG_BURST_NS": 1,
    "CFG_BURST_MIN_NS": 2,  # a sync flushes its thread's burst only if it is this old
    "CFG_LAUNCH_GATE_CLOSED": 3,  # --gpu-sample: 1 while launches are not counted
    "CFG_STUB_NAMING": 4,  # 1 while the runtime's launch probes are attached (KSTUB)
    # --gpu-sample with copies (and memsets) switched with the launch probes: while
    # they are not counted, a bit per TT_COPY_* kind stopped (SAMPLED_COPY_MASK), and
    # bit TT_COPY_KINDS for the memsets (MEMSET_GATE), bit TT_COPY_KINDS + 1 for the
    # syncs (SYNC_GATE: then a device-to-host copy flushes its burst); 0: all counted
    "CFG_COPY_GATE_CLOSED": 5,
    # bumped at each resume: a socket call entered before it is not taken for a live one
    # (bpf/sockets.c io_call; 0 reads as 1)
    "CFG_IO_EPOCH": 6,
    "N_CONFIG": 8,
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
    "CNT_VERBS_FULL": 10,  # ibverbs counter or context map full: those calls not counted
    "CNT_VERBS_CUT": 11,  # a wr chain, sg list or wc array longer than read: bytes short
    "CNT_KCOUNTS_FULL": 12,  # kernel_counts map full: launches counted, kernel unknown
    "CNT_STUBS_FULL": 13,  # stub_pending or stub_sent full: a handle's host stub not sent
    "CNT_STUB_STALE": 14,  # a runtime call's stub not followed by its own driver launch
    "CNT_LOST_NETWAIT": 15,
    "CNT_LOST_RUN": 16,  # RUN records lost to a full ring buffer (each up to RUN_MAX writes)
    "CNT_RUN_WRITES": 17,  # token writes staged into RUN records
    "CNT_RUNS_FULL": 18,  # run_stages full: a token write sent as its own DATA record
    # --gpu-sample: a switched probe (launch, sampled copy, memset, sync) that ran while
    # its gate was closed: a trap that counted nothing, the price of the switches (the
    # probes are in place through each attach and detach, not only the open window)
    "CNT_GATED_CALLS": 19,
    # records ring_out() (bpf/common.h) saw the ring refuse (counted lost where each
    # output counts its losses: a lost_* above, tls.lost, stack_defs_lost) after
    # RING_SLOW_NS or more in the call: not a full ring, which refuses at once, but its
    # lock giving up
    "CNT_RING_REFUSED_SLOW": 20,
    "CNT_RING_REFUSED_NS": 21,  # time spent in refused ring outputs, all of them
    # records the ring refused at once and took at the second try (submit()): not lost
    "CNT_RING_RETRY_SAVED": 22,
    # tracepoint runs for traced processes: their syscalls' (an entry and, where one is
    # attached, its exit) and their connections' TCP events. The kernel counts a
    # program's runs in every process; the overhead meter (tracer/overhead.py) takes
    # these apart from the rest, other processes' runs that stop at the pid or port filter
    "CNT_TRACED_TP_RUNS": 23,
    "N_COUNTERS": 24,
    "RING_SLOW_NS": 100_000,
}

COUNTER_NAMES: dict[int, str] = {
    v: k[4:].lower() for k, v in CONSTANTS.items() if k.startswith("CNT_")
}

# records the kernel found no place for in the events ring, by counter (every
# ringbuf_output and reservation that fails counts one of these)
RING_LOSS_COUNTERS = frozenset(
    [name for name in COUNTER_NAMES.values() if name.startswith("lost_")]
    + ["tls.lost", "stack_defs_lost"])

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
    def is_bytes(self) -> bool:
        """u8[N]/char[N] decode to bytes; other arrays (u64[N]...) to a tuple."""
        return self.array_len is not None and self.base in ("u8", "char")

    @property
    def size(self) -> int:
        n = self.array_len
        if n is None:
            return _SCALARS[self.ctype][1]
        return n if self.is_bytes else n * _SCALARS[self.base][1]

    @property
    def align(self) -> int:
        if self.array_len is None:
            return _SCALARS[self.ctype][1]
        return 1 if self.is_bytes else _SCALARS[self.base][1]

    @property
    def fmt(self) -> str:
        n = self.array_len
        if n is None:
            return _SCALARS[self.ctype][0]
        return f"{n}s" if self.is_bytes else f"{n}{_SCALARS[self.base][0]}"


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
            fmt += f.fmt
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
        self._typed_arrays = any(f.array_len is not None and not f.is_bytes for f in fields)
        # (name, element count of a typed array or 0): unpack runs per record
        self._layout = [(f.name, f.array_len if f.array_len and not f.is_bytes else 0)
                        for f in fields]

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

    def pack(self, **values: int) -> bytes:
        """Encode a record without arrays or tail (user space builds VERBS records from
        the kernel's counter map); fields not given are 0, ``kind`` is this record's."""
        if self._typed_arrays or self.tail is not None:
            raise TypeError(f"{self.cname}: pack() handles scalar fields only")
        values.setdefault("kind", self.kind)
        unknown = set(values) - set(self.names)
        if unknown:
            raise KeyError(f"{self.cname} has no field(s) {sorted(unknown)}")
        raw = self.header.pack(*(values.get(n, 0) for n in self.names))
        return raw + bytes(self.size - len(raw))

    def unpack(self, buf: bytes) -> dict[str, object]:
        """Decode the fixed part; the tail (if any) is ``buf[header_size:]``."""
        values = self.header.unpack_from(buf, 0)
        if not self._typed_arrays:
            return dict(zip(self.names, values))
        out: dict[str, object] = {}
        i = 0
        for name, n in self._layout:
            if n:
                out[name] = values[i : i + n]
                i += n
            else:
                out[name] = values[i]
                i += 1
        return out


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

KBURST = Record(
    "tt_kburst",
    "KIND_KBURST",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("reason", "u16", "TT_BURST_*: why it was flushed"),
        Field("sync_api", "u16", "TT_SYNC_* of the synchronisation that ended it, or 0"),
        Field("first_ts", "u64", "first call of the burst (CLOCK_MONOTONIC ns)"),
        Field("last_ts", "u64", "last call, or the end of the sync wait that flushed it"),
        Field("launches", "u64", "kernel launches (cuLaunchKernel*, cooperative)"),
        Field("graph_launches", "u64"),
        Field("copy_bytes", "u64[COPY_KINDS]", "by TT_COPY_*"),
        Field("copy_calls", "u32[COPY_KINDS]"),
        Field("memset_bytes", "u64"),
        Field("memset_calls", "u32"),
        Field("sync_calls", "u32"),
        Field("sync_wait_ns", "u64", "time spent inside synchronisation calls"),
        Field("query_polls", "u32", "cuStreamQuery/cuEventQuery calls that found work pending"),
        Field("nslots", "u32", "used entries of handles/handle_counts"),
        Field("handles", "u64[BURST_SLOTS_N]", "launched CUfunction/CUkernel handles"),
        Field("handle_counts", "u32[BURST_SLOTS_N]"),
    ],
)

KNAME = Record(
    "tt_kname",
    "KIND_KNAME",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("source", "u16", "TT_NAME_*"),
        Field("pad", "u16"),
        Field("ts", "u64"),
        Field("handle", "u64", "the handle launches will pass"),
        Field("alias_of", "u64", "NAME_KERNEL_GET_FUNCTION: the CUkernel it came from"),
        Field("name", "char[NAME_LEN]", "mangled kernel name, NUL-terminated"),
    ],
)

MEM = Record(
    "tt_mem",
    "KIND_MEM",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("op", "u16", "TT_MEM_*"),
        Field("known", "u16", "free: 1 if the allocation was seen, else its size is unknown"),
        Field("ts", "u64"),
        Field("ptr", "u64"),
        Field("bytes", "u64"),
        Field("live", "u64", "device bytes this process holds after the call"),
    ],
)

NCCL = Record(
    "tt_nccl",
    "KIND_NCCL",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("op", "u16", "TT_NCCL_*"),
        Field("dtype", "u16", "ncclDataType_t"),
        Field("ts_enter", "u64"),
        Field("ts_exit", "u64"),
        Field("count", "u64", "elements (bytes = count x dtype size)"),
        Field("comm", "u64", "ncclComm_t"),
        Field("stream", "u64"),
        Field("comm_id", "u64", "COMM_INIT: first 8 bytes of the ncclUniqueId"),
        Field("peer", "s32", "send/recv peer, broadcast/reduce root, COMM_INIT rank"),
        Field("nranks", "s32", "COMM_INIT"),
        Field("ret", "s32", "ncclResult_t"),
        Field("pad", "u32"),
    ],
)

KCOUNT = Record(
    "tt_kcount",
    "KIND_KCOUNT",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("pad", "u32"),
        Field("ts", "u64", "when the counter was read (CLOCK_MONOTONIC ns)"),
        Field("handle", "u64", "CUfunction/CUkernel launched"),
        Field("count", "u64", "its launches since the last record, past the burst's slots"),
    ],
)

KSTUB = Record(
    "tt_kstub",
    "KIND_KSTUB",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("pad", "u32"),
        Field("ts", "u64", "the first driver launch of handle seen while naming is open"),
        Field("handle", "u64", "CUfunction/CUkernel the driver launched"),
        Field("stub", "u64", "the host stub (func of cudaLaunchKernel*): a process address;"
              " 0: a driver-API launch, no runtime call"),
    ],
)

VERBS = Record(
    "tt_verbs",
    "KIND_VERBS",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("qp_num", "u32", "the QP posted to or completed on; 0 for VERBS_POLL"),
        Field("op", "u16", "TT_VERBS_* (what is counted)"),
        Field("opcode", "u16", "ibv_wr_opcode (SEND) or ibv_wc_opcode (CQE), else 0"),
        Field("pad", "u32"),
        Field("ts", "u64", "when the counters were read (CLOCK_MONOTONIC ns)"),
        Field("count", "u64", "work requests, calls or completions since the last record"),
        Field("bytes", "u64", "sum of sge lengths (posts), of wc.byte_len (completions)"),
        Field("errors", "u64", "completions with a failed status; polls that returned < 0"),
        Field("extra", "u64", "posts: sges; post calls: chains cut; polls: empty polls"),
    ],
)

VERBS_CTX = Record(
    "tt_verbs_ctx",
    "KIND_VERBS_CTX",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("via", "u16", "TT_VERBS_VIA_*"),
        Field("pad", "u16"),
        Field("ts", "u64"),
        Field("ctx", "u64", "struct ibv_context *"),
        Field("post_send", "u64", "ctx->ops.post_send: the provider's function"),
        Field("post_recv", "u64", "ctx->ops.post_recv"),
        Field("poll_cq", "u64", "ctx->ops.poll_cq"),
    ],
)

VERBS_MR = Record(
    "tt_verbs_mr",
    "KIND_VERBS_MR",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("op", "u16", "TT_VERBS_REG_MR / TT_VERBS_DEREG_MR"),
        Field("pad", "u16"),
        Field("ts", "u64"),
        Field("mr", "u64", "struct ibv_mr * (0: registration failed)"),
        Field("addr", "u64"),
        Field("length", "u64", "bytes registered (dereg: read from the mr)"),
        Field("lkey", "u32"),
        Field("rkey", "u32"),
        Field("access", "s32", "ibv_access_flags"),
        Field("ret", "s32", "dereg: its return value; reg: 0, or -1 when it returned NULL"),
    ],
)

VERBS_QP = Record(
    "tt_verbs_qp",
    "KIND_VERBS_QP",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("qp_num", "u32"),
        Field("ts", "u64"),
        Field("state", "s32", "ibv_qp_state requested, -1 if attr_mask lacks IBV_QP_STATE"),
        Field("dest_qp_num", "s32", "remote QP, -1 if attr_mask lacks IBV_QP_DEST_QPN"),
        Field("attr_mask", "s32"),
        Field("ret", "s32", "ibv_modify_qp's return value (0 or an errno)"),
    ],
)

NETWAIT = Record(
    "tt_netwait",
    "KIND_NETWAIT",
    [
        Field("kind", "u32"),
        Field("pid", "u32", "owner of the socket (the syscall probes' pid, fd, conn_id)"),
        Field("tid", "u32", "thread that was running (softirq: any)"),
        Field("fd", "s32"),
        Field("conn_id", "u64"),
        Field("op", "u16", "TT_NW_*"),
        Field("cause", "u16", "HOLD/DEPARTURE: TT_NW_CAUSE_*"),
        Field("flags", "u32", "TT_NW_FLAG_*"),
        Field("ts", "u64", "ARRIVAL: bytes reached the socket (0: unseen); LATER: the later"
              " segment did; HOLD: the ACK that found them; DEPARTURE: when they left"),
        Field("ref_ts", "u64", "ARRIVAL/LATER: the read's ts_exit; HOLD/DEPARTURE: exit of the"
              " write that ended at stream_off; UNSEEN: the socket's last probe seen"),
        Field("stream_off", "u64", "ARRIVAL: the read's stream offset; LATER: the later"
              " segment's first byte's; HOLD/DEPARTURE: end of the held bytes; UNSEEN: sent"
              " by ts"),
        Field("aux", "u64", "ARRIVAL (FIRST): handshake completed, 0 if unseen; HOLD/DEPARTURE:"
              " stream offset of the first held byte; UNSEEN: sent by ref_ts"),
    ],
)

TLS = Record(
    "tt_tls",
    "KIND_TLS",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("fd", "s32", "the socket (BIND); -1 if the SSL object was never tied to one"),
        Field("conn_id", "u64", "the socket's conn_id, as in CONN and DATA records; 0 unbound"),
        Field("ts", "u64"),
        Field("ssl", "u64", "the SSL object (a process address)"),
        Field("op", "u16", "TT_TLS_BIND / ESTABLISHED / FREE"),
        Field("via", "u16", "BIND: TT_TLS_VIA_*"),
        Field("flags", "u32", "TT_TLS_F_*"),
        Field("bytes_in", "u64", "plaintext read through it so far (its DATA stream offset)"),
        Field("bytes_out", "u64", "plaintext written through it so far"),
    ],
)

KSTACKS = Record(
    "tt_kstacks",
    "KIND_KSTACKS",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("n", "u32", "used entries of ids/handles/counts/whats"),
        Field("burst_ts", "u64", "first_ts of the KBURST these samples were taken in "
              "(it follows this record); 0: taken outside a burst (an NCCL call)"),
        Field("samples", "u64", "the thread's samples so far"),
        Field("ids", "u64[STACK_SLOTS_N]", "stack ids (a STACKDEF describes each)"),
        Field("handles", "u64[STACK_SLOTS_N]", "kernel handle / graph of each stack"),
        Field("counts", "u32[STACK_SLOTS_N]", "sampled calls with that stack"),
        Field("whats", "u16[STACK_SLOTS_N]", "TT_STK_* of each stack"),
    ],
)

STACKDEF = Record(
    "tt_stackdef",
    "KIND_STACKDEF",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32"),
        Field("what", "u16", "TT_STK_*"),
        Field("py_depth", "u16", "Python frames read (innermost first)"),
        Field("flags", "u32", "TT_STK_* flags"),
        Field("slice_len", "u32", "bytes of the user stack in the tail"),
        Field("stack_id", "u64"),
        Field("handle", "u64"),
        Field("ts", "u64"),
        Field("ip", "u64", "the probed function's entry (user space)"),
        Field("sp", "u64", "stack pointer at the probe: the slice starts here"),
        Field("bp", "u64", "frame pointer register at the probe"),
        Field("py_code", "u64[PY_FRAMES_N]", "code object of each Python frame"),
        Field("py_instr", "u64[PY_FRAMES_N]", "its instruction pointer (3.10: f_lasti)"),
    ],
    tail=Field("slice", "u8[STACK_SLICE]"),
)

RUN = Record(
    "tt_run",
    "KIND_RUN",
    [
        Field("kind", "u32"),
        Field("pid", "u32"),
        Field("tid", "u32", "the thread that made every write of the run"),
        Field("fd", "s32"),
        Field("conn_id", "u64"),
        Field("stream_off", "u64", "bytes the connection had written before the first"),
        Field("arm", "u32", "the template the writes matched: the connection's arm number"),
        Field("n", "u32", "writes in the run (1..RUN_MAX)"),
        Field("ts", "u64[RUN_MAX]", "each write's syscall exit"),
        Field("len", "u16[RUN_MAX]", "each write's bytes: size line, head, JSON string, tail"),
    ],
)

RECORDS: dict[int, Record] = {
    r.kind: r for r in (CONN, DATA, PROC, KBURST, KNAME, MEM, NCCL, KCOUNT, KSTUB, VERBS,
                        VERBS_CTX, VERBS_MR, VERBS_QP, NETWAIT, TLS, KSTACKS, STACKDEF, RUN)
}


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


RUN_HASH_K = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


def run_hash(data: bytes) -> int:
    """The hash an armed token template's head or tail is given to the kernel as
    (``run_hash`` in bpf/sockets.c, which hashes the written chunk's bytes alike):
    each little-endian word of eight bytes, the last zero-padded, folded in as
    ``h = (rotl(h, 5) ^ w) * K`` modulo 2**64."""
    h = 0
    for i in range(0, len(data), 8):
        w = int.from_bytes(data[i:i + 8].ljust(8, b"\0"), "little")
        h = ((((h << 5) | (h >> 59)) & _U64) ^ w) * RUN_HASH_K & _U64
    return h
