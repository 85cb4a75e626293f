"""Connections to records, with synthetic events: roles, gaps, deaths, existing sockets."""

import json
from contextlib import nullcontext
from unittest.mock import patch

from tracer.correlate.connections import ConnectionTracker
from tracer.events import schema, wire

C = wire.CONSTANTS
PID, FD, CID = 100, 7, 5000


class Feed:
    def __init__(self, role="server", existing=False):
        self.records = []
        self.t = ConnectionTracker(self.records.append)
        self.pos = {True: 0, False: 0}
        self.ts = 1000
        if existing:
            self.t.socket_info(schema.SocketInfo(PID, FD, CID, 1, 2, "127.0.0.1", 8000,
                                                 "127.0.0.1", 5555, existing=True))
        else:
            op = C["CONN_ACCEPT"] if role == "server" else C["CONN_CONNECT"]
            self.t.conn_event(schema.ConnEvent(PID, PID, FD, 1, CID, op, 0, 0, 3, 2,
                                               "127.0.0.1", 5555))

    def data(self, inbound, payload, skip=0, tid=None):
        self.ts += 1000
        self.pos[inbound] += skip
        ev = schema.DataEvent(PID, tid or PID, FD, CID, self.ts - 10, self.ts, len(payload), 0,
                              C["SYS_READ"], C["DIR_IN"] if inbound else C["DIR_OUT"],
                              C["FLAG_LAST"], payload, stream_off=self.pos[inbound])
        self.pos[inbound] += len(payload)
        self.t.data_event(ev)

    def close(self):
        self.t.conn_event(schema.ConnEvent(PID, PID, FD, self.ts + 1, CID, C["CONN_CLOSE"], 1, 0,
                                           -1, 0, "", 0))


BODY = json.dumps({"model": "tiny", "stream": True, "max_tokens": 3,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
REQ = (b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer sk-secret\r\n"
       b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(doc):
    d = b"data: " + json.dumps(doc).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(d), d)


def serve(f, tokens=3, tid=None):
    f.data(True, REQ, tid=tid)
    f.data(False, HEAD)
    f.data(False, chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    for i in range(tokens):
        f.data(False, chunk({"choices": [{"delta": {"content": f" t{i}"}}]}), tid=tid)
    f.data(False, b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


def test_server_request_becomes_one_record():
    f = Feed()
    serve(f)
    (r,) = f.records
    assert r.role == "server" and r.status == 200 and r.llm_request.model == "tiny"
    assert r.llm_response.output_tokens == 3 and r.llm_response.usage_source == "stream_chunks"
    # TTFT: first text chunk (the 4th data event) minus the request read
    assert r.ttft_ns == 3000 and r.tpot_ns == 1000
    assert "authorization" not in r.request_headers and r.tenant and "sk-secret" not in r.tenant


def test_thread_ids_of_the_exchange_are_kept():
    f = Feed()
    serve(f, tid=4242)
    assert f.records[0].tids == [4242, PID]


def test_process_exit_mid_stream_ends_with_error():
    f = Feed()
    f.data(True, REQ)
    f.data(False, HEAD)
    f.data(False, chunk({"choices": [{"delta": {"content": "a"}}]}))
    f.t.process_exit(PID, f.ts + 5)
    (r,) = f.records
    assert r.failed and "process exited" in r.error
    assert r.llm_response.first_token_ts is not None  # what was seen is kept


def test_gap_in_response_is_counted_and_marks_the_request():
    f = Feed()
    f.data(True, REQ)
    f.data(False, HEAD)
    f.data(False, chunk({"choices": [{"delta": {"content": "a"}}]}), skip=500)
    f.close()
    (r,) = f.records
    assert r.failed and "capture missed 500" in r.error
    assert f.t.stats["bytes_lost"] == 500


def test_response_ending_before_the_request_marks_the_request_incomplete():
    """The tail of a request body lost with nothing inbound after it (the hole is never
    seen): the response still ends the exchange, and the record must not claim the
    request whole."""
    f = Feed()
    f.data(True, REQ[: len(REQ) - 10])
    f.data(False, HEAD + chunk({"choices": [{"delta": {"content": "x"}}]}) + b"0\r\n\r\n")
    (r,) = f.records
    assert r.request_incomplete and not r.response_incomplete
    assert r.request_bytes == len(BODY) - 10 and r.llm_response.output_tokens == 1
    f2 = Feed()
    serve(f2)
    assert not f2.records[0].request_incomplete  # a whole request stays whole


def test_existing_socket_finds_its_role_from_the_first_request_line():
    f = Feed(existing=True)
    f.data(True, b'tail of an earlier body"}')  # attached mid-request: skipped
    serve(f)
    (r,) = f.records
    assert r.role == "server" and r.llm_response.output_tokens == 3


def test_client_role_connection():
    f = Feed(role="client")
    f.data(False, REQ)  # the traced process sends the request
    f.data(True, HEAD + chunk({"choices": [{"delta": {"content": "x"}}]}) + b"0\r\n\r\n")
    (r,) = f.records
    assert r.role == "client" and r.llm_response.output_tokens == 1


def test_non_http_connection_is_ignored_and_counted():
    f = Feed()
    f.data(True, b"\x16\x03\x01\x02\x00")  # TLS client hello
    f.data(False, b"\x16\x03\x03")
    f.close()
    assert f.records == [] and f.t.stats["connections_tls"] == 1


def test_request_split_in_tiny_reads_is_sniffed():
    f = Feed()
    for i in range(0, len(REQ), 3):
        f.data(True, REQ[i:i + 3])
    f.data(False, HEAD + b"0\r\n\r\n")
    (r,) = f.records
    assert r.method == "POST" and r.llm_request.model == "tiny"


def test_truncated_last_read_marks_the_request_at_once():
    """The kernel says a read moved more than it captured: the hole is known right
    away, not only when the next bytes arrive."""
    f = Feed()
    head, body = REQ.split(b"\r\n\r\n", 1)
    ev = schema.DataEvent(PID, PID, FD, CID, 10, 20, len(REQ), 0, C["SYS_READ"], C["DIR_IN"],
                          C["FLAG_LAST"] | C["FLAG_TRUNCATED"], head + b"\r\n\r\n" + body[:20])
    f.t.data_event(ev)
    f.pos[True] = len(REQ)
    f.data(False, HEAD + b"0\r\n\r\n")
    (r,) = f.records
    assert r.request_incomplete and r.llm_request.model == "tiny"  # salvaged from the part seen
    assert f.t.stats["bytes_truncated"] == len(body) - 20


def test_a_pause_ends_open_requests_there_and_a_capture_keeps_it(tmp_path):
    """`tokentrace run` paused (schema.TracingPaused): requests open at the pause end
    there, incomplete and counted; the event goes through a capture file, so a replay
    ends the same ones."""
    from bench.streamgen import generate
    from tracer.events import capture
    from tracer.pipeline import Pipeline

    items, truth = generate(rate=40, tokens=20, seconds=1.0, servers=1, gpu=False)
    cut = len(items) // 2
    at = max(i.ts_exit for i in (schema.decode(x) for x in items[:cut] if isinstance(x, bytes))
             if isinstance(i, schema.DataEvent))
    items = items[:cut] + [schema.TracingPaused(ts=at + 1, paused=True, switch_s=0.01)]
    path = tmp_path / "paused.ttcap"
    w = capture.CaptureWriter(path, capture.new_header(), keep_secrets=True)
    for it in items:
        w.write(it)
    w.close()
    replayed = list(capture.CaptureReader(path))
    assert replayed[-1] == items[-1]

    recs: list = []

    class Sink:
        def on_record(self, r):
            recs.append(r)

        def close(self):
            pass

    p = Pipeline([Sink()])
    for it in replayed:
        p.feed(it)
    p.close()
    cut_short = [r for r in recs if r.error]
    assert cut_short and p.report()["requests_cut_by_pause"] == len(cut_short)
    assert all(r.error == "tracing paused before the response completed"
               and r.response_incomplete and r.end_ns == at + 1 for r in cut_short)
    assert p.report().get("in_flight_at_exit", 0) == 0


def _sse_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_events_split_across_whole_chunks_keep_the_held_bytes_counted():
    """A server that writes each SSE event in two HTTP chunks: the second completes an
    event the follower holds half of, and goes through the stream shortcut
    (``stream_write``), which must count what the connection holds as the general path
    does, after every write, and give the same record."""
    def run(general: bool):
        f = Feed()
        held = []
        with patch.object(ConnectionTracker, "stream_write",
                          lambda self, c, *a: False) if general else nullcontext():
            f.data(True, REQ)
            f.data(False, HEAD)
            for i in range(4):
                ev = b"data: " + json.dumps({"choices": [{"delta": {"content": f" t{i}"}}]}
                                            ).encode() + b"\n\n"
                for part in (ev[:20], ev[20:]):
                    f.data(False, _sse_chunk(part))
                    (c,) = f.t.conns.values()
                    held.append((c.held, c.buffered(), f.t.buffered_estimate))
            f.data(False, b"0\r\n\r\n")
        (r,) = f.records
        return r, held

    fast, held = run(False)
    assert all(h == b == e for h, b, e in held) and any(h for h, _, _ in held), held
    general, held_general = run(True)
    assert held == held_general
    assert fast.llm_response.output_tokens == general.llm_response.output_tokens == 4
    assert fast.llm_response.token_ts == general.llm_response.token_ts
