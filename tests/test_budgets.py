"""Memory a peer cannot grow: the peer's maximum frame size enforced, open HTTP/2 streams
capped and expired, connections capped; every eviction counted."""

from __future__ import annotations

from collections import Counter

from protocols import grpc, http2
from tests.h2wire import Wire, frame, grpc_message
from tests.test_tracker import Feed, serve
from tracer.correlate.connections import ConnectionTracker, TrackerOptions
from tracer.correlate.ipc import IpcGraph
from tracer.events import schema, wire

C = wire.CONSTANTS


def feed(conn, chunks):
    out = []
    for i, (fc, data) in enumerate(chunks):
        out += conn.receive(data, (i + 1) * 1000, fc)
    return out


def test_a_frame_over_the_peers_maximum_is_an_error_not_a_buffer():
    w = Wire()
    sid = w.request("/pkg.S/M", end=False)
    stats: Counter[str] = Counter()
    obs = http2.H2Observer(stats=stats)
    feed(obs, w.chunks)
    # 16 MiB announced, 64 KiB sent: over the 16 KiB nobody raised
    events = obs.receive(frame(http2.DATA, 0, sid, b"x" * 65536), 9999, True)
    assert any(isinstance(e, http2.ProtocolError) and "over the peer's maximum" in e.message
               for e in events)
    assert stats["http2_frames_over_max_size"] == 1
    assert len(obs.sides[True].buf) <= http2.UNSYNCED_KEEP


def test_a_frame_the_peer_allowed_is_followed():
    w = Wire(server_settings={5: 1 << 20})  # SETTINGS_MAX_FRAME_SIZE: 1 MiB from the server
    w.server.max_inbound_frame_size = w.server.incoming_buffer.max_frame_size = 1 << 20
    sid = w.request("/pkg.S/M", body=grpc_message(b"q" * 60_000))
    w.respond(sid, [grpc_message(b"a")])
    assert max(len(d) for c, d in w.chunks if c) > 60_000  # one DATA frame over 16 KiB
    conn = grpc.GrpcConnection()
    events = feed(conn, w.chunks)
    (call,) = [e.call for e in events if isinstance(e, grpc.CallEnded)]
    assert call.request_bytes == 60_005 and call.grpc_status == 0
    assert conn.stats["http2_protocol_errors"] == 0


def test_open_streams_are_capped_least_recently_active_first(monkeypatch):
    monkeypatch.setattr(grpc, "MAX_STREAMS", 4)
    w = Wire()
    sids = [w.request("/pkg.S/M", end=False) for _ in range(6)]
    conn = grpc.GrpcConnection()
    events = feed(conn, w.chunks)
    ended = [e.call for e in events if isinstance(e, grpc.CallEnded)]
    assert [c.stream_id for c in ended] == sids[:2]
    assert all("too many open streams" in c.error for c in ended)
    assert len(conn.streams) == 4 and conn.stats["grpc_streams_evicted"] == 2


def test_idle_streams_expire_and_damaged_ones_sooner():
    w = Wire()
    a = w.request("/pkg.S/A", end=False)
    b = w.request("/pkg.S/B", end=False)
    conn = grpc.GrpcConnection()
    feed(conn, w.chunks)
    conn._lost(http2.Lost(5000, True, 10, b))  # b lost bytes: its end may be gone
    last = max(st.last_ts for st in conn.streams.values())
    (e,) = conn.expire(last + 50, idle_ns=10_000, damaged_idle_ns=10)
    assert e.call.stream_id == b
    (e,) = conn.expire(last + 20_000, idle_ns=10_000, damaged_idle_ns=10)
    assert e.call.stream_id == a and "idle past" in e.call.error and e.call.response_incomplete
    assert conn.stats["grpc_streams_expired"] == 2 and not conn.streams


def test_the_tracker_expires_streams_into_records():
    w = Wire()
    w.request("/pkg.S/M", body=grpc_message(b"q"), end=False)
    records = []
    t = ConnectionTracker(records.append)
    pos = {True: 0, False: 0}
    t.conn_event(schema.ConnEvent(1, 1, 7, 1, 9, C["CONN_ACCEPT"], 0, 0, 3, 2, "127.0.0.1", 1))
    for i, (fc, data) in enumerate(w.chunks):
        t.data_event(schema.DataEvent(1, 1, 7, 9, 10 + i, 10 + i, len(data), 0, C["SYS_READ"],
                                      C["DIR_IN"] if fc else C["DIR_OUT"], C["FLAG_LAST"],
                                      data, stream_off=pos[fc]))
        pos[fc] += len(data)
    t.expire(10**9)  # within the connection's timeout, past no stream's
    assert not records
    t.expire(10 + t.options.stream_idle_timeout_ns + 100)
    (rec,) = records
    assert rec.protocol == "grpc" and "idle past" in rec.error


def test_connections_past_the_cap_are_dropped_oldest_first_and_counted():
    records = []
    ipc = IpcGraph()
    t = ConnectionTracker(records.append, TrackerOptions(max_connections=10), ipc=ipc)
    for fd in range(25):
        t.conn_event(schema.ConnEvent(1, 1, fd, fd, 100 + fd, C["CONN_ACCEPT"], 0, 0, 3, 2,
                                      "127.0.0.1", 1000 + fd))
        t.data_event(schema.DataEvent(1, 1, fd, 100 + fd, fd, fd, 18, 0, C["SYS_READ"],
                                      C["DIR_IN"], C["FLAG_LAST"], b"GET / HTTP/1.1\r\n\r\n"))
    assert len(t.conns) <= 10 and t.stats["connections_evicted"] >= 15
    assert {c.fd for c in t.conns.values()} >= {24, 23}  # the newest stay
    assert len(records) == t.stats["connections_evicted"]  # each open request ended, counted
    assert all("too many connections" in r.error for r in records)
    assert len(ipc._heads) <= 10  # the evicted connections' first bytes are forgotten


def test_process_exit_forgets_the_process_graph_heads():
    f = Feed()
    f.t.ipc = ipc = IpcGraph()
    f.data(True, b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert ipc._heads
    f.t.process_exit(100, f.ts + 1)
    assert not ipc._heads and not f.t.conns


def test_normal_traffic_evicts_nothing():
    f = Feed()
    for _ in range(3):
        serve(f)
    assert not [k for k in f.t.stats if "evicted" in k or "over" in k or "parser" in k]
    assert len(f.records) == 3


def test_bytes_held_by_all_connections_stay_under_the_buffer_budget():
    """Forty clients each send half of a 1 MiB chat body and one a small whole request:
    with a 4 MiB budget the connections holding the most are dropped (their requests end
    in error, counted) and what all hold together never passes the budget."""
    records = []
    budget = 4 << 20
    t = ConnectionTracker(records.append, TrackerOptions(max_buffered=budget))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (1 << 20)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (len(body) + 4)
    peak = 0
    for fd in range(40):
        t.conn_event(schema.ConnEvent(1, 1, fd, fd, 100 + fd, C["CONN_ACCEPT"], 0, 0, 3, 2,
                                      "127.0.0.1", 1000 + fd))
        part = head + body[: len(body) // 2]
        t.data_event(schema.DataEvent(1, 1, fd, 100 + fd, 10 + fd, 11 + fd, len(part), 0,
                                      C["SYS_READ"], C["DIR_IN"], C["FLAG_LAST"], part))
        peak = max(peak, sum(c.buffered() for c in t.conns.values()))
    assert peak <= budget
    dropped = t.stats["connections_over_buffer_budget"]
    assert dropped >= 40 - budget // (len(body) // 2) and dropped < 40
    assert len(records) == dropped and all("buffer budget" in r.error for r in records)
    # a small request on a new connection is still traced whole
    f_fd = 99
    t.conn_event(schema.ConnEvent(1, 1, f_fd, 200, 999, C["CONN_ACCEPT"], 0, 0, 3, 2,
                                  "127.0.0.1", 2000))
    t.data_event(schema.DataEvent(1, 1, f_fd, 999, 201, 202, 18, 0, C["SYS_READ"],
                                  C["DIR_IN"], C["FLAG_LAST"], b"GET / HTTP/1.1\r\n\r\n"))
    assert (1, f_fd, 999) in t.conns


def test_grpc_messages_count_against_the_buffer_budget():
    """Unfinished gRPC messages on many connections are held bytes too."""
    records = []
    t = ConnectionTracker(records.append, TrackerOptions(max_buffered=1 << 18))
    for fd in range(8):
        w = Wire()
        sid = w.request("/pkg.S/M", end=False)
        msg = grpc_message(b"q" * 300_000)[:60_000]  # a 300 kB message, 60 kB of it sent
        for i in range(0, len(msg), 16_000):
            w.client.send_data(sid, msg[i:i + 16_000])
            w.pump()
        t.conn_event(schema.ConnEvent(1, 1, fd, fd, 100 + fd, C["CONN_ACCEPT"], 0, 0, 3, 2,
                                      "127.0.0.1", 1000 + fd))
        off = {True: 0, False: 0}
        for i, (fc, data) in enumerate(w.chunks):
            t.data_event(schema.DataEvent(1, 1, fd, 100 + fd, 10 + i, 11 + i, len(data), 0,
                                          C["SYS_READ"], C["DIR_IN"] if fc else C["DIR_OUT"],
                                          C["FLAG_LAST"], data, stream_off=off[fc]))
            off[fc] += len(data)
        assert sum(c.buffered() for c in t.conns.values()) <= 1 << 18
    assert t.stats["connections_over_buffer_budget"] >= 3
