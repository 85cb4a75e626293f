"""HTTP/1.1 observer parser: real capture bytes, every split, gaps, garbage, fuzz."""

import random

from hypothesis import given, settings, strategies as st

from protocols import http1
from protocols.http1 import (Abandoned, Data, EndOfMessage, HTTP1Connection, ProtocolError,
                             Request, Response, Upgraded)
from tests.conftest import capture_streams


def feed_all(chunks, conn=None, split=None, rng=None):
    """chunks: (from_client, bytes); split each into random pieces if rng given."""
    conn = conn or HTTP1Connection()
    events = []
    ts = 0
    for from_client, data in chunks:
        pieces = [data]
        if rng is not None and len(data) > 1:
            cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 6))))
            pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
        for p in pieces:
            ts += 1
            events += conn.receive(p, ts, from_client)
    return events


def exchanges(events):
    """exchange -> summary of what the parser said about it."""
    out = {}
    for e in events:
        ex = getattr(e, "exchange", None)
        if ex is None or ex < 0:
            continue
        d = out.setdefault(ex, {"req_body": b"", "resp_body": b"", "ends": 0})
        if isinstance(e, Request):
            d["method"], d["target"] = e.method, e.target
        elif isinstance(e, Response):
            d["status"] = e.status
        elif isinstance(e, Data):
            d["req_body" if e.from_client else "resp_body"] += e.data
        elif isinstance(e, EndOfMessage):
            d["ends"] += 1
            d.setdefault("incomplete", False)
            d["incomplete"] |= e.incomplete
        elif isinstance(e, Abandoned):
            d["abandoned"] = e.reason
    return out


REQ = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n{\"a\": true}"
RESP = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        b"6\r\ndata: \r\n4\r\n1\n\n\n\r\n0\r\n\r\n")


def http_streams(path):
    """The capture's HTTP connections (it also holds the event loop's wakeup socketpair)."""
    return {k: v for k, v in capture_streams(path).items()
            if http1.looks_like_request(v[0][2])}


def test_real_capture_streams_parse_identically_under_any_split(openai_capture):
    streams = http_streams(openai_capture)
    assert len(streams) >= 4
    for key, chunks in streams.items():
        whole = exchanges(feed_all([(inb, data) for inb, _, data in chunks]))
        assert whole, key
        for ex in whole.values():
            assert ex["ends"] == 2 and not ex.get("incomplete") and "abandoned" not in ex
        for seed in range(5):
            split = exchanges(feed_all([(inb, data) for inb, _, data in chunks],
                                       rng=random.Random(seed)))
            assert split == whole


def test_keep_alive_connection_from_capture_pairs_two_requests(openai_capture):
    streams = http_streams(openai_capture)
    multi = [exchanges(feed_all([(i, d) for i, _, d in c])) for c in streams.values()]
    gets = [m for m in multi if any(e["target"] == "/v1/models" for e in m.values())]
    assert gets, "the capture holds a keep-alive connection with two GETs"
    m = gets[0]
    assert len(m) == 2
    assert (m[0]["target"], m[1]["target"]) == ("/v1/models", "/health")
    assert m[0]["status"] == m[1]["status"] == 200


def test_pipelined_requests_pair_in_order():
    reqs = b"".join(b"GET /r%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(5))
    resps = b"".join(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nr%d" % i for i in range(5))
    ex = exchanges(feed_all([(True, reqs), (False, resps)]))
    assert [ex[i]["target"] for i in range(5)] == [f"/r{i}" for i in range(5)]
    assert [ex[i]["resp_body"] for i in range(5)] == [b"r%d" % i for i in range(5)]


def test_chunked_sse_body_is_dechunked():
    ex = exchanges(feed_all([(True, REQ), (False, RESP)], rng=random.Random(3)))
    assert ex[0]["req_body"] == b'{"a": true}'
    assert ex[0]["resp_body"] == b"data: 1\n\n\n"


def test_informational_100_continue_does_not_take_the_exchange():
    resp = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"
    ex = exchanges(feed_all([(True, REQ), (False, resp)]))
    assert ex[0]["status"] == 201 and ex[0]["ends"] == 2


def test_head_response_has_no_body():
    req = b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\nGET /y HTTP/1.1\r\nHost: a\r\n\r\n"
    conn = HTTP1Connection()
    ev = conn.receive(req, 1, True)
    ev += conn.receive(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n", 2, False)
    ev += conn.receive(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 3, False)
    ex = exchanges(ev)
    assert ex[0]["ends"] == 2 and ex[0]["resp_body"] == b""
    assert ex[1]["resp_body"] == b"ok"


def test_response_until_close_ends_at_close():
    conn = HTTP1Connection()
    ev = conn.receive(b"GET / HTTP/1.0\r\n\r\n", 1, True)
    ev += conn.receive(b"HTTP/1.0 200 OK\r\n\r\nhello", 2, False)
    ev += conn.close(3)
    ex = exchanges(ev)
    assert ex[0]["resp_body"] == b"hello" and ex[0]["ends"] == 2


def test_upgrade_stops_parsing():
    conn = HTTP1Connection()
    ev = conn.receive(b"GET /ws HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
                      1, True)
    ev += conn.receive(b"\x81\x05hello", 2, True)
    assert any(isinstance(e, Upgraded) for e in ev)
    assert conn.upgraded


def test_gap_inside_content_length_body_keeps_framing():
    body = b"x" * 1000
    req = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n"
    conn = HTTP1Connection()
    ev = conn.receive(req + body[:100], 1, True)
    ev += conn.lost(800, 2, True)
    ev += conn.receive(body[900:] + b"GET /next HTTP/1.1\r\n\r\n", 3, True)
    ex = exchanges(ev)
    assert ex[0]["incomplete"] is True
    assert ex[0]["req_body"] == body[:100] + body[900:]  # no filler bytes passed on
    assert ex[1]["target"] == "/next"


def test_gap_in_chunked_response_abandons_and_resyncs():
    conn = HTTP1Connection()
    ev = conn.receive(b"GET /a HTTP/1.1\r\n\r\n", 1, True)
    ev += conn.receive(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", 2, False)
    ev += conn.lost(50, 3, False)
    ev += conn.receive(b"GET /b HTTP/1.1\r\n\r\n", 4, True)
    ev += conn.receive(b"junk\r\n0\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", 5, False)
    ex = exchanges(ev)
    assert "abandoned" in ex[0]
    assert ex[1]["status"] == 204 and ex[1]["ends"] == 2


def test_gap_in_requests_never_pairs_a_response_with_the_wrong_request():
    """Whole requests may hide in a hole: their responses, written before the next seen
    request arrived, must not be given to it."""
    conn = HTTP1Connection()
    ev = conn.receive(b"GET /seen1 HTTP/1.1\r\n\r\n", 1, True)
    ev += conn.receive(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n1", 2, False)
    ev += conn.lost(40, 3, True)  # e.g. "GET /lost HTTP/1.1\r\n\r\n" never captured
    ev += conn.receive(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlost", 4, False)
    ev += conn.receive(b"GET /seen2 HTTP/1.1\r\n\r\n", 5, True)
    ev += conn.receive(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nseen2", 6, False)
    ex = exchanges(ev)
    assert ex[0]["resp_body"] == b"1"
    assert ex[1]["target"] == "/seen2" and ex[1]["resp_body"] == b"seen2"


def test_attach_mid_connection_hunts_for_the_next_request():
    conn = HTTP1Connection(synced=False)
    ev = conn.receive(b'ue}\r\n\r\nmore body bytes"}POST /v1/completions HTTP/1.1\r\n'
                      b"Content-Length: 2\r\n\r\n{}", 1, True)
    ev += conn.receive(b"ing\r\n0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 2, False)
    ex = exchanges(ev)
    assert list(ex) == [0]
    assert ex[0]["target"] == "/v1/completions" and ex[0]["status"] == 200


def test_garbage_request_gives_protocol_error_then_recovers():
    conn = HTTP1Connection()
    ev = conn.receive(b"\x00\x01NOT HTTP AT ALL\r\n\r\n", 1, True)
    assert any(isinstance(e, ProtocolError) and e.from_client for e in ev)
    ev = conn.receive(b"GET /ok HTTP/1.1\r\n\r\n", 2, True)
    ev += conn.receive(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 3, False)
    ex = exchanges(ev)
    assert ex[0]["target"] == "/ok" and ex[0]["status"] == 200


def test_close_with_unanswered_request_abandons_it():
    conn = HTTP1Connection()
    conn.receive(REQ, 1, True)
    ev = conn.close(2)
    assert any(isinstance(e, Abandoned) and e.exchange == 0 for e in ev)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.binary(max_size=200)), max_size=30))
def test_fuzz_random_bytes_never_raise(chunks):
    conn = HTTP1Connection()
    for i, (fc, data) in enumerate(chunks):
        conn.receive(data, i, fc)
    conn.close(len(chunks))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_real_traffic_never_raises_or_misnumbers(data):
    stream = [(True, REQ), (False, RESP)] * 3
    conn = HTTP1Connection(synced=data.draw(st.booleans()))
    seen_requests = set()
    for i, (fc, chunk) in enumerate(stream):
        b = bytearray(chunk)
        for _ in range(data.draw(st.integers(0, 3))):
            if b:
                b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(0, len(b)))
        if data.draw(st.booleans()):
            evs = conn.receive(bytes(b[:cut]), i, fc) + conn.lost(len(b) - cut, i, fc)
        else:
            evs = conn.receive(bytes(b), i, fc)
        for e in evs:
            if isinstance(e, Request):
                assert e.exchange not in seen_requests
                seen_requests.add(e.exchange)
            if isinstance(e, Response):
                assert e.exchange in seen_requests  # a response only for a request seen
    conn.close(99)


def test_request_line_recognisers():
    assert http1.looks_like_request(b"POST /v1 HTTP/1.1\r\n")
    assert not http1.looks_like_request(b"POSTMAN")
    assert http1.looks_like_response(b"HTTP/1.1 200 OK")
