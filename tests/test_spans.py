"""Records to OpenTelemetry spans: names, attributes, traceparent, ids, privacy."""

import io
import json

from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from protocols.openai import LLMRequest, LLMResponse
from tracer.correlate.records import ChildSpan, RequestRecord
from tracer.events.schema import ProcessInfo
from tracer.export.context import ExportContext
from tracer.export.jsonl import JsonlSpanExporter
from tracer.export.spans import SpanBuilder, service_name_for

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def record(**kw):
    r = RequestRecord(pid=42, fd=5, conn_id=9, exchange=0, role="server", method="POST",
                      target="/v1/chat/completions?x=1", http_version="1.1", status=200,
                      start_ns=1_000_000_000, end_ns=1_500_000_000, family=2,
                      local_addr="127.0.0.1", local_port=8000, peer_addr="127.0.0.1",
                      peer_port=5000, tids=[42, 43])
    r.llm_request = LLMRequest("chat", model="tiny", stream=True, max_tokens=16,
                               prompt="user: secret prompt")
    r.llm_response = LLMResponse(status=200, streamed=True, model="tiny", input_tokens=3,
                                 output_tokens=16, usage_source="usage",
                                 first_chunk_ts=1_010_000_000, first_token_ts=1_020_000_000,
                                 token_ts=[1_020_000_000, 1_030_000_000, 1_050_000_000],
                                 text="secret completion")
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def export(records, ctx=None):
    buf = io.StringIO()
    ctx = ctx or ExportContext(capture_id="cap1", clock_offset_ns=10**18)
    b = SpanBuilder(ctx, [SimpleSpanProcessor(JsonlSpanExporter(buf))])
    for r in records:
        b.on_record(r)
    b.close()
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_genai_and_tokentrace_attributes():
    (s,) = export([record()])
    a = s["attributes"]
    assert s["name"] == "chat tiny" and s["kind"] == "SERVER"
    assert s["start_time_unix_nano"] == 10**18 + 1_000_000_000
    assert s["end_time_unix_nano"] == 10**18 + 1_500_000_000
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.request.max_tokens"] == 16 and a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.input_tokens"] == 3 and a["gen_ai.usage.output_tokens"] == 16
    assert abs(a["gen_ai.response.time_to_first_chunk"] - 0.010) < 1e-9
    assert abs(a["tokentrace.time_to_first_token"] - 0.020) < 1e-9
    assert abs(a["tokentrace.time_per_output_token"] - 0.015) < 1e-9
    assert a["http.response.status_code"] == 200 and a["url.path"] == "/v1/chat/completions"
    assert a["server.port"] == 8000 and a["client.port"] == 5000
    assert a["process.pid"] == 42 and a["thread.id"] == 42
    assert not any(k.startswith("gen_ai.server.") for k in a)  # those are metric names
    assert [e["name"] for e in s["events"]] == ["tokentrace.first_token"]
    assert s["status"] == "UNSET"


def test_prompts_are_not_exported_unless_captured():
    r = record()
    r.llm_request.prompt = None
    r.llm_response.text = None
    text = json.dumps(export([r]))
    assert "secret" not in text
    # with content captured (the user opted in), it is exported
    assert "secret prompt" in json.dumps(export([record()]))


def test_traceparent_continues_the_callers_trace():
    (s,) = export([record(request_headers={"traceparent": TP})])
    assert s["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert s["parent_span_id"] == "00f067aa0ba902b7"


def test_ids_are_stable_for_the_same_capture_and_differ_across_captures():
    a1, a2 = export([record()]), export([record()])
    assert (a1[0]["trace_id"], a1[0]["span_id"]) == (a2[0]["trace_id"], a2[0]["span_id"])
    b = export([record()], ExportContext(capture_id="cap2"))
    assert b[0]["trace_id"] != a1[0]["trace_id"]


def test_failure_sets_error_status():
    (s,) = export([record(error="process exited before the response completed", status=200)])
    assert s["status"] == "ERROR" and "process exited" in s["status_message"]
    (s,) = export([record(status=503)])
    assert s["status"] == "ERROR" and s["attributes"]["error.type"] == "503"


def test_children_are_nested_under_the_request():
    r = record(children=[ChildSpan("prefill", 1_000_000_000, 1_020_000_000, {"x": 1})])
    spans = export([r])
    parent = next(s for s in spans if s["name"] == "chat tiny")
    child = next(s for s in spans if s["name"] == "prefill")
    assert child["parent_span_id"] == parent["span_id"]
    assert child["trace_id"] == parent["trace_id"]


def test_service_name_from_the_process():
    def info(*argv):
        return ProcessInfo(1, 0, "python3", "/usr/bin/python3.11", argv)
    assert service_name_for(info("python3", "-m", "vllm.entrypoints.openai.api_server")) == \
        "vllm.entrypoints.openai.api_server"
    assert service_name_for(info("/usr/bin/python3", "-u", "/srv/app/server.py")) == "server"
    assert service_name_for(ProcessInfo(1, 0, "tritonserver", "/opt/tritonserver",
                                        ("/opt/tritonserver", "--model-repo=/m"))) == "tritonserver"
    (s,) = export([record(process=None)], ExportContext(
        capture_id="c", processes={42: info("python3", "-m", "samples.openai_server")}))
    assert s["resource"]["service.name"] == "samples.openai_server"
