"""HTTP/2 connections to records: one ``RequestRecord`` per stream (gRPC call).

``H2Calls`` is what ``ConnectionTracker`` keeps for a connection it chose HTTP/2 for.
It runs ``protocols.grpc.GrpcConnection`` over the bytes, starts a record at each
call's request headers, hands KServe v2 inference calls' messages to
``protocols.kserve.KServeFollower`` (the LLM layer), and returns each record when its
call ends. Any other gRPC service is traced generically (service, method, status,
message counts); a stream that is not gRPC is an HTTP/2 request record.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol

from protocols import grpc, kserve
from tracer.correlate.records import SAFE_HEADERS, RequestRecord, tenant_of


class ConnectionView(Protocol):
    """What a call's record takes from its connection (``connections.Connection``)."""

    pid: int
    fd: int
    conn_id: int
    role: str | None
    family: int
    local_addr: str
    local_port: int
    peer_addr: str
    peer_port: int


class CallOptions(Protocol):
    """The tracker options calls need (``connections.TrackerOptions``)."""

    keep_content: bool
    tenant_salt: bytes | None
    secrets_masked: bool

SAFE_GRPC_HEADERS = SAFE_HEADERS | {"grpc-timeout", "grpc-encoding", "grpc-accept-encoding",
                                    "te", ":authority", ":scheme"}


class H2Calls:
    """Calls of one HTTP/2 connection in, finished records out."""

    def __init__(self, conn: ConnectionView, options: CallOptions, synced: bool,
                 stats: Counter[str],
                 opened: Callable[[RequestRecord], None] | None = None) -> None:
        """``opened(rec)``: told each call's record as it starts."""
        self.conn = conn
        self.opened = opened
        self.options = options
        self.grpc = grpc.GrpcConnection(synced, stats)
        self.records: dict[int, RequestRecord] = {}
        self.followers: dict[int, kserve.KServeFollower] = {}

    def receive(self, data: bytes, ts: int, from_client: bool, tid: int,
                offset: int | None = None) -> list[RequestRecord]:
        """Bytes one endpoint sent; ``offset``: their place in its byte stream (the
        DATA record's), where they are the socket's own bytes."""
        return self._calls(self.grpc.receive(data, ts, from_client, offset), tid)

    def lost(self, nbytes: int, ts: int, from_client: bool, tid: int) -> list[RequestRecord]:
        return self._calls(self.grpc.lost(nbytes, ts, from_client), tid)

    def close(self, ts: int, reason: str | None) -> list[RequestRecord]:
        return self._calls(self.grpc.close(ts, reason or "connection closed before the call "
                                                         "ended"), 0)

    @property
    def open_calls(self) -> int:
        return len(self.records)

    def expire(self, ts: int, idle_ns: int, damaged_idle_ns: int) -> list[RequestRecord]:
        """Records of the calls ended for being idle (see ``GrpcConnection.expire``)."""
        return self._calls(self.grpc.expire(ts, idle_ns, damaged_idle_ns), 0)

    def abort(self, ts: int, reason: str) -> list[RequestRecord]:
        """Give up on every open call (a parser failed on this connection): their
        records, ended in error with what was known so far."""
        out = []
        for sid, rec in list(self.records.items()):
            rec.end_ns = max(ts, rec.start_ns)
            rec.error = reason
            rec.response_incomplete = True
            f = self.followers.get(sid)
            if f is not None:
                try:
                    rec.llm_request, rec.llm_response = f.end(ts)
                    rec.llm_start_ns = f.request_ts
                except Exception:  # the follower may be what failed: keep the record
                    self.grpc.stats["llm_fields_dropped_after_error"] += 1
            out.append(rec)
        self.records.clear()
        self.followers.clear()
        return out

    def _calls(self, events: list[grpc.CallEvent], tid: int) -> list[RequestRecord]:
        done: list[RequestRecord] = []
        for e in events:
            call = e.call
            sid = call.stream_id
            if isinstance(e, grpc.CallStarted):
                rec = self.records[sid] = self._start(call)
                if self.opened is not None:
                    self.opened(rec)
                svc, meth = call.service_method
                if call.is_grpc and kserve.is_kserve(svc, meth) and meth is not None:
                    self.followers[sid] = kserve.KServeFollower(meth, self.options.keep_content)
            rec = self.records.get(sid)
            if rec is None:
                continue
            if isinstance(e, grpc.CallRecognised):
                # gRPC by its framing, its :path unknown: maybe KServe, told by its
                # messages (KServeFollower with no method)
                rec.protocol = "grpc"
                self.followers[sid] = kserve.KServeFollower(None, self.options.keep_content)
            if tid and tid not in rec.tids:
                rec.tids.append(tid)
            f = self.followers.get(sid)
            if isinstance(e, grpc.CallMessage) and f is not None:
                m = e.message
                if m.from_client:
                    f.request_message(m.ts, m.data, m.unreadable, m.first_ts)
                else:
                    f.response_message(m.ts, m.data)
                if f.rejected:
                    self.grpc.stats["kserve_inferred_rejected"] += 1
                    del self.followers[sid]
                elif f.inferred and f.method is not None and call.inferred_path is None:
                    call.inferred_path = f"/{kserve.SERVICE}/{f.method}"
                    rec.target = call.inferred_path
                    self.grpc.stats["kserve_methods_inferred"] += 1
            elif isinstance(e, grpc.CallResponseHeaders):
                rec.response_start_ns = call.response_start_ns
                rec.status = call.http_status
            elif isinstance(e, grpc.CallEnded):
                done.append(self._end(rec, call, f))
                del self.records[sid]
                self.followers.pop(sid, None)
        return done

    def _start(self, call: grpc.Call) -> RequestRecord:
        c = self.conn
        h = call.request_headers
        return RequestRecord(
            pid=c.pid, fd=c.fd, conn_id=c.conn_id, exchange=call.stream_id,
            role=c.role or "server", protocol="grpc" if call.is_grpc else "http/2",
            method=h.get(":method", ""), target=h.get(":path", ""), http_version="2",
            start_ns=call.start_ns,
            # a server's inbound offsets are its socket's, as the arrivals' are
            start_off=call.start_off if (c.role or "server") == "server" else None,
            request_headers={k: v for k, v in h.items() if k in SAFE_GRPC_HEADERS},
            tenant=tenant_of(h, self.options.tenant_salt, self.options.secrets_masked),
            family=c.family, local_addr=c.local_addr,
            local_port=c.local_port, peer_addr=c.peer_addr, peer_port=c.peer_port, rpc=call,
            tls=getattr(c, "tls_session", None),
        )

    def _end(self, rec: RequestRecord, call: grpc.Call, f: kserve.KServeFollower | None
             ) -> RequestRecord:
        assert call.end_ns is not None
        rec.end_ns = call.end_ns
        rec.request_end_ns = call.request_end_ns
        rec.response_start_ns = call.response_start_ns
        rec.status = call.http_status
        rec.request_bytes = call.request_bytes
        rec.response_bytes = call.response_bytes
        rec.request_incomplete = call.request_incomplete
        rec.response_incomplete = call.response_incomplete
        rec.response_headers = {k: v for k, v in call.response_headers.items()
                                if k in ("content-type", "grpc-encoding")}
        rec.error = call.error
        if not self.options.keep_content:
            call.grpc_message = None  # the server's error text can echo the prompt
        if f is not None:
            rec.llm_request, rec.llm_response = f.end(call.end_ns)
            rec.llm_start_ns = f.request_ts
        return rec
