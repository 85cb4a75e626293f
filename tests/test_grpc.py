"""gRPC calls on HTTP/2 bytes: messages across frames, trailers, trailers-only, streams,
resets; the KServe v2 layer; and calls through the tracker into spans."""

from __future__ import annotations

import io
import json
import random
import struct
import time
import zlib

from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from protocols import grpc, kserve
from protocols.proto import messages
from tests.h2wire import Wire, grpc_message
from tracer.correlate.connections import ConnectionTracker
from tracer.events import schema, wire
from tracer.export.context import ExportContext
from tracer.export.jsonl import JsonlSpanExporter
from tracer.export.spans import SpanBuilder

C = wire.CONSTANTS
M = messages()
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def run(chunks, synced=True):
    conn = grpc.GrpcConnection(synced)
    events = []
    for i, (fc, data) in enumerate(chunks):
        events += conn.receive(data, (i + 1) * 1000, fc)
    return conn, events


def ended(events):
    return [e.call for e in events if isinstance(e, grpc.CallEnded)]


def test_message_reader_splits_messages_at_any_byte():
    msgs = [grpc_message(bytes([i]) * i, compressed=i % 3 == 0) for i in range(40)]
    wire_ = b"".join(msgs)
    rng = random.Random(1)
    for _ in range(20):
        r = grpc.MessageReader(False)
        out = []
        pos = 0
        while pos < len(wire_):
            n = rng.randint(1, 17)
            out += r.feed(wire_[pos:pos + n], pos)
            pos += n
        assert [(m.compressed, m.data) for m in out] == [(i % 3 == 0, bytes([i]) * i)
                                                         for i in range(40)]
        assert not r.partial
        assert all(m.first_ts <= m.ts for m in out)


def test_oversized_message_keeps_its_length_not_its_bytes(monkeypatch):
    monkeypatch.setattr(grpc, "MAX_MESSAGE", 100)
    r = grpc.MessageReader(True)
    out = r.feed(grpc_message(b"x" * 500) + grpc_message(b"ok"), 1)
    assert [(m.length, m.data) for m in out] == [(500, None), (2, b"ok")]


def test_unary_call_with_trailers():
    w = Wire()
    sid = w.request("/pkg.Echo/Say", body=grpc_message(b"hi"))
    w.respond(sid, [grpc_message(b"hello")], status=0)
    _, ev = run(w.chunks)
    (call,) = ended(ev)
    assert call.service_method == ("pkg.Echo", "Say") and call.is_grpc
    assert (call.grpc_status, call.request_messages, call.response_messages) == (0, 1, 1)
    assert call.error is None and not call.response_incomplete
    msgs = [e.message for e in ev if isinstance(e, grpc.CallMessage)]
    assert [(m.from_client, m.data) for m in msgs] == [(True, b"hi"), (False, b"hello")]


def test_trailers_only_error_response():
    w = Wire()
    sid = w.request("/pkg.Echo/Say", body=grpc_message(b"hi"))
    w.respond(sid, trailers_only=True, status=5, message="no such thing: caf%C3%A9")
    _, ev = run(w.chunks)
    (call,) = ended(ev)
    assert call.trailers_only and call.grpc_status == 5
    assert call.grpc_message == "no such thing: café"
    assert grpc.status_name(call.grpc_status) == "NOT_FOUND"


def test_server_streaming_and_bidi_message_times():
    w = Wire()
    sid = w.request("/pkg.Chat/Talk", body=grpc_message(b"q1"), end=False)
    w.server.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    for k in range(5):
        w.server.send_data(sid, grpc_message(f"a{k}".encode()))
        w.pump()
        w.client.send_data(sid, grpc_message(f"q{k + 2}".encode()), end_stream=k == 4)
        w.pump()
    w.server.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
    w.pump()
    _, ev = run(w.chunks)
    msgs = [e.message for e in ev if isinstance(e, grpc.CallMessage)]
    assert [m.data for m in msgs if not m.from_client] == [f"a{k}".encode() for k in range(5)]
    assert [m.data for m in msgs if m.from_client] == [f"q{k}".encode() for k in range(1, 7)]
    ts = [m.ts for m in msgs]
    assert ts == sorted(ts) and len(set(ts)) > 5  # each stamped when its bytes came
    (call,) = ended(ev)
    assert (call.request_messages, call.response_messages) == (6, 5)


def test_reset_stream_ends_the_call_with_an_error():
    w = Wire()
    sid = w.request("/pkg.Chat/Talk", body=grpc_message(b"q"), end=False)
    w.client.reset_stream(sid, error_code=8)  # CANCEL
    w.pump()
    _, ev = run(w.chunks)
    (call,) = ended(ev)
    assert call.reset_code == 8 and call.reset_by_client and "reset" in call.error


def test_close_ends_open_calls_incomplete():
    w = Wire()
    w.request("/pkg.Chat/Talk", body=grpc_message(b"q"))
    conn, ev = run(w.chunks)
    assert not ended(ev)
    (end,) = conn.close(99)
    assert end.call.response_incomplete and "closed" in end.call.error


# ---- KServe v2 ---------------------------------------------------------------------------


def bytes_tensor(*vals):
    return b"".join(struct.pack("<I", len(v)) + v for v in vals)


def infer_request(model="tiny-gpt", rid="req-1", prompt=b"hello there", max_tokens=4,
                  counts=False):
    r = M.ModelInferRequest(model_name=model, model_version="1", id=rid)
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    r.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    r.raw_input_contents.extend([bytes_tensor(prompt), struct.pack("<i", max_tokens)])
    if counts:
        r.outputs.add(name="num_output_tokens")
    return r.SerializeToString()


def infer_response(text=b"", rid="req-1", out_tokens=None, final=None):
    r = M.ModelInferResponse(model_name="tiny-gpt", model_version="1", id=rid)
    if text:
        r.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        r.raw_output_contents.append(bytes_tensor(text))
    if out_tokens is not None:
        r.outputs.add(name="num_output_tokens", datatype="UINT32", shape=[1])
        r.raw_output_contents.append(struct.pack("<I", out_tokens))
    if final is not None:
        r.parameters["triton_final_response"].bool_param = final
    return r


def test_kserve_unary_request_and_response():
    f = kserve.KServeFollower("ModelInfer")
    f.request_message(10, infer_request(max_tokens=7))
    f.response_message(50, infer_response(b" a b c", out_tokens=7).SerializeToString())
    q, r = f.end(60)
    assert (q.model, q.model_version, q.request_id, q.max_tokens) == ("tiny-gpt", "1", "req-1", 7)
    assert q.inputs == ["text_input:BYTES[1]", "max_tokens:INT32[1]"]
    assert q.operation == "text_completion" and not q.stream
    assert (r.output_tokens, r.usage_source, r.first_token_ts) == (7, "num_output_tokens", 50)


def test_kserve_stream_counts_responses_that_carry_output():
    f = kserve.KServeFollower("ModelStreamInfer")
    f.request_message(10, infer_request())
    for k in range(3):
        sm = M.ModelStreamInferResponse(infer_response=infer_response(b" t%d" % k))
        f.response_message(100 + k, sm.SerializeToString())
    empty_final = M.ModelStreamInferResponse(infer_response=infer_response(final=True))
    f.response_message(200, empty_final.SerializeToString())
    q, r = f.end(201)
    assert q.stream and r.streamed
    assert (r.output_tokens, r.usage_source, r.chunks) == (3, "stream_chunks", 4)
    assert r.first_token_ts == 100 and r.token_ts == [100, 101, 102] and r.done_marker


def test_kserve_stream_error_message_and_garbage():
    for keep in (False, True):
        f = kserve.KServeFollower("ModelStreamInfer", keep_content=keep)
        f.request_message(1, b"\xff\xff\xff")
        f.response_message(2, M.ModelStreamInferResponse(error_message="boom")
                           .SerializeToString())
        f.response_message(3, b"\x0a\xff")
        q, r = f.end(4)
        assert not q.parsed and q.error
        # the server's error text can echo the prompt: kept only with content
        assert (r.error_type, r.error_message, r.parse_errors) == (
            "stream_error", "boom" if keep else None, 1)
        assert r.first_token_ts is None and r.output_tokens is None


# ---- through the tracker, into spans ------------------------------------------------------


def track(chunks, existing=False):
    """Feed (from_client, bytes) chunks as a server's socket events; records and spans."""
    records = []
    out = io.StringIO()
    spans = SpanBuilder(ExportContext(), [SimpleSpanProcessor(JsonlSpanExporter(out))])
    t = ConnectionTracker(lambda r: (records.append(r), spans.on_record(r)))
    pid, fd, cid = 100, 7, 5000
    if existing:
        t.socket_info(schema.SocketInfo(pid, fd, cid, 1, 2, "127.0.0.1", 8001, "127.0.0.1",
                                        5555, existing=True))
    else:
        t.conn_event(schema.ConnEvent(pid, pid, fd, 1, cid, C["CONN_ACCEPT"], 0, 0, 3, 2,
                                      "127.0.0.1", 5555))
    pos = {True: 0, False: 0}
    for i, (fc, data) in enumerate(chunks):
        ts = (i + 1) * 1000
        t.data_event(schema.DataEvent(pid, pid, fd, cid, ts - 10, ts, len(data), 0,
                                      C["SYS_READ"], C["DIR_IN"] if fc else C["DIR_OUT"],
                                      C["FLAG_LAST"], data, stream_off=pos[fc]))
        pos[fc] += len(data)
    spans.close()
    return t, records, [json.loads(x) for x in out.getvalue().splitlines()]


def kserve_conversation():
    w = Wire()
    a = w.request(INFER, body=grpc_message(infer_request(rid="u1", counts=True)))
    w.respond(a, [grpc_message(infer_response(b" x y", rid="u1", out_tokens=2)
                               .SerializeToString())])
    b = w.request(STREAM, body=grpc_message(infer_request(rid="s1")))
    w.respond(b, [grpc_message(M.ModelStreamInferResponse(
        infer_response=infer_response(b" t%d" % k, rid="s1", final=k == 4)).SerializeToString())
        for k in range(5)])
    c = w.request(INFER, body=grpc_message(infer_request(model="nope", rid="u2")))
    w.respond(c, trailers_only=True, status=5, message="unknown model")
    d = w.request("/pkg.Other/Thing", body=grpc_message(b"generic"))
    w.respond(d, [grpc_message(b"ok")], status=13, message="internal")
    return w


def test_kserve_calls_become_spans_with_rpc_and_genai_attributes():
    t, records, spans = track(kserve_conversation().chunks)
    assert len(records) == len(spans) == 4
    by_id = {s["attributes"].get("tokentrace.kserve.request_id"): s for s in spans}
    u1 = by_id["u1"]["attributes"]
    assert by_id["u1"]["name"] == "text_completion tiny-gpt"
    assert (u1["rpc.system"], u1["rpc.service"], u1["rpc.method"], u1["rpc.grpc.status_code"]) \
        == ("grpc", "inference.GRPCInferenceService", "ModelInfer", 0)
    assert u1["gen_ai.request.model"] == "tiny-gpt" and u1["gen_ai.usage.output_tokens"] == 2
    assert u1["tokentrace.api"] == "kserve-v2" and u1["network.protocol.version"] == "2"
    s1 = by_id["s1"]["attributes"]
    assert s1["rpc.method"] == "ModelStreamInfer" and s1["gen_ai.usage.output_tokens"] == 5
    assert s1["tokentrace.response.chunks"] == 5 and s1["tokentrace.request.stream"] is True
    assert s1["tokentrace.time_to_first_token"] > 0
    u2 = by_id["u2"]
    assert u2["attributes"]["rpc.grpc.status_code"] == 5 and u2["status"] != "ERROR"  # NOT_FOUND: client's fault
    (other,) = [s for s in spans if s["attributes"]["rpc.service"] == "pkg.Other"]
    assert other["name"] == "pkg.Other/Thing" and other["status"] == "ERROR"
    assert other["attributes"]["rpc.grpc.status_code"] == 13
    assert "gen_ai.request.model" not in other["attributes"]
    assert t.stats["connections_http2"] == 1 and t.stats["requests"] == 4


def test_ttft_is_request_start_to_first_output_message():
    _, records, _ = track(kserve_conversation().chunks)
    rec = next(r for r in records if r.rpc.service_method[1] == "ModelStreamInfer")
    assert rec.llm_response.first_token_ts is not None
    assert rec.ttft_ns == rec.llm_response.first_token_ts - rec.start_ns > 0
    assert rec.start_ns <= rec.ttft_ns + rec.start_ns <= rec.end_ns


def test_server_settings_sent_before_the_client_preface():
    w = kserve_conversation()
    chunks = list(w.chunks)
    # reorder: the server's first SETTINGS reaches the socket before the client's preface
    first_server = next(i for i, (fc, _) in enumerate(chunks) if not fc)
    chunks.insert(0, chunks.pop(first_server))
    _, records, _ = track(chunks)
    assert len(records) == 4


def test_existing_connection_found_at_attach_is_traced_from_its_next_request():
    w = kserve_conversation()
    before = len(w.chunks)
    e = w.request(STREAM, body=grpc_message(infer_request(rid="late")))
    w.respond(e, [grpc_message(M.ModelStreamInferResponse(
        infer_response=infer_response(b" z", rid="late")).SerializeToString())])
    t, records, spans = track(w.chunks[before:], existing=True)
    (rec,) = records
    assert rec.role == "server"
    # the repeated :path and content-type were inserted into the table before the
    # attach: not decodable, and counted; the call is gRPC by its framing and named
    # by its messages (a ModelInferRequest, then a ModelStreamInferResponse of its
    # model), which the span says
    assert rec.rpc.unknown_header_fields > 0
    assert t.stats["http2_header_blocks_undecodable"] >= 1
    assert t.stats["grpc_calls_by_framing"] == 1 and t.stats["kserve_methods_inferred"] == 1
    assert rec.rpc.framing_inferred and rec.rpc.service_method == (
        "inference.GRPCInferenceService", "ModelStreamInfer")
    assert rec.llm_request.request_id == "late" and rec.llm_request.stream
    assert rec.rpc.grpc_status is None  # its trailers' fields were not decodable
    (span,) = spans
    a = span["attributes"]
    assert span["name"] == "text_completion tiny-gpt"
    assert a["rpc.method"] == "ModelStreamInfer"
    assert a["tokentrace.grpc.framing_inferred"] and a["tokentrace.grpc.method_inferred"]
    assert a["gen_ai.usage.output_tokens"] == 1
    assert a["tokentrace.time_to_first_token"] > 0
    assert a["tokentrace.http2.unknown_header_fields"] == 6
    assert span["status"] != "ERROR"  # unknown status is not reported as a failure


def late_calls(*calls):
    """A connection's calls after one that built its header table, as a late attach
    sees them: ``calls`` are (path, request body, response messages)."""
    w = Wire()
    a = w.request(INFER, body=grpc_message(infer_request(rid="early")))
    w.respond(a, [grpc_message(infer_response(b" x", rid="early").SerializeToString())])
    w.request("/pkg.Other/Thing", body=grpc_message(b"early"), end=True)
    before = len(w.chunks)
    for path, body, responses in calls:
        sid = w.request(path, body=body)
        w.respond(sid, responses)
    return track(w.chunks[before:], existing=True)


def test_a_late_unary_call_is_named_by_its_response_and_keeps_its_counts():
    t, (rec,), (span,) = late_calls(
        (INFER, grpc_message(infer_request(rid="u9", counts=True)),
         [grpc_message(infer_response(b" a b", rid="u9", out_tokens=2).SerializeToString())]))
    assert rec.rpc.service_method[1] == "ModelInfer" and not rec.llm_request.stream
    a = span["attributes"]
    assert (a["rpc.method"], a["gen_ai.usage.output_tokens"]) == ("ModelInfer", 2)
    assert a["tokentrace.kserve.request_id"] == "u9"


def test_a_late_call_of_another_service_is_grpc_but_not_named():
    """Messages that are not a KServe request: gRPC by their framing, no method, no
    model, no tokens (rejected, counted), rather than a wrong name."""
    t, (rec,), (span,) = late_calls(
        ("/pkg.Other/Thing", grpc_message(b"\x0a\x03abc"), [grpc_message(b"ok")]))
    assert rec.rpc.framing_inferred and rec.rpc.service_method == (None, None)
    assert rec.llm_request is None and t.stats["kserve_inferred_rejected"] == 1
    a = span["attributes"]
    assert a["rpc.system"] == "grpc" and "rpc.method" not in a
    assert a["tokentrace.grpc.request_messages"] == 1
    assert "tokentrace.grpc.method_inferred" not in a


def test_a_late_call_that_is_not_framed_as_grpc_stays_plain_http2():
    t, (rec,), (span,) = late_calls(
        ("/pkg.Other/Thing", b'{"prompt": "hi"}', [b"ok"]))
    assert not rec.rpc.is_grpc and rec.protocol == "http/2"
    assert t.stats["grpc_calls_by_framing"] == 0
    assert "rpc.system" not in span["attributes"]


def test_grpc_framing_is_whole_prefixed_messages():
    one, two = grpc_message(b"abc"), grpc_message(b"", compressed=True)
    assert grpc.grpc_framed(one) and grpc.grpc_framed(one + two)
    assert not grpc.grpc_framed(one[:-1])  # ends inside its message in a small frame
    assert not grpc.grpc_framed(one + b"\x00")  # a prefix cut short
    assert not grpc.grpc_framed(b"\x02" + one[1:])  # no such flag
    assert not grpc.grpc_framed(b"") and not grpc.grpc_framed(b"{\"a\": 1}")
    big = grpc_message(b"x" * 40000)
    assert grpc.grpc_framed(big[:16384])  # a message larger than its frame
    rng = random.Random(3)
    for _ in range(2000):  # fuzz: never raises
        grpc.grpc_framed(bytes(rng.randrange(256) for _ in range(rng.randrange(12))))


def test_a_response_tells_the_method_only_when_it_names_the_model():
    unary = infer_response(b" a").SerializeToString()
    stream = M.ModelStreamInferResponse(infer_response=infer_response(b" a")).SerializeToString()
    assert kserve.method_of_response(unary, "tiny-gpt") == "ModelInfer"
    assert kserve.method_of_response(stream, "tiny-gpt") == "ModelStreamInfer"
    assert kserve.method_of_response(stream, "other") is None
    err = M.ModelStreamInferResponse(error_message="tiny-gpt").SerializeToString()
    # an error-only stream response is wire-identical to a bare ModelInferResponse
    assert kserve.method_of_response(err, "tiny-gpt") == "ModelInfer"
    assert kserve.method_of_response(b"\xff\xff", "tiny-gpt") is None
    assert kserve.inference_request(infer_request()) is not None
    assert kserve.inference_request(b"\x0a\x03abc") is None  # a name, no inputs
    bad = M.ModelInferRequest(model_name="m")
    bad.inputs.add(name="x", datatype="STRING", shape=[1])  # no such KServe datatype
    assert kserve.inference_request(bad.SerializeToString()) is None


# ---- compressed messages -----------------------------------------------------------------


def gzip_bytes(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=31)
    return c.compress(data) + c.flush()


def test_compressed_kserve_messages_inflate_with_each_directions_encoding():
    w = Wire()
    a = w.request(INFER, extra=[("grpc-encoding", "gzip")], body=grpc_message(
        gzip_bytes(infer_request(rid="z1", max_tokens=3, counts=True)), compressed=True))
    resp = infer_response(b" a b c", rid="z1", out_tokens=3).SerializeToString()
    w.respond(a, [grpc_message(zlib.compress(resp), compressed=True)],  # grpc-core's deflate
              extra=[("grpc-encoding", "deflate")])
    t, records, spans = track(w.chunks)
    (rec,) = records
    assert rec.rpc.compressed_messages == 2
    assert (rec.llm_request.request_id, rec.llm_request.max_tokens) == ("z1", 3)
    assert rec.llm_response.output_tokens == 3 and rec.llm_response.parse_errors == 0
    assert rec.llm_request.error is None
    (span,) = spans
    assert span["attributes"]["gen_ai.usage.output_tokens"] == 3
    assert t.stats["grpc_messages_decompressed"] == 2


def test_decompress_is_bounded_and_says_why_it_failed():
    assert grpc.decompress(gzip_bytes(b"hi"), "gzip") == (b"hi", None)
    assert grpc.decompress(zlib.compress(b"hi"), "deflate") == (b"hi", None)
    assert grpc.decompress(gzip_bytes(b"hi"), "GZIP ") == (b"hi", None)
    bomb = zlib.compress(bytes(256 << 20), 9)  # 256 MiB of zeros in ~250 KB
    t0 = time.monotonic()
    assert grpc.decompress(bomb, "deflate", limit=1 << 20) == (None, "too_large")
    assert time.monotonic() - t0 < 0.5  # stopped at the cap, not inflated whole
    assert grpc.decompress(bytes(4 << 20), "deflate") == (None, "corrupt")
    assert grpc.decompress(gzip_bytes(b"x" * 100)[:-9], "gzip") == (None, "corrupt")  # cut
    assert grpc.decompress(gzip_bytes(b"x") + b"junk", "gzip") == (None, "corrupt")
    assert grpc.decompress(b"\x00" * 8, "snappy") == (None, "unknown_encoding")
    assert grpc.decompress(b"\x00" * 8, None) == (None, "unknown_encoding")


def test_uninflatable_messages_are_counted_and_keep_no_bytes():
    w = Wire()
    a = w.request(STREAM, extra=[("grpc-encoding", "gzip")], body=grpc_message(
        b"not gzip at all", compressed=True))
    good = M.ModelStreamInferResponse(infer_response=infer_response(b" t", rid="q")
                                      ).SerializeToString()
    w.respond(a, [grpc_message(gzip_bytes(good), compressed=True),
                  grpc_message(zlib.compress(good), compressed=True)],  # not the declared one
              extra=[("grpc-encoding", "gzip")])
    b = w.request("/pkg.Echo/Say", body=grpc_message(gzip_bytes(b"hi"), compressed=True))
    w.respond(b, [grpc_message(b"ok")])  # compressed without a grpc-encoding: unknown
    t, records, _ = track(w.chunks)
    stream = next(r for r in records if r.rpc.service_method[1] == "ModelStreamInfer")
    assert stream.llm_request.error == "request gzip message corrupt"
    assert stream.llm_request.model is None  # nothing guessed from undecoded bytes
    assert stream.llm_response.chunks == 2 and stream.llm_response.parse_errors == 1
    assert stream.llm_response.text_chunks == 1
    assert t.stats["grpc_decompress_corrupt"] == 2
    assert t.stats["grpc_decompress_unknown_encoding"] == 1
    assert t.stats["grpc_messages_decompressed"] == 1
