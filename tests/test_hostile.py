"""What strangers can send: each crash found in the parsers, fixed at its cause, and the
containment that keeps any other failure to the one connection it happened on."""

from __future__ import annotations

import gzip
import json
import struct
import time
import zlib
from collections import Counter

import pytest

from protocols import grpc, http1, kserve, openai, sse
from protocols.proto import messages
from tests.test_tracker import HEAD, PID, REQ, Feed, chunk, serve
from tracer.events import capture, schema, wire
from tracer.pipeline import Pipeline

C = wire.CONSTANTS
M = messages()

# ---- openai -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [b"Infinity", b"-Infinity", b"NaN", b"1e999", b"-3",
                                   b"2.5", b"true", b'"12"', b"1" + b"0" * 30, b"[1]"])
def test_max_tokens_that_is_not_a_count_is_absent(value):
    body = b'{"model": "m", "max_tokens": ' + value + b', "n": ' + value + \
        b', "temperature": ' + value + b"}"
    r = openai.parse_request("chat", body, True)
    assert r.parsed and r.model == "m"
    assert r.max_tokens is None and r.n is None
    assert r.temperature is None or r.temperature == float(value)


def test_max_tokens_that_is_a_whole_float_counts():
    r = openai.parse_request("chat", b'{"max_tokens": 12.0, "temperature": 1e308}', True)
    assert (r.max_tokens, r.temperature) == (12, 1e308)


def test_deeply_nested_request_is_not_json_for_us():
    for body in (b"[" * 100_000 + b"]" * 100_000,
                 b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        r = openai.parse_request("chat", body, True, keep_prompt=True)
        assert not r.parsed and "nested too deeply" in r.error


def test_content_parts_and_prompts_of_any_type_give_text():
    body = json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"text": 5}, {"type": "text", "text": "hi"},
                                     {"text": {"a": [1]}}, "x"]},
        {"role": 7, "content": {"nested": [[[]]]}},
    ]}).encode()
    r = openai.parse_request("chat", body, True, keep_prompt=True)
    assert r.prompt == "user: 5 hi\n7: "
    for prompt, text in (([1, 2, [3, 4], {"a": 1}, None], "1\n2\n3 4\n\n"),
                         ([[1, [2]], "ab"], "1\nab")):
        r = openai.parse_request("text_completion", json.dumps({"prompt": prompt}).encode(),
                                 True, keep_prompt=True)
        assert r.prompt == text


def _follow(body: bytes, streamed: bool = False, keep: bool = False,
            headers: dict[str, str] | None = None) -> openai.LLMResponse:
    f = openai.ResponseFollower("chat", keep_text=keep)
    h = {"content-type": "text/event-stream" if streamed else "application/json"}
    f.head(1, 200, {**h, **(headers or {})})
    f.data(2, body)
    return f.end(3)


@pytest.mark.parametrize("value", ["Infinity", "NaN", "1e999", "-1", "1.5", '"9"'])
def test_usage_that_is_not_a_count_is_absent(value):
    body = ('{"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": '
            f'{value}, "completion_tokens": {value}}}}}').encode()
    r = _follow(body)
    assert r.input_tokens is None and r.output_tokens is None and r.usage_source is None
    r = _follow(b"data: " + body.replace(b'"message"', b'"delta"') + b"\n\n", streamed=True)
    assert r.input_tokens is None and r.output_tokens == 1  # counted from the stream


def test_deep_nesting_in_a_response_and_in_its_error():
    r = _follow(b"[" * 10_000 + b"]" * 10_000)
    assert r.parse_errors == 1
    r = _follow(b"data: " + b"{\"a\":" * 5000 + b"1" + b"}" * 5000 + b"\n\n", streamed=True)
    assert r.parse_errors == 1 and r.chunks == 1
    err = {"error": {"type": [[[]]], "code": 5, "message": {"deep": [[["echo"]]]}}}
    r = _follow(json.dumps(err).encode(), keep=True)
    assert (r.error_type, r.error_message) == ("5", "")


def test_server_error_text_is_kept_only_with_content():
    body = json.dumps({"error": {"type": "invalid_request", "message": "your prompt: secret"}}
                      ).encode()
    assert _follow(body).error_message is None
    assert _follow(body).error_type == "invalid_request"
    assert _follow(body, keep=True).error_message == "your prompt: secret"
    assert _follow(b'{"error": "secret prompt echoed"}').error_message is None


def test_gzip_bomb_inflates_in_bounded_steps(monkeypatch):
    monkeypatch.setattr(openai, "MAX_INFLATED", 4 << 20)
    bomb = gzip.compress(b"data: {}\n\n" * (1 << 20))  # ~10 MiB from ~10 KiB
    r = _follow(bomb, streamed=True, headers={"content-encoding": "gzip"})
    assert r.body_truncated and r.chunks < (1 << 20)
    ok = gzip.compress(b'{"choices": [{"message": {"content": "hi"}}]}')
    r = _follow(ok, headers={"content-encoding": "gzip"})
    assert not r.body_truncated and r.first_token_ts == 2


def test_token_times_are_capped_and_counted(monkeypatch):
    monkeypatch.setattr(openai, "MAX_TOKEN_TS", 10)
    body = b"".join(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n' for _ in range(25))
    r = _follow(body, streamed=True)
    assert (len(r.token_ts), r.token_ts_dropped, r.text_chunks, r.output_tokens) == (
        10, 15, 25, 25)


def test_sse_data_lines_without_end_are_bounded(monkeypatch):
    monkeypatch.setattr(sse, "MAX_PENDING", 1000)
    p = sse.SSEParser()
    for _ in range(100):
        assert p.feed(b"data: " + b"x" * 50 + b"\n", 1) == []
    assert p.oversized >= 1 and sum(map(len, p._data)) <= 1000
    assert [e.data for e in p.feed(b"\ndata: ok\n\n", 2)] == ["ok"]


# ---- gRPC and KServe ----------------------------------------------------------------


def test_grpc_path_with_escaped_slash_stays_in_its_part():
    call = grpc.Call(1, 0, {":path": "/pkg.Svc%2Fx/Me%2Fth"})
    assert call.service_method == ("pkg.Svc/x", "Me/th")
    assert grpc.Call(1, 0, {":path": "/a/b/c"}).service_method == (None, None)


@pytest.mark.parametrize("text,value", [("²", None), ("٣", None), ("9" * 5000, None),
                                        (" 14 ", 14), ("", None), ("-1", None)])
def test_status_numbers_are_ascii_digits_only(text, value):
    assert grpc.ascii_int(text) == value


def test_grpc_call_with_unicode_digit_status_and_trailers():
    from tests.h2wire import Wire, grpc_message

    w = Wire()
    sid = w.request("/pkg.S/M", body=grpc_message(b"q"))
    w.server.send_headers(sid, [(b":status", "2²".encode()),
                                (b"content-type", b"application/grpc")])
    w.server.send_headers(sid, [(b"grpc-status", "¹".encode())], end_stream=True)
    w.pump()
    conn = grpc.GrpcConnection()
    events = []
    for i, (fc, data) in enumerate(w.chunks):
        events += conn.receive(data, i, fc)
    (call,) = [e.call for e in events if isinstance(e, grpc.CallEnded)]
    assert call.http_status is None and call.grpc_status is None
    assert call.error == "the response ended without grpc-status"


def _infer_request(**params) -> bytes:
    m = M.ModelInferRequest(model_name="m")
    for name, v in params.items():
        m.parameters[name].double_param = v
    return m.SerializeToString()


@pytest.mark.parametrize("v", [float("inf"), float("nan"), -1.0, 1e300])
def test_kserve_parameters_that_are_not_counts(v):
    f = kserve.KServeFollower("ModelInfer")
    f.request_message(1, _infer_request(max_tokens=v, temperature=v))
    q, _ = f.end(2)
    assert q.parsed and q.model == "m"
    assert q.max_tokens is None or q.max_tokens == 10**300
    assert q.temperature is None or q.temperature == v


def test_kserve_output_counts_that_are_not_counts_and_huge_shapes():
    resp = M.ModelInferResponse(model_name="m")
    for name in ("num_output_tokens", "num_input_tokens"):
        t = resp.outputs.add(name=name, datatype="FP32", shape=[1])
        t.contents.fp32_contents.append(float("inf"))
    t = resp.outputs.add(name="text_output", datatype="FP32", shape=[1 << 62] * 10_000)
    t.contents.fp32_contents.append(1.0)
    f = kserve.KServeFollower("ModelInfer")
    t0 = time.monotonic()
    f.response_message(1, resp.SerializeToString())
    _, r = f.end(2)
    assert time.monotonic() - t0 < 1.0
    assert r.output_tokens is None and r.input_tokens is None and r.first_token_ts == 1


# ---- HTTP/1 -------------------------------------------------------------------------


def test_content_length_of_unicode_digits_is_no_length():
    c = http1.HTTP1Connection()
    ev = c.receive(b"POST / HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", 1, True)
    assert not any(isinstance(e, http1.Request) and False for e in ev)  # no exception
    assert any(isinstance(e, (http1.ProtocolError, http1.Request)) for e in ev)


def test_head_over_budget_is_dropped_and_the_next_request_parses():
    stats: Counter[str] = Counter()
    c = http1.HTTP1Connection(stats=stats)
    events = c.receive(b"GET /a HTTP/1.1\r\nX-Big: ", 1, True)
    for i in range(20):  # 200 KB of one header value, never ended
        events += c.receive(b"y" * 10_000, 2 + i, True)
    assert any(isinstance(e, http1.ProtocolError) and "head over" in e.message for e in events)
    assert stats["http1_head_over_budget"] == 1
    events = c.receive(b"\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n", 30, True)
    assert [e.target for e in events if isinstance(e, http1.Request)] == ["/b"]


def test_gap_in_a_body_of_huge_length_allocates_nothing():
    c = http1.HTTP1Connection()
    ev = c.receive(b"POST / HTTP/1.1\r\nContent-Length: 999999999999999999\r\n\r\nab", 1, True)
    t0 = time.monotonic()
    ev += c.lost(1 << 50, 2, True)  # a hole a petabyte long: framed, not filled
    ev += c.receive(b"cd", 3, True)
    assert time.monotonic() - t0 < 0.5
    assert [e.data for e in ev if isinstance(e, http1.Data)] == [b"ab", b"cd"]


def test_gap_in_a_body_ends_it_where_its_length_says():
    c = http1.HTTP1Connection()
    ev = c.receive(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nab", 1, True)
    ev += c.lost(5, 2, True)
    ev += c.receive(b"cdeGET /next HTTP/1.1\r\n\r\n", 3, True)
    ends = [e for e in ev if isinstance(e, http1.EndOfMessage)]
    assert [(e.exchange, e.incomplete) for e in ends] == [(0, True), (1, False)]
    assert [e.data for e in ev if isinstance(e, http1.Data)] == [b"ab", b"cde"]
    assert [e.target for e in ev if isinstance(e, http1.Request)] == ["/", "/next"]


def test_pipelined_requests_without_answers_are_bounded(monkeypatch):
    monkeypatch.setattr(http1, "MAX_UNANSWERED", 4)
    c = http1.HTTP1Connection()
    ev = c.receive(b"GET / HTTP/1.1\r\n\r\n" * 10, 1, True)
    assert len(c.unanswered) == 4
    assert [e.exchange for e in ev if isinstance(e, http1.Abandoned)] == [0, 1, 2, 3, 4, 5]


# ---- capture files ------------------------------------------------------------------


def _capture(tmp_path, frames: list[bytes], header: dict | None = None):
    f = tmp_path / "x.ttcap"
    head = json.dumps(header or capture.new_header()).encode() + b"\n"
    f.write_bytes(gzip.compress(head + b"".join(frames)))
    return f


def _frame(tag: bytes, body: bytes) -> bytes:
    return struct.pack("<cI", tag, len(body)) + body


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"type": "ProcessInfo"}',
                                  b'{"type": "ClockSync", "mono_ns": "x", "wall_ns": 1}',
                                  b'{"type": "Nope"}', b"[" * 100_000,
                                  b'{"type": "ProcessInfo", "pid": 1, "ts": 1, "comm": "a", '
                                  b'"exe": "b", "cmdline": [1]}'])
def test_malformed_json_frames_are_skipped_and_counted(tmp_path, body):
    good = _frame(b"J", json.dumps({"type": "ClockSync", "mono_ns": 1, "wall_ns": 5}).encode())
    r = capture.CaptureReader(_capture(tmp_path, [_frame(b"J", body), good]))
    assert list(r) == [schema.ClockSync(1, 5)]
    assert r.bad_items == 1 and r.corrupt is None


def test_corrupt_deflate_data_ends_reading_with_the_reason(tmp_path, openai_capture):
    raw = bytearray(openai_capture.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)
    f = tmp_path / "bad.ttcap"
    f.write_bytes(bytes(raw))
    r = capture.CaptureReader(f)
    items = list(r)
    assert items and (r.corrupt or r.truncated)
    p = Pipeline([])
    for i in items:
        p.feed(i)
    p.close()


def test_bad_frame_tag_or_length_ends_reading(tmp_path):
    for bad in (_frame(b"X", b"..."), struct.pack("<cI", b"W", 0xFFFFFFFF)):
        r = capture.CaptureReader(_capture(tmp_path, [_frame(b"W", b"abcd"), bad]))
        assert list(r) == [b"abcd"] and r.corrupt


def test_header_without_a_newline_is_read_bounded(tmp_path):
    f = tmp_path / "h.ttcap"
    f.write_bytes(gzip.compress(b"{" * (4 << 20)))
    with pytest.raises(capture.CaptureError, match="not a tokentrace capture"):
        capture.CaptureReader(f)


# ---- containment --------------------------------------------------------------------


def test_a_parser_exception_stays_with_its_connection(monkeypatch):
    """A bug anywhere under one connection: counted by module and type, the connection's
    request ends in error, its parser resynchronises, other connections are untouched."""
    f = Feed()
    real = openai.ResponseFollower._sse_event

    def boom(self, ts, data):
        if "explode" in data:
            raise KeyError("a parser bug")
        return real(self, ts, data)

    monkeypatch.setattr(openai.ResponseFollower, "_sse_event", boom)
    f.data(True, REQ)
    f.data(False, HEAD)
    f.data(False, chunk({"choices": [{"delta": {"content": "explode"}}]}))
    assert f.t.stats["parser_errors"] == 1
    assert f.t.stats["parser_errors.openai.KeyError"] == 1
    (bad,) = f.records
    assert bad.error.startswith("tracer parser error") and bad.response_incomplete
    f.data(False, b"0\r\n\r\n")  # the rest of the broken response: skipped while hunting
    serve(f)  # the next request on the same connection is followed again
    assert len(f.records) == 2 and f.records[1].llm_response.output_tokens == 3
    assert not f.records[1].error


def test_a_failure_while_closing_is_contained(monkeypatch):
    f = Feed()
    f.data(True, REQ)
    monkeypatch.setattr(openai.ResponseFollower, "end", lambda self, ts: 1 / 0)
    f.close()
    assert f.t.stats["parser_errors"] == 1
    assert f.t.stats["parser_errors.connections.ZeroDivisionError"] == 1
    assert not f.t.conns
    (rec,) = f.records  # still exported, as far as it was known
    assert rec.error.startswith("tracer parser error") and rec.llm_request.model == "tiny"


def test_pipeline_feed_never_raises_on_an_item():
    p = Pipeline([])
    ev = schema.DataEvent(PID, PID, 7, 1, 1, 2, 3, 0, C["SYS_READ"], C["DIR_IN"],
                          C["FLAG_LAST"], b"GET / HTTP/1.1\r\n\r\n", stream_off=0)
    p.tracker.data_event = None  # type: ignore[assignment]  # any bug below feed()
    p.feed(ev)
    p.feed(schema.ProcessInfo(PID, 1, "x", "/x", ("x",)))
    assert p.stats["parser_errors"] == 1
    assert p.report()["parser_errors.pipeline.TypeError"] == 1
