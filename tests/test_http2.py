"""The HTTP/2 observer on real bytes: hyper-h2 endpoints in memory, hand-made frames,
a mid-connection attach, fuzzed and truncated input, and a real capture."""

from __future__ import annotations

import json
import random
import struct

from hpack import Encoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import http2
from protocols.hpack_partial import PartialDecoder
from tests.conftest import CAPTURES, capture_streams
from tests.h2wire import Wire, frame, grpc_message
from tracer.correlate.connections import ConnectionTracker
from tracer.events import capture, schema


def observe(chunks, synced=True, obs=None):
    obs = obs or http2.H2Observer(synced)
    events = []
    for i, (fc, data) in enumerate(chunks):
        events += obs.receive(data, i, fc)
    return obs, events


def headers_of(events, from_client=None):
    return [e for e in events if isinstance(e, http2.Headers)
            and (from_client is None or e.from_client == from_client)]


def test_preface_settings_headers_data_trailers():
    w = Wire()
    sid = w.request("/pkg.Svc/Call", body=grpc_message(b"hello"))
    w.respond(sid, [grpc_message(b"world")], status=0)
    obs, ev = observe(w.chunks)
    assert isinstance(ev[0], http2.Preface)
    settings_ = [e for e in ev if isinstance(e, http2.Settings)]
    assert {e.from_client for e in settings_ if not e.ack} == {True, False}
    assert any(e.ack for e in settings_)
    req, resp, trailers = headers_of(ev)
    assert dict(req.headers)[":path"] == "/pkg.Svc/Call" and req.from_client
    assert dict(resp.headers)[":status"] == "200" and not resp.end_stream
    assert dict(trailers.headers)["grpc-status"] == "0" and trailers.end_stream
    data = [e for e in ev if isinstance(e, http2.Data)]
    assert [(e.from_client, e.data) for e in data] == [(True, grpc_message(b"hello")),
                                                      (False, grpc_message(b"world"))]
    assert data[0].end_stream and all(e.stream_id == sid for e in data)
    assert obs.stats["http2_header_blocks_undecodable"] == 0


def test_hpack_dynamic_table_with_eviction_and_table_size_setting():
    """Large, varied headers through a 256-byte table (the server's
    SETTINGS_HEADER_TABLE_SIZE): entries are evicted all the time, and every block
    still decodes exactly."""
    rng = random.Random(5)
    w = Wire(server_settings={1: 256})
    sent = []
    for i in range(60):
        extra = [(f"x-k{rng.randint(0, 9)}", "v" * rng.randint(1, 300)),
                 ("x-tenant", f"t{rng.randint(0, 3)}"), ("x-i", str(i))]
        sid = w.request(f"/pkg.Svc/M{i % 4}", extra, body=grpc_message(b"x"))
        sent.append((sid, extra))
        w.respond(sid, [grpc_message(b"y")], extra=[("x-r", "r" * rng.randint(0, 200))])
    obs, ev = observe(w.chunks)
    reqs = {e.stream_id: e for e in headers_of(ev, True)}
    for sid, extra in sent:
        assert reqs[sid].unknown_fields == 0
        assert [h for h in reqs[sid].headers if h[0].startswith("x-")] == extra
    assert obs.sides[True].hpack.header_table_size == 256  # the size update was applied
    assert obs.stats["http2_header_blocks_undecodable"] == 0


def test_continuation_frames_carry_a_large_header_block():
    w = Wire()
    big = [(f"x-big-{i}", "z" * 1000) for i in range(40)]  # 40 KB: HEADERS + CONTINUATIONs
    sid = w.request("/pkg.Svc/Big", big)
    w.respond(sid, [], status=0)
    raw = w.client_bytes()
    assert any(raw[j + 3] == http2.CONTINUATION for j in _frame_offsets(raw[24:], 24))
    obs, ev = observe(w.chunks)
    (req,) = headers_of(ev, True)
    assert [h for h in req.headers if h[0].startswith("x-big")] == big


def _frame_offsets(buf, base=0):
    j = 0
    while j + 9 <= len(buf):
        yield base + j
        j += 9 + http2.parse_frame_header(buf, j)[0]


def test_padding_and_priority_fields_are_removed():
    enc = Encoder()
    block = enc.encode([(":method", "POST"), (":path", "/a.B/C"), (":scheme", "http"),
                        ("content-type", "application/grpc")])
    padded_headers = bytes([7]) + struct.pack(">IB", 0, 16) + block + b"\0" * 7
    client = (http2.PREFACE + frame(http2.SETTINGS, 0, 0, b"")
              + frame(http2.HEADERS, http2.END_HEADERS | http2.PADDED | http2.PRIORITY_FLAG, 1,
                      padded_headers)
              + frame(http2.DATA, http2.PADDED | http2.END_STREAM, 1, bytes([3]) + b"abc" + b"\0\0\0"))
    _, ev = observe([(True, client)])
    (h,) = headers_of(ev)
    assert dict(h.headers)[":path"] == "/a.B/C" and h.unknown_fields == 0
    (d,) = [e for e in ev if isinstance(e, http2.Data)]
    assert d.data == b"abc" and d.flow_length == 7 and d.end_stream
    bad = frame(http2.DATA, http2.PADDED, 1, bytes([9]) + b"ab")
    _, ev = observe([(True, client), (True, bad)])
    assert any(isinstance(e, http2.ProtocolError) for e in ev)


def _split(chunks, rng):
    out = []
    for fc, data in chunks:
        pos = 0
        while pos < len(data):
            n = rng.randint(1, 64)
            out.append((fc, data[pos:pos + n]))
            pos += n
    return out


def test_interleaved_streams_split_at_every_size_keep_their_bytes():
    rng = random.Random(3)
    w = Wire()
    sids = [w.request(f"/pkg.Svc/S{i}", body=grpc_message(bytes([i]) * (i * 50)), end=False)
            for i in range(100)]
    expected = {sid: bytearray() for sid in sids}
    started = set()
    for _ in range(400):
        sid = rng.choice(sids)
        if sid not in started:
            w.server.send_headers(sid, [(b":status", b"200")])
            started.add(sid)
        m = grpc_message(str(sid).encode() * rng.randint(1, 40))
        expected[sid] += m
        w.server.send_data(sid, m)
        w.pump()
    _, whole = observe(w.chunks)
    _, split = observe(_split(w.chunks, rng))
    got = {sid: bytearray() for sid in sids}
    for e in split:
        if isinstance(e, http2.Data) and not e.from_client:
            got[e.stream_id] += e.data
    assert got == expected
    strip = lambda evs: [(type(e).__name__, getattr(e, "stream_id", None), getattr(e, "data", None))
                         for e in evs]
    assert strip(whole) == strip(split)


def test_reset_goaway_window_update_and_ping():
    w = Wire()
    sid = w.request("/pkg.Svc/Long", body=grpc_message(b"q"))
    w.client.reset_stream(sid, error_code=8)
    w.client.increment_flow_control_window(1000)
    w.client.ping(b"12345678")
    w.pump()
    w.server.close_connection(error_code=0, last_stream_id=sid)
    w.pump()
    _, ev = observe(w.chunks)
    (rst,) = [e for e in ev if isinstance(e, http2.StreamReset)]
    assert (rst.stream_id, rst.error_code, rst.from_client) == (sid, 8, True)
    assert any(isinstance(e, http2.WindowUpdate) and e.increment == 1000 for e in ev)
    pings = [e for e in ev if isinstance(e, http2.Ping)]
    assert [(p.ack, p.opaque) for p in pings] == [(False, b"12345678"), (True, b"12345678")]
    (ga,) = [e for e in ev if isinstance(e, http2.GoAway)]
    assert (ga.last_stream_id, ga.error_code, ga.from_client) == (sid, 0, False)


def _conversation(n, rng, new_names_after=None):
    """n gRPC calls with headers that repeat (dynamic table references) and, after
    call ``new_names_after``, headers never sent before (literals)."""
    w = Wire()
    truth = {}
    marks = []
    for i in range(n):
        extra = [("x-tenant", f"t{i % 3}"), ("x-seq", str(i))]
        if new_names_after is not None and i >= new_names_after:
            extra.append((f"x-new-{i}", f"v{i}"))
        path = f"/pkg.Svc/M{i % 2}" if new_names_after is None or i < new_names_after \
            else f"/pkg.Svc/Fresh{i}"
        marks.append(len(w.chunks))
        sid = w.request(path, extra, body=grpc_message(b"p" * rng.randint(1, 3000)))
        w.respond(sid, [grpc_message(b"r" * rng.randint(1, 3000))])
        truth[sid] = {("path", path)} | set(extra)
    return w, truth, marks


def test_attach_mid_connection_decodes_what_it_can_and_never_guesses():
    rng = random.Random(2)
    w, truth, marks = _conversation(30, rng, new_names_after=20)
    start = marks[10] + 1  # attach after the first chunk of call 10: mid-conversation
    obs, ev = observe(w.chunks[start:], synced=False)
    reqs = headers_of(ev, True)
    assert reqs, "later requests are seen"
    decoded_paths = 0
    for h in reqs:
        sent = truth[h.stream_id]
        for name, value in h.headers:
            if name == ":path":
                assert ("path", value) in sent
                decoded_paths += 1
            elif name.startswith("x-"):
                assert (name, value) in sent, "a decoded field is one that was sent"
    # repeated headers refer to entries inserted before the attach: unknown, counted
    assert obs.stats["http2_header_blocks_undecodable"] > 0
    assert obs.stats["http2_header_fields_unknown"] >= 1
    # every call after the switch to fresh paths has a literal :path: decoded
    assert decoded_paths >= 10


def test_attach_in_the_middle_of_a_frame_resynchronises():
    rng = random.Random(4)
    w, truth, _ = _conversation(12, rng)
    client = w.client_bytes()
    for cut in (24 + 5, len(client) // 3, len(client) // 2 + 7):
        obs = http2.H2Observer(synced=False)
        ev = []
        pos = cut
        while pos < len(client):
            n = rng.randint(1, 5000)
            ev += obs.receive(client[pos:pos + n], pos, True)
            pos += n
        data = [e for e in ev if isinstance(e, http2.Data)]
        assert data and all(e.stream_id in truth for e in data)
        for h in headers_of(ev):
            assert h.stream_id in truth
        assert obs.stats["http2_resyncs"] >= 1


def test_lost_bytes_inside_a_data_frame_keep_the_frame_boundaries():
    w = Wire()
    sid = w.request("/pkg.Svc/A", body=grpc_message(b"a" * 5000))
    sid2 = w.request("/pkg.Svc/B", body=grpc_message(b"b" * 10))
    client = w.client_bytes()
    offs = list(_frame_offsets(client[24:], 24))
    data_off = next(o for o in offs if client[o + 3] == http2.DATA)
    obs = http2.H2Observer(True)
    ev = obs.receive(client[:data_off + 100], 1, True)
    ev += obs.lost(1000, 2, True)
    ev += obs.receive(client[data_off + 1100:], 3, True)
    (lost,) = [e for e in ev if isinstance(e, http2.Lost)]
    assert lost.stream_id == sid
    later = headers_of(ev)
    assert [h.stream_id for h in later] == [sid, sid2] and later[1].unknown_fields == 0


def test_partial_decoder_learns_entries_inserted_after_attach():
    enc = Encoder()
    enc.encode([("x-old", "1")])  # inserted before the observer came
    d = PartialDecoder()
    fields, unknown = d.decode(enc.encode([("x-old", "1"), ("x-new", "2")]))
    assert fields == [(b"x-new", b"2")] and unknown == 1
    fields, unknown = d.decode(enc.encode([("x-new", "2"), (":method", "GET")]))
    assert fields == [(b"x-new", b"2"), (b":method", b"GET")] and unknown == 0


# ---- fuzzing ------------------------------------------------------------------------

_W = Wire()
for _i in range(6):
    _s = _W.request(f"/pkg.Svc/F{_i}", [("x-i", str(_i))], body=grpc_message(b"f" * 40 * _i))
    _W.respond(_s, [grpc_message(b"g" * 30)])
VALID = _W.chunks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), st.binary(max_size=200)), max_size=20),
       st.booleans())
def test_random_bytes_never_crash(chunks, synced):
    obs = http2.H2Observer(synced)
    fed = {True: 0, False: 0}
    for i, (fc, data) in enumerate(chunks):
        for e in obs.receive(data, i, fc, fed[fc] if i % 3 else None):
            if isinstance(e, http2.Headers) and e.offset is not None:
                assert 0 <= e.offset <= fed[fc] + len(data) - 9
        fed[fc] += len(data)
        if i % 7 == 3:
            obs.lost(len(data) + 1, i, fc)
            fed[fc] += len(data) + 1


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_truncated_mutated_and_resplit_valid_streams_never_crash(data):
    chunks = list(VALID)
    k = data.draw(st.integers(0, len(chunks) - 1))
    fc, b = chunks[k]
    if b:
        pos = data.draw(st.integers(0, len(b) - 1))
        how = data.draw(st.sampled_from(["cut", "flip", "drop"]))
        if how == "cut":
            b = b[:pos]
        elif how == "flip":
            b = b[:pos] + bytes([b[pos] ^ data.draw(st.integers(1, 255))]) + b[pos + 1:]
        else:
            chunks = chunks[:k] + chunks[k + 1:]
        if how != "drop":
            chunks[k] = (fc, b)
    synced = data.draw(st.booleans())
    start = data.draw(st.integers(0, len(chunks)))
    obs, ev = observe(chunks[start:], synced=synced)
    for e in ev:  # whatever it decoded is shaped right
        if isinstance(e, http2.Headers):
            assert all(isinstance(n, str) and isinstance(v, str) for n, v in e.headers)


# ---- a real capture -------------------------------------------------------------------


def test_real_capture_of_the_sample_grpc_server():
    """samples/captures/kserve-grpc.ttcap: tritonclient against the sample server,
    recorded with real probes (samples/captures/make_grpc_capture.py)."""
    path = CAPTURES / "kserve-grpc.ttcap"
    expected = json.loads((CAPTURES / "kserve-grpc.expected.json").read_text())
    streams = capture_streams(path)
    h2conns = [k for k, chunks in streams.items()
               if next(d for inb, _, d in chunks if inb).startswith(http2.PREFACE)]
    assert h2conns, "the capture holds an HTTP/2 connection from its preface"
    paths = []
    for key in h2conns:
        obs, ev, raw, fed = http2.H2Observer(True), [], b"", 0
        for inb, _, data in streams[key]:  # with offsets: where each block began
            ev += obs.receive(data, 0, inb, fed if inb else None)
            if inb:
                raw, fed = raw + data, fed + len(data)
        paths += [dict(h.headers)[":path"] for h in headers_of(ev, True)]
        assert obs.stats["http2_header_blocks_undecodable"] == 0
        for h in headers_of(ev, True):
            length, ftype, _, sid = http2.parse_frame_header(raw, h.offset)
            assert ftype == http2.HEADERS and sid == h.stream_id
    assert paths == [e["path"] for e in expected]
    records = []
    tracker = ConnectionTracker(records.append)
    for item in capture.CaptureReader(path):
        if isinstance(item, bytes):
            ev = schema.decode(item)
            if isinstance(ev, schema.DataEvent):
                tracker.data_event(ev)
            elif isinstance(ev, schema.ConnEvent):
                tracker.conn_event(ev)
            elif isinstance(ev, schema.SocketInfo):
                tracker.socket_info(ev)
    grpc_recs = sorted((r for r in records if r.rpc is not None), key=lambda r: r.start_ns)
    assert len(grpc_recs) == len(expected)
    for rec, exp in zip(grpc_recs, expected):
        assert rec.target == exp["path"]
        assert rec.rpc.grpc_status == exp["grpc_status"]
        if exp.get("output_tokens") is not None:
            assert rec.llm_response.output_tokens == exp["output_tokens"]
            assert rec.llm_request.model == exp["model"]
            assert rec.llm_response.response_id == exp["request_id"]
            assert 0 < rec.ttft_ns <= rec.end_ns - rec.start_ns


def test_header_blocks_say_where_they_began_in_the_stream_when_given_offsets():
    """``Headers.offset``: the stream offset of the block's HEADERS frame (the socket
    timing takes a request's arrival from the segment that held it). Split at random
    sizes, across CONTINUATIONs and a hole, from an offset not 0 (the agent attached
    after the connection's first bytes)."""
    rng = random.Random(7)
    w = Wire()
    sids = [w.request(f"/pkg.Svc/Call{i}", [(f"x-{i}", "v" * (300 * i))],
                      body=grpc_message(b"m" * i)) for i in range(3)]
    big = w.request("/pkg.Svc/Big", [(f"x-big-{i}", "z" * 1000) for i in range(40)])
    for sid in sids + [big]:
        w.respond(sid, [grpc_message(b"r")], status=0)
    raw = w.client_bytes()
    want = [j for j in _frame_offsets(raw[24:], 24) if raw[j + 3] == http2.HEADERS]
    assert len(want) == 4
    base = 5000
    for trial in range(20):
        obs = http2.H2Observer(True)
        got, pos = [], 0
        while pos < len(raw):
            n = rng.randint(1, 400)
            got += obs.receive(raw[pos:pos + n], pos, True,
                               base + pos if rng.random() < 0.5 or pos == 0 else None)
            pos += n
        assert [e.offset for e in headers_of(got, True)] == [base + j for j in want]
    # no offsets given: none said
    _, ev = observe(w.chunks)
    assert {e.offset for e in headers_of(ev)} == {None}
    # bytes lost inside a DATA frame: the next block's offset still counts them
    at = max((j for j in _frame_offsets(raw[24:], 24) if raw[j + 3] == http2.DATA),
             key=lambda j: http2.parse_frame_header(raw, j)[0])
    assert http2.parse_frame_header(raw, at)[0] >= 6 and want[0] < at < want[-1]
    obs = http2.H2Observer(True)
    got = obs.receive(raw[:at + 10], 0, True, base)
    got += obs.lost(3, 1, True)
    got += obs.receive(raw[at + 13:], 2, True)
    assert [e.offset for e in headers_of(got, True)] == [base + j for j in want]
    assert obs.stats["http2_resyncs"] == 0  # the hole was inside the frame
