"""Connections to requests: route socket events to protocol parsers, build records.

The tracker keeps one ``Connection`` per (pid, fd, conn_id). It decides which side is
the client (accept means the traced process serves, connect means it calls; for
sockets found open at attach, the first start line decides), sniffs the protocol from
the client's first bytes, checks every chunk's stream offset so a capture gap becomes
an explicit ``lost()`` on the parser, and turns parser events into ``RequestRecord``s.

Whatever a parser raises on one connection's bytes stays with that connection: it is
counted in ``parser_errors`` (and ``parser_errors.<module>.<exception>``, naming the
innermost module of ours that raised), the connection's open requests end in error,
and its parsers start over unsynced, hunting for the next message. Other connections
never notice.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from protocols import detect, http1, http2
from protocols import tls as tlsproto
from protocols.openai import ResponseFollower, operation_for, parse_request
from tracer.correlate.arrivals import Arrivals
from tracer.correlate.h2calls import H2Calls
from tracer.correlate.ipc import IpcGraph
from tracer.correlate.records import DUTY_CYCLE_CUT, SAFE_HEADERS, RequestRecord, tenant_of
from tracer.correlate.tokenruns import ConnRuns, TokenRuns, armed, take_run
from tracer.events import schema, wire
from tracer.events.runs import RunArmed, TokenRun
from tracer.events.tls import TlsEvent

C = wire.CONSTANTS
_DIR_IN = C["DIR_IN"]
_FLAG_LAST = C["FLAG_LAST"]
_FLAG_TLS_LAST = C["FLAG_LAST"] | C["FLAG_TLS"]
Emit = Callable[[RequestRecord], None]

SNIFF_MAX = 64  # client bytes looked at to recognise a protocol
HUNT_GIVE_UP = 64 * 1024  # bytes of an attached-to connection searched for a start line
MAX_SOCKET_THREADS = 65_536  # threads remembered as having moved socket bytes

log = logging.getLogger("tokentrace.connections")
_ROOT = Path(__file__).resolve().parents[2]
_SOURCES = (str(_ROOT / "protocols") + "/", str(_ROOT / "tracer") + "/")


def error_source(e: BaseException) -> str:
    """The innermost module of ``protocols`` or ``tracer`` in ``e``'s traceback
    (``openai``, ``grpc``, ``http1``, ``pipeline``...): which layer failed."""
    name = "unknown"
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename.startswith(_SOURCES):
            name = Path(frame.filename).stem
    return name


def count_parser_error(stats: Counter[str], e: BaseException) -> str:
    """Count ``e`` in ``stats`` as a parser error; returns its key."""
    key = f"parser_errors.{error_source(e)}.{type(e).__name__}"
    stats["parser_errors"] += 1
    if not stats[key]:
        log.debug("first %s", key, exc_info=e)
    stats[key] += 1
    return key


@dataclass
class TrackerOptions:
    keep_content: bool = False  # prompts and completions: off unless the user opts in
    tenant_salt: bytes | None = None  # the deployment's (None: older captures' fixed one)
    secrets_masked: bool = False  # credential headers hold masks (a masked capture)
    max_request_body: int = 8 * 1024 * 1024
    idle_timeout_ns: int = 15 * 60 * 10**9
    # an HTTP/2 stream with no frame this long ends (one that lost bytes, sooner)
    stream_idle_timeout_ns: int = 15 * 60 * 10**9
    damaged_stream_idle_timeout_ns: int = 60 * 10**9
    # connections followed at once; past it the least recently active are dropped
    max_connections: int = 100_000
    # bytes all connections together may hold for parsing (bodies, unfinished frames,
    # messages, events); past it the connections holding the most are dropped
    max_buffered: int = 256 * 1024 * 1024


class Exchange:
    """One HTTP exchange being assembled into a record."""

    def __init__(self, conn: "Connection", req: http1.Request, options: TrackerOptions) -> None:
        self.options = options
        headers = {}
        for name, value in req.headers:
            headers.setdefault(name, value)
        self.rec = RequestRecord(
            pid=conn.pid, fd=conn.fd, conn_id=conn.conn_id, exchange=req.exchange,
            role=conn.role or "server", method=req.method, target=req.target,
            http_version=req.version, start_ns=req.ts,
            request_headers={k: v for k, v in headers.items() if k in SAFE_HEADERS},
            tenant=tenant_of(headers, options.tenant_salt, options.secrets_masked),
            family=conn.family, local_addr=conn.local_addr,
            local_port=conn.local_port, peer_addr=conn.peer_addr, peer_port=conn.peer_port,
            tls=conn.tls_session,
        )
        self.operation = operation_for(req.method, req.target)
        self.body = bytearray() if self.operation else None
        self.body_cut = False
        self.follower = (ResponseFollower(self.operation, options.keep_content)
                         if self.operation else None)

    def add_tid(self, tid: int) -> None:
        if tid not in self.rec.tids:
            self.rec.tids.append(tid)

    def request_data(self, data: bytes) -> None:
        self.rec.request_bytes += len(data)
        if self.body is not None:
            room = self.options.max_request_body - len(self.body)
            if len(data) > room:
                self.body_cut = True
                data = data[: max(0, room)]
            self.body += data

    def request_end(self, ts: int, incomplete: bool) -> None:
        self.rec.request_end_ns = ts
        self.rec.request_incomplete = incomplete
        if self.operation and self.body is not None:
            complete = not (incomplete or self.body_cut)
            self.rec.llm_request = parse_request(self.operation, bytes(self.body), complete,
                                                 keep_prompt=self.options.keep_content)
            self.body = None

    def response(self, resp: http1.Response) -> None:
        self.rec.status = resp.status
        self.rec.response_start_ns = resp.ts
        headers = dict(resp.headers)
        self.rec.response_headers = {
            k: v for k, v in headers.items()
            if k in ("content-type", "content-length", "content-encoding", "x-request-id")
        }
        if self.follower:
            self.follower.head(resp.ts, resp.status, headers)

    def response_data(self, ts: int, data: bytes) -> None:
        self.rec.response_bytes += len(data)
        if self.follower:
            self.follower.data(ts, data)

    def finish(self, ts: int, error: str | None = None, incomplete: bool = False
               ) -> RequestRecord:
        rec = self.rec
        rec.end_ns = ts
        rec.response_incomplete = incomplete
        if rec.request_end_ns is None:
            # the response ended before the request did: the end of the request (a hole
            # the next inbound bytes would have shown, or bytes the server never read)
            # was not seen, so what is recorded of it is not the whole request
            rec.request_incomplete = True
        if rec.llm_request is None and self.operation and self.body is not None:
            # the response finished (or failed) before the request body did
            rec.llm_request = parse_request(self.operation, bytes(self.body), False,
                                            keep_prompt=self.options.keep_content)
        if self.follower:
            rec.llm_response = self.follower.end(ts)
        if error:
            rec.error = error
        return rec


class TlsConn:
    """What the TLS probes and the cleartext handshake said of one connection."""

    def __init__(self) -> None:
        self.reader: tlsproto.HandshakeReader | None = None  # while reading the hellos
        self.session = tlsproto.TlsSession()
        self.ssl = 0  # the SSL object tied to the socket (TLS BIND)
        self.bound = False
        self.fresh = False  # that object was seen from its setup
        self.established = False
        self.failed = False  # its handshake began and never completed
        self.plain = False  # its plaintext is what the parsers read
        self.counted = False  # its outcome is in the stats


class Connection:
    def __init__(self, pid: int, fd: int, conn_id: int, role: str | None, synced: bool) -> None:
        self.pid = pid
        self.fd = fd
        self.conn_id = conn_id
        self.role = role  # "server" / "client" / None (not yet known)
        self.synced = synced  # seen from its first byte
        self.family = 0
        self.local_addr = ""
        self.local_port = 0
        self.peer_addr = ""
        self.peer_port = 0
        self.expected = {True: 0, False: 0}  # next stream offset, by inbound
        self.proto: str | None = None
        self.sniff_buf = b""
        self.sniff_ts = 0
        self.unsniffed = 0
        self.http: http1.HTTP1Connection | None = None
        self.h2: H2Calls | None = None
        self.exchanges: dict[int, Exchange] = {}
        self.last_ts = 0
        self.close_reason: str | None = None
        self.ipc_seen = False  # its addresses were given to the process graph
        # by inbound: the process graph has all it wants of this direction (and its
        # addresses): no need to show it more bytes
        self.ipc_quiet = {True: False, False: False}
        # the wire direction of the server's bytes once HTTP/1 is parsed and the role
        # known: where ``_stream_chunk`` may apply
        self.stream_dir: int | None = None
        self.held = 0  # bytes it held for parsing after its last data event
        self.tls: TlsConn | None = None  # TLS on the wire, or its plaintext followed
        self.runs: ConnRuns | None = None  # its token runs' arms (tokenruns.py)

    @property
    def tls_session(self) -> tlsproto.TlsSession | None:
        """The TLS session of a connection whose plaintext is parsed (else None)."""
        return self.tls.session if self.tls is not None and self.tls.plain else None

    def buffered(self) -> int:
        """Bytes this connection's parsers hold now."""
        n = len(self.sniff_buf)
        if self.http is not None:
            n += self.http.buffered
        if self.h2 is not None:
            n += self.h2.grpc.buffered
        for ex in self.exchanges.values():
            n += len(ex.body or b"") + (ex.follower.buffered if ex.follower else 0)
        return n

    def from_client(self, inbound: bool) -> bool:
        return inbound if self.role == "server" else not inbound

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.fd, self.conn_id)


class ConnTable(dict[tuple[int, int, int], Connection]):
    """The followed connections by key, and by process (``by_pid``): the GPU
    correlator asks for one process's open requests at every settling."""

    def __init__(self) -> None:
        super().__init__()
        self.by_pid: dict[int, dict[tuple[int, int, int], Connection]] = {}

    def __setitem__(self, key: tuple[int, int, int], c: Connection) -> None:
        super().__setitem__(key, c)
        self.by_pid.setdefault(key[0], {})[key] = c

    def __delitem__(self, key: tuple[int, int, int]) -> None:
        super().__delitem__(key)
        self._unindex(key)

    def pop(self, key: tuple[int, int, int], *default: object) -> object:  # type: ignore[override]
        if key in self:
            self._unindex(key)
        return super().pop(key, *default)

    def _unindex(self, key: tuple[int, int, int]) -> None:
        same = self.by_pid.get(key[0])
        if same is not None:
            same.pop(key, None)
            if not same:
                del self.by_pid[key[0]]

    def of_pid(self, pid: int) -> Iterable[Connection]:
        return self.by_pid.get(pid, {}).values()


class ConnectionTracker:
    """Socket events in, finished ``RequestRecord``s out (through ``emit``)."""

    def __init__(self, emit: Emit, options: TrackerOptions | None = None,
                 processes: dict[int, schema.ProcessInfo] | None = None,
                 ipc: IpcGraph | None = None) -> None:
        self.emit = emit
        self.ipc = ipc  # told every connection's first bytes and addresses
        self.options = options or TrackerOptions()
        self.processes = processes if processes is not None else {}
        self.conns = ConnTable()
        # (pid, tid) of every thread seen moving socket bytes: the only ones a request's
        # ``tids`` can name (a thread that never did is no request's own); None: too
        # many to keep (a thread per request), any thread may be one
        self.socket_threads: set[tuple[int, int]] | None = set()
        self.buffered_estimate = 0  # sum of Connection.held, give or take the closed
        self.stats: Counter[str] = Counter()
        self.runs = TokenRuns(self.stats)  # token writes the kernel stages: arms asked for
        self.arrivals = Arrivals(self.is_open, self.open_of)  # open records by arrival

    def open_of(self, pid: int) -> Iterator[RequestRecord]:
        """The records of ``pid`` still being assembled, with their responses so far."""
        for c in list(self.conns.of_pid(pid)):
            for ex in c.exchanges.values():
                if ex.follower is not None:
                    ex.rec.llm_response = ex.follower.r
                yield ex.rec
            if c.h2 is not None:
                yield from c.h2.records.values()

    def is_open(self, rec: RequestRecord) -> bool:
        """Whether ``rec`` is still being assembled."""
        c = self.conns.get(rec.key[:3])
        if c is None:
            return False
        ex = c.exchanges.get(rec.exchange)
        if ex is not None and ex.rec is rec:
            return True
        return c.h2 is not None and c.h2.records.get(rec.exchange) is rec

    # ---- connection lifecycle ---------------------------------------------------

    def conn_event(self, ev: schema.ConnEvent) -> None:
        if ev.op in (C["CONN_ACCEPT"], C["CONN_CONNECT"]):
            role = "server" if ev.op == C["CONN_ACCEPT"] else "client"
            c = Connection(ev.pid, ev.fd, ev.conn_id, role, synced=True)
            c.family, c.peer_addr, c.peer_port = ev.family, ev.peer_addr, ev.peer_port
            c.last_ts = ev.ts
            self._admit(c)
            self.stats["connections"] += 1
        elif ev.op == C["CONN_PEER"]:
            c = self.conns.get(ev.key)
            if c is not None:
                c.family, c.peer_addr, c.peer_port = ev.family, ev.peer_addr, ev.peer_port
                c.local_port = c.local_port or ev.ret
                c.ipc_quiet = {True: False, False: False}  # addresses for the graph
        elif ev.op == C["CONN_CLOSE"]:
            c = self.conns.pop(ev.key, None)
            if c is not None:
                self._close_guarded(c, ev.ts)

    def socket_info(self, ev: schema.SocketInfo) -> None:
        c = self.conns.get(ev.key)
        if c is None:
            role = {C["ROLE_SERVER"]: "server", C["ROLE_CLIENT"]: "client"}.get(ev.role)
            c = Connection(ev.pid, ev.fd, ev.conn_id, role, synced=not ev.existing)
            c.last_ts = ev.ts
            self._admit(c)
            if ev.existing:
                self.stats["connections_existing"] += 1
        c.family = ev.family
        c.local_addr, c.local_port = ev.local_addr, ev.local_port
        if ev.peer_addr or not c.peer_addr:
            c.peer_addr, c.peer_port = ev.peer_addr, ev.peer_port
        c.ipc_quiet = {True: False, False: False}  # addresses for the process graph

    def process_exit(self, pid: int, ts: int) -> None:
        self.arrivals.forget(pid)
        if self.socket_threads is not None:
            self.socket_threads = {t for t in self.socket_threads if t[0] != pid}
        for key in [k for k in self.conns if k[0] == pid]:
            c = self.conns.pop(key)
            c.close_reason = "process exited before the response completed"
            self._close_guarded(c, ts)

    def pause(self, ts: int, sampled: bool = False) -> None:
        """The agent took its probes out (``schema.TracingPaused``): every connection
        is forgotten, its open requests end here, incomplete (what comes after the
        resume is followed afresh, as at attach). ``sampled``: the end of a
        ``--duty-cycle`` window, not a pause by hand."""
        reason = DUTY_CYCLE_CUT if sampled else "tracing paused before the response completed"
        for key in list(self.conns):
            c = self.conns.pop(key)
            exchanges, c.exchanges = list(c.exchanges.values()), {}
            for ex in exchanges:
                self._emit_guarded(lambda ex=ex: self._finished(ex, ts, reason, True))
            cut = len(exchanges)
            if c.h2 is not None:
                for rec in c.h2.abort(ts, reason):
                    cut += 1
                    self._emit_guarded(lambda rec=rec: rec)
            if self.ipc is not None:
                self.ipc.closed(c.pid, c.fd, c.conn_id)
            self.stats["requests_cut_by_duty_cycle" if sampled else "requests_cut_by_pause"] += cut
        self.stats["duty_cycle_pauses" if sampled else "pauses"] += 1

    def finish(self, ts: int) -> int:
        """End of capture: count exchanges still open (they are not emitted)."""
        open_exchanges = sum(len(c.exchanges) + (c.h2.open_calls if c.h2 else 0)
                             for c in self.conns.values())
        self.stats["in_flight_at_exit"] += open_exchanges
        for c in self.conns.values():
            self._tls_outcome(c)
        return open_exchanges

    def expire(self, now_ts: int) -> None:
        """Forget connections idle longer than the timeout (a lost close record), and
        HTTP/2 streams idle longer than theirs (a lost end of stream)."""
        o = self.options
        limit = now_ts - o.idle_timeout_ns
        for key in [k for k, c in self.conns.items() if c.last_ts < limit]:
            c = self.conns.pop(key)
            c.close_reason = "connection idle past the tracer's timeout"
            self.stats["connections_expired"] += 1
            self._close_guarded(c, now_ts)
        for c in list(self.conns.values()):
            if c.h2 is not None and c.h2.open_calls:
                try:
                    self._emit_h2(c.h2.expire(now_ts, o.stream_idle_timeout_ns,
                                              o.damaged_stream_idle_timeout_ns))
                except Exception as e:
                    self._contain(c, e, now_ts)

    def _admit(self, c: Connection) -> None:
        """Start following ``c``; past ``max_connections`` the least recently active
        tenth is dropped first (their open requests end in error; counted)."""
        if len(self.conns) >= self.options.max_connections:
            n = max(1, len(self.conns) // 10)
            for old in sorted(self.conns.values(), key=lambda x: x.last_ts)[:n]:
                del self.conns[old.key]
                old.close_reason = "dropped: the tracer follows too many connections"
                self.stats["connections_evicted"] += 1
                self._close_guarded(old, old.last_ts)
        self.conns[c.key] = c

    # ---- data -------------------------------------------------------------------

    def _moved_bytes(self, pid: int, tid: int) -> None:
        """Thread (pid, tid) moved socket bytes."""
        threads = self.socket_threads
        if threads is not None:
            threads.add((pid, tid))
            if len(threads) > MAX_SOCKET_THREADS:
                self.socket_threads = None  # too many to keep: every thread may serve

    def data_event(self, ev: schema.DataEvent) -> None:
        self._moved_bytes(ev.pid, ev.tid)
        c = self.conns.get(ev.key)
        if c is None:
            # its open record was lost, or it predates the capture: follow it unsynced
            c = Connection(ev.pid, ev.fd, ev.conn_id, None, synced=False)
            c.last_ts = ev.ts_exit
            self._admit(c)
            self.stats["connections_unannounced"] += 1
        try:
            if c.stream_dir == ev.direction and self._stream_chunk(c, ev):
                return  # what it holds is accounted for there
            self._data_event(c, ev)
            held, c.held = c.held, c.buffered()
            self.buffered_estimate += c.held - held
            if self.buffered_estimate > self.options.max_buffered:
                self._shed(ev.ts_exit)
        except Exception as e:  # a parser bug or a peer we did not foresee: this connection only
            self._contain(c, e, ev.ts_exit)

    def _shed(self, ts: int) -> None:
        """Over the buffer budget: drop the connections holding the most until the
        rest fit (their open requests end in error; counted). The running estimate does not
        subtract connections that went away, so it is recounted first."""
        self.buffered_estimate = sum(c.held for c in self.conns.values())
        if self.buffered_estimate <= self.options.max_buffered:
            return
        for c in sorted(self.conns.values(), key=lambda x: x.held, reverse=True):
            if self.buffered_estimate <= self.options.max_buffered or not c.held:
                break
            del self.conns[c.key]
            self.buffered_estimate -= c.held
            c.close_reason = "dropped: over the tracer's buffer budget"
            self.stats["connections_over_buffer_budget"] += 1
            self._close_guarded(c, ts)

    def _stream_chunk(self, c: Connection, ev: schema.DataEvent) -> bool:
        """``stream_write`` of a decoded event."""
        return self.stream_write(c, ev.tid, ev.ts_exit, ev.direction, ev.flags, ev.offset,
                                 ev.ret, ev.payload, ev.stream_off)

    def stream_write(self, c: Connection, tid: int, ts: int, direction: int, flags: int,
                     offset: int, ret: int, payload: bytes, stream_off: int) -> bool:
        """The common case of a streamed response, taken with fewer steps than
        ``_data_event``: the server's next bytes, in one whole syscall, are exactly one
        whole chunk of a chunked body (one token's SSE event, as LLM servers write them).
        The same effects as the general path, which the tests prove on every capture:
        offsets, the parser's framing (``take_chunk``), the exchange's thread and
        bytes, the follower, what the connection holds for parsing. True: taken;
        False: nothing done, take the general path. The fields are a
        DATA record's (``schema.DataEvent``): ``Pipeline.feed`` calls it with them."""
        inbound = direction == _DIR_IN
        # a TLS connection's plaintext (flagged TLS) is its stream; its ciphertext is not
        tls = c.tls is not None and c.tls.plain
        if ((flags != (_FLAG_TLS_LAST if tls else _FLAG_LAST)) or offset or ret != len(payload)
                or stream_off != c.expected[inbound] or not c.ipc_quiet[inbound]):
            return False
        http = c.http
        d = http._server if http is not None else None
        if d is None or d.msg is None:
            return False
        ex = c.exchanges.get(d.msg.exchange)
        if ex is None:
            return False
        body = d.take_chunk(payload, ts)
        if body is None:
            return False
        c.last_ts = ts
        c.expected[inbound] = stream_off + len(payload)
        rec = ex.rec
        if tid and tid not in rec.tids:
            rec.tids.append(tid)
        rec.response_bytes += len(body)
        f = ex.follower
        # sse_write takes only a whole event with nothing held before it; anything else
        # goes through the parser, and what it holds afterwards is accounted for
        if f is not None and f.sse_write(ts, body):
            if self.runs.arming and not inbound and not tls:
                self.runs.token_chunk(c, d.msg.exchange, f, ts, body)
        elif f is not None:
            before = f.buffered
            f.data(ts, body)
            grown = f.buffered - before
            if grown:
                self.buffered_estimate += grown
                c.held += grown
                if self.buffered_estimate > self.options.max_buffered:
                    self._shed(ts)
        return True

    def token_run(self, run: TokenRun) -> None:
        """A RUN record: token writes the kernel staged (tracer/events/runs.py), taken
        as the DATA records they replace. One whose connection or template is unknown
        (its arm was not seen) is counted; its writes leave a gap in the stream."""
        self._moved_bytes(run.pid, run.tid)
        c = self.conns.get(run.key)
        tmpl = c.runs.arms.get(run.arm) if c is not None and c.runs is not None else None
        if c is None or tmpl is None:
            self.stats["token_runs_unread"] += 1
            self.stats["token_run_writes_unread"] += len(run.lens)
            return
        try:
            take_run(c, run, tmpl[0], tmpl[1], self.data_event, self.stats)
        except Exception as e:  # as data_event would: this connection only
            self._contain(c, e, run.ts[-1])

    def run_armed(self, ev: RunArmed) -> None:
        c = self.conns.get(ev.key)
        if c is not None:
            armed(c, ev)

    def _data_event(self, c: Connection, ev: schema.DataEvent) -> None:
        ts = ev.ts_exit
        c.last_ts = ts
        inbound = ev.inbound
        if ev.tls_plain:
            if c.tls is None or not c.tls.plain:
                self._start_plaintext(c)
        elif ev.cipher or (c.tls is not None and c.tls.plain):
            # the ciphertext of a connection whose plaintext comes from the TLS probes:
            # its place in the stream matters (socket timing), its bytes are not parsed
            if ev.last and ev.ret > 0:
                self.stats["bytes_tls_ciphertext"] += ev.ret
            return
        if ev.error or ev.eof:
            return
        pos = ev.position
        gap = pos - c.expected[inbound]
        if gap > 0:
            self.stats["bytes_lost"] += gap
            self._lost(c, gap, ts, inbound, ev.tid)
        c.expected[inbound] = max(c.expected[inbound], pos + len(ev.payload))
        # bytes this syscall moved past the capture limit: a hole right after this chunk
        missing = ev.ret - ev.offset - len(ev.payload) if ev.last and ev.truncated else 0
        if self.ipc is not None:
            if not c.ipc_seen and c.peer_port and c.local_port:
                c.ipc_seen = True
                self.ipc.connection(c.pid, (c.local_addr, c.local_port),
                                    (c.peer_addr, c.peer_port))
            if ev.payload:
                more = self.ipc.data(c.pid, c.fd, c.conn_id, inbound, ev.payload, ts,
                                     start=c.synced and pos == 0)
                c.ipc_quiet[inbound] = not more and (c.ipc_seen
                                                     or not (c.peer_port and c.local_port))
        if ev.payload:
            self._feed(c, ev, inbound, ts)
        if missing > 0:
            self.stats["bytes_truncated"] += missing
            c.expected[inbound] += missing
            self._lost(c, missing, ts, inbound, ev.tid)

    def _feed(self, c: Connection, ev: schema.DataEvent, inbound: bool, ts: int) -> None:
        if c.proto is None and not self._choose_protocol(c, ev.payload, inbound, ts, ev.tid):
            return
        if c.h2 is not None:
            # TLS plaintext has offsets of its own, not the socket's
            self._emit_h2(c.h2.receive(ev.payload, ts, c.from_client(inbound), ev.tid,
                                       None if ev.tls_plain else ev.position))
            return
        if c.proto != "http1" or c.http is None:
            self.stats[f"bytes_{c.proto or 'unsniffed'}"] += len(ev.payload)
            if c.proto == "tls":
                self._tls_handshake(c, ev.payload, c.from_client(inbound))
            return
        if c.role is not None and c.stream_dir is None:
            c.stream_dir = C["DIR_OUT"] if c.role == "server" else C["DIR_IN"]
        events = c.http.receive(ev.payload, ts, c.from_client(inbound))
        self._dispatch(c, events, ev.tid)

    def _choose_protocol(self, c: Connection, data: bytes, inbound: bool, ts: int,
                         tid: int) -> bool:
        """Decide role (if unknown) and protocol. True once HTTP/1 parsing can start."""
        if not c.synced and tlsproto.looks_like_record(data):
            # TLS records on a connection found open: ciphertext, never a request line
            self._start_tls_wire(c, data, None)
            return False
        if c.role is None and http2.looks_like_frames(data):
            # Found open at attach, HTTP/2: the sender of :method is the client.
            sender = http2.header_block_sender(data)
            if sender is not None:
                c.role = "server" if (sender == "client") == inbound else "client"
                self._start_h2(c, synced=False)
                return True
        if c.role is None:
            # Found open at attach: whoever sends a request line is the client.
            idx = detect.find_request_line(data)
            if idx >= 0:
                c.role = "server" if inbound else "client"
            elif detect.sniff(data) == detect.HTTP1_RESPONSE:
                c.role = "client" if inbound else "server"
            else:
                self.stats["bytes_unsniffed"] += len(data)
                c.unsniffed += len(data)
                if c.unsniffed > HUNT_GIVE_UP:
                    c.proto = "opaque"  # not HTTP/1 as far as we looked: stop looking
                    self.stats["connections_opaque"] += 1
                return False
            c.proto = "http1"
            c.http = http1.HTTP1Connection(synced=False, stats=self.stats)
            return True
        if not c.synced and http2.looks_like_frames(data):
            self._start_h2(c, synced=False)
            return True
        if not c.synced:
            c.proto = "http1"
            c.http = http1.HTTP1Connection(synced=False, stats=self.stats)
            return True
        if not c.from_client(inbound):
            if http2.server_settings_first(data):  # an HTTP/2 server may not wait
                self._start_h2(c, synced=True)
                return True
            c.proto = "opaque"  # the server spoke first: not HTTP
            return False
        if not c.sniff_buf:
            c.sniff_ts = ts
        held = c.sniff_buf + data
        kind = detect.sniff(held[:SNIFF_MAX])
        if kind == detect.NEED_MORE:
            c.sniff_buf = held
            return False
        c.sniff_buf = b""
        if kind == detect.HTTP1_REQUEST:
            c.proto = "http1"
            c.http = http1.HTTP1Connection(synced=True, stats=self.stats)
            if len(held) > len(data):
                # fragments were held back while sniffing: the request began with them
                self._dispatch(c, c.http.receive(held, c.sniff_ts, True), tid)
                return False
            return True
        if kind == detect.HTTP2_PREFACE:
            self._start_h2(c, synced=True)
            self._emit_h2(c.h2.receive(held, c.sniff_ts, True, tid))  # type: ignore[union-attr]
            return False
        if kind == detect.TLS:
            self._start_tls_wire(c, held, True)
            return False
        c.proto = "opaque"
        self.stats["connections_opaque"] += 1
        return False

    # ---- TLS --------------------------------------------------------------------

    def tls_event(self, ev: TlsEvent) -> None:
        """An SSL object tied to a socket, established or freed (bpf/tls.c)."""
        self.stats[f"tls_events.{ev.op}"] += 1
        c = self.conns.get(ev.key)
        if c is None:
            if ev.op != "bind" or ev.fd < 0:
                return
            c = Connection(ev.pid, ev.fd, ev.conn_id, None, synced=False)
            c.last_ts = ev.ts
            self._admit(c)
            self.stats["connections_unannounced"] += 1
        t = c.tls = c.tls or TlsConn()
        if ev.op == "bind":
            if t.plain and t.ssl != ev.ssl:
                # another SSL object on this socket: its plaintext stream starts over
                t.plain = False
                self.stats["tls_rebinds"] += 1
            t.ssl, t.bound, t.fresh = ev.ssl, True, ev.fresh
            t.established = t.established or ev.established
            self.stats[f"tls_binds.{ev.via}"] += 1
        elif ev.op == "established":
            t.established = True
        elif ev.op == "free":
            t.failed = t.failed or ev.failed

    def _start_tls_wire(self, c: Connection, data: bytes, from_client: bool | None) -> None:
        """TLS records seen on the socket: read the hellos; never parse them as HTTP."""
        c.proto = "tls"
        c.sniff_buf = b""
        self.stats["connections_tls"] += 1
        t = c.tls = c.tls or TlsConn()
        if from_client is not None and c.synced:
            t.reader = tlsproto.HandshakeReader()
            self._tls_handshake(c, data, from_client)

    def _tls_handshake(self, c: Connection, data: bytes, from_client: bool) -> None:
        t = c.tls
        if t is None or t.reader is None:
            return
        t.reader.receive(data, from_client)
        if t.reader.done:
            if t.reader.malformed:
                self.stats["tls_handshakes_unreadable"] += 1
            t.session, t.reader = t.reader.session, None

    def _start_plaintext(self, c: Connection) -> None:
        """The TLS probes' plaintext arrived: from now on it is what the parsers read,
        from its own stream offset 0 (whatever was sniffed of the ciphertext is
        dropped). Seen from the object's setup, it is synced from its first byte."""
        t = c.tls = c.tls or TlsConn()
        if t.reader is not None:
            t.session, t.reader = t.reader.session, None
        t.plain = True
        if c.h2 is not None:
            self._emit_h2(c.h2.close(c.last_ts, "TLS plaintext replaced this stream"))
        c.proto, c.http, c.h2 = None, None, None
        c.sniff_buf, c.unsniffed = b"", 0
        c.expected = {True: 0, False: 0}
        c.synced = t.fresh
        if self.ipc is not None:  # the process graph follows the plaintext, from its start
            self.ipc.closed(c.pid, c.fd, c.conn_id)
            c.ipc_quiet = {True: False, False: False}
        self.stats["tls_connections_decrypted"] += 1

    def _tls_outcome(self, c: Connection) -> None:
        """Count, once, what became of a TLS connection whose plaintext was not read."""
        t = c.tls
        if t is None or t.counted or t.plain:
            return
        t.counted = True
        if t.failed or (t.bound and not t.established):
            self.stats["tls_handshakes_failed"] += 1
        elif not t.bound and c.proto == "tls":
            # TLS on the wire, no SSL object of the process ever tied to it: its TLS
            # library is not probed (BoringSSL in grpcio, another version or library)
            self.stats["tls_connections_unseen"] += 1

    def _start_h2(self, c: Connection, synced: bool) -> None:
        c.proto = "http2"
        c.h2 = H2Calls(c, self.options, synced, self.stats, self.arrivals.add)
        self.stats["connections_http2"] += 1

    def _lost(self, c: Connection, nbytes: int, ts: int, inbound: bool, tid: int) -> None:
        if c.h2 is not None:
            self._emit_h2(c.h2.lost(nbytes, ts, c.from_client(inbound), tid))
        if c.http is None:
            return
        self._dispatch(c, c.http.lost(nbytes, ts, c.from_client(inbound)), tid)

    def _close_guarded(self, c: Connection, ts: int) -> None:
        """``_close`` of a connection already removed from ``conns``, contained."""
        try:
            self._close(c, ts)
        except Exception as e:
            self._contain(c, e, ts)
        if self.ipc is not None:
            self.ipc.closed(c.pid, c.fd, c.conn_id)

    def contain(self, c: Connection, e: Exception, ts: int) -> None:
        """What data_event does when a parser raised on ``c``'s bytes."""
        self._contain(c, e, ts)

    def _contain(self, c: Connection, e: Exception, ts: int) -> None:
        """A parser raised on ``c``: count it, end its open requests in error, and let
        its parsers start over from the next message they can find."""
        count_parser_error(self.stats, e)
        reason = (f"tracer parser error on this connection ({error_source(e)}: "
                  f"{type(e).__name__})")
        exchanges, c.exchanges = list(c.exchanges.values()), {}
        h2, c.h2 = c.h2, None
        for ex in exchanges:
            self._emit_guarded(lambda ex=ex: self._finished(ex, ts, reason, True))
        if h2 is not None:
            for rec in h2.abort(ts, reason):
                self._emit_guarded(lambda rec=rec: rec)
        if self.conns.get(c.key) is not c:
            return  # it was closing anyway
        if c.proto == "http1":
            numbered = c.http.next_request if c.http is not None else 0
            c.http = http1.HTTP1Connection(synced=False, stats=self.stats)
            # go on numbering: a record of the next request must not take the key of
            # one ended here and still held (by the GPU attribution, the net timing)
            c.http.next_request = numbered
        elif h2 is not None:
            c.h2 = H2Calls(c, self.options, False, self.stats, self.arrivals.add)
        else:
            c.proto, c.http = "opaque", None  # failed while sniffing: stop looking
        self.stats["connections_reset_after_error"] += 1

    def _emit_guarded(self, make: Callable[[], RequestRecord]) -> None:
        try:
            self._emit(make())
        except Exception as e:
            count_parser_error(self.stats, e)
            self.stats["records_dropped_after_error"] += 1

    def _close(self, c: Connection, ts: int) -> None:
        self._tls_outcome(c)
        if c.http is not None:
            self._dispatch(c, c.http.close(ts), 0)
        if c.h2 is not None:
            self._emit_h2(c.h2.close(ts, c.close_reason))
        for ex in list(c.exchanges.values()):
            self._finish(c, ex, ts, c.close_reason or "connection closed before the response")

    # ---- parser events -> records -------------------------------------------------

    def _dispatch(self, c: Connection, events: list[http1.Event], tid: int) -> None:
        for e in events:
            if type(e) is http1.Data:  # the most frequent, first
                ex = c.exchanges.get(e.exchange)
                if ex is None:
                    continue
                if tid and tid not in ex.rec.tids:
                    ex.rec.tids.append(tid)
                if e.from_client:
                    ex.request_data(e.data)
                else:
                    ex.response_data(e.ts, e.data)
                continue
            if isinstance(e, http1.Request):
                ex = Exchange(c, e, self.options)
                c.exchanges[e.exchange] = ex
                self.arrivals.add(ex.rec)
                if tid:
                    ex.add_tid(tid)
                continue
            if isinstance(e, http1.ProtocolError):
                self.stats["http_protocol_errors"] += 1
                continue
            ex = c.exchanges.get(getattr(e, "exchange", -1))
            if ex is None:
                if isinstance(e, http1.Response):
                    self.stats["responses_unpaired"] += 1
                continue
            if tid:
                ex.add_tid(tid)
            if isinstance(e, http1.Data):
                if e.from_client:
                    ex.request_data(e.data)
                else:
                    ex.response_data(e.ts, e.data)
            elif isinstance(e, http1.EndOfMessage):
                if e.from_client:
                    ex.request_end(e.ts, e.incomplete)
                else:
                    self._finish(c, ex, e.ts, None, incomplete=e.incomplete)
            elif isinstance(e, http1.Response):
                ex.response(e)
            elif isinstance(e, http1.Abandoned):
                self._finish(c, ex, e.ts, c.close_reason or e.reason, incomplete=True)
            elif isinstance(e, http1.Upgraded):
                self._finish(c, ex, e.ts, None)
                c.proto = f"upgraded:{e.protocol}"

    def _emit_h2(self, records: list[RequestRecord]) -> None:
        for rec in records:
            self._emit(rec)

    def _finish(self, c: Connection, ex: Exchange, ts: int, error: str | None,
                incomplete: bool = False) -> None:
        c.exchanges.pop(ex.rec.exchange, None)
        self._emit(self._finished(ex, ts, error, incomplete))

    def _finished(self, ex: Exchange, ts: int, error: str | None, incomplete: bool
                  ) -> RequestRecord:
        """``ex.finish``; if that fails, the record as it stands, ended in error."""
        try:
            return ex.finish(ts, error, incomplete)
        except Exception as e:
            count_parser_error(self.stats, e)
            rec = ex.rec
            rec.end_ns = max(ts, rec.start_ns)
            rec.response_incomplete = True
            rec.error = (f"tracer parser error on this request ({error_source(e)}: "
                         f"{type(e).__name__})")
            return rec

    def _emit(self, rec: RequestRecord) -> None:
        rec.process = self.processes.get(rec.pid)
        self.stats["requests"] += 1
        if rec.error:
            self.stats["requests_failed"] += 1
        self.emit(rec)
