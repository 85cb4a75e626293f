"""Metrics agree with the spans they summarise: Prometheus scraped over HTTP and parsed
with prometheus_client's own parser; OTLP metrics received by a real HTTP endpoint and
decoded from protobuf."""

from __future__ import annotations

import dataclasses
import gzip
import http.server
import io
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tracer.correlate.connections import TrackerOptions
from tracer.events import capture
from tracer.export.context import ExportContext
from tracer.export.jsonl import JsonlSpanExporter
from tracer.export.metrics import DURATION_BUCKETS, TTFT_BUCKETS, PrometheusSink
from tracer.export.spans import SpanBuilder
from tracer.pipeline import Pipeline


class Keep:
    """A sink that keeps the records."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def on_record(self, rec: Any) -> None:
        self.records.append(rec)

    def close(self) -> None:
        pass


def replay(path: Path, *sinks: Any) -> list[dict[str, Any]]:
    """Feed a capture through the pipeline to ``sinks``; returns the JSONL spans."""
    reader = capture.CaptureReader(path)
    ctx = ExportContext(capture_id=reader.header["capture_id"], host="h")
    out = io.StringIO()
    builder = SpanBuilder(ctx, [SimpleSpanProcessor(JsonlSpanExporter(out))])
    p = Pipeline([*sinks, builder], ctx, TrackerOptions())
    for item in reader:
        p.feed(item)
    p.tracker.finish(p.last_ts)  # close the spans, keep the metric sinks serving
    builder.close()
    return [json.loads(x) for x in out.getvalue().splitlines()]


def scrape(port: int) -> dict[str, Any]:
    """Sample name + sorted labels -> value, from a real HTTP scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def expected_from_spans(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model, what the metrics must say, computed from the span attributes."""
    per: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(list))
    for s in spans:
        a = s["attributes"]
        if "gen_ai.operation.name" not in a:
            continue
        m = per[a.get("gen_ai.request.model") or a.get("gen_ai.response.model") or ""]
        m["e2e"].append((s["end_time_unix_nano"] - s["start_time_unix_nano"]) / 1e9)
        if "tokentrace.time_to_first_token" in a:
            m["ttft"].append(a["tokentrace.time_to_first_token"])
            if s["status"] != "ERROR":
                m["ttft_ok"].append(a["tokentrace.time_to_first_token"])
        m["input"].append(a.get("gen_ai.usage.input_tokens", 0))
        m["output"].append(a.get("gen_ai.usage.output_tokens", 0))
        if s["status"] == "ERROR":
            m["failures"].append(a["error.type"])
        else:
            m["successes"].append((a.get("gen_ai.response.finish_reasons") or ["unknown"])[0])
    return per


def check_prometheus(samples: dict[str, Any], spans: list[dict[str, Any]]) -> int:
    """Assert every metric against the spans; returns how many requests were checked."""
    def get(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    per = expected_from_spans(spans)
    assert per, "no LLM spans to check against"
    n = 0
    for model, m in per.items():
        lab = {"model_name": model}
        n += len(m["e2e"])
        for reason in set(m["successes"]):
            assert get("tokentrace_request_success_total", finished_reason=reason, **lab) == \
                m["successes"].count(reason)
        for err in set(m["failures"]):
            assert get("tokentrace_request_failure_total", error_type=err, **lab) == \
                m["failures"].count(err)
        assert get("tokentrace_prompt_tokens_total", **lab) == sum(m["input"])
        assert get("tokentrace_generation_tokens_total", **lab) == sum(m["output"])
        for name, values, buckets in (
                ("tokentrace_e2e_request_latency_seconds", m["e2e"], DURATION_BUCKETS),
                ("tokentrace_time_to_first_token_seconds", m["ttft"], TTFT_BUCKETS)):
            assert get(f"{name}_count", **lab) == len(values)
            assert get(f"{name}_sum", **lab) == pytest.approx(sum(values), rel=1e-6, abs=1e-6)
            for le in buckets:
                want = sum(1 for v in values if v <= le)
                assert get(f"{name}_bucket", le=str(le), **lab) == want, (name, le)
            assert get(f"{name}_bucket", le="+Inf", **lab) == len(values)
    return n


def test_prometheus_scrape_matches_the_spans_of_a_replay(openai_capture: Path) -> None:
    sink = PrometheusSink(0, "127.0.0.1")
    try:
        spans = replay(openai_capture, sink)
        samples = scrape(sink.port)
    finally:
        sink.close()
    checked = check_prometheus(samples, spans)
    assert checked == sum(1 for s in spans if "gen_ai.operation.name" in s["attributes"]) == 5
    # GET /health and /v1/models are not LLM requests: no metric carries them
    assert not any("health" in str(k) or "models" in str(k) for k in samples)
    # the GPU and cost counters exist but have no samples until a span carries them
    assert not any(name.startswith(("tokentrace_gpu", "tokentrace_cost")) for name, _ in samples)


def test_gpu_and_cost_counters_add_up_the_span_attributes(openai_capture: Path) -> None:
    keep = Keep()
    replay(openai_capture, keep)
    llm = [r for r in keep.records if r.is_llm]
    enriched = [dataclasses.replace(r, gpu={"gpu.kernel_launches": 100 + i,
                                            "gpu.time_ms": 2.5 * (i + 1),
                                            "cost.usd": 0.0001 * (i + 1)})
                for i, r in enumerate(llm)]
    sink = PrometheusSink(0, "127.0.0.1")
    try:
        for r in enriched:
            sink.on_record(r)
        samples = scrape(sink.port)
    finally:
        sink.close()
    by_model: dict[str, list[Any]] = defaultdict(list)
    for r in enriched:
        by_model[r.llm_request.model].append(r.gpu)
    for model, gpus in by_model.items():
        lab = (("model_name", model),)
        assert samples[("tokentrace_gpu_kernel_launches_total", lab)] == \
            sum(g["gpu.kernel_launches"] for g in gpus)
        assert samples[("tokentrace_gpu_time_seconds_total", lab)] == \
            pytest.approx(sum(g["gpu.time_ms"] for g in gpus) / 1000)
        assert samples[("tokentrace_cost_usd_total", lab)] == \
            pytest.approx(sum(g["cost.usd"] for g in gpus))


class OtlpReceiver(http.server.ThreadingHTTPServer):
    """A real OTLP/HTTP endpoint: keeps every decoded export request."""

    def __init__(self) -> None:
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces: list[ExportTraceServiceRequest] = []
        super().__init__(("127.0.0.1", free_port()), _OtlpHandler)


class _OtlpHandler(http.server.BaseHTTPRequestHandler):
    server: OtlpReceiver

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/metrics":
            self.server.metrics.append(ExportMetricsServiceRequest.FromString(body))
        elif self.path == "/v1/traces":
            self.server.traces.append(ExportTraceServiceRequest.FromString(body))
        self.send_response(200 if self.path in ("/v1/metrics", "/v1/traces") else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_metrics_of_a_replay_reach_a_real_endpoint(openai_capture: Path,
                                                        tmp_path: Path) -> None:
    srv = OtlpReceiver()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        jsonl = tmp_path / "spans.jsonl"
        r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(openai_capture),
                            "--otlp", f"http://127.0.0.1:{srv.server_address[1]}",
                            "--otlp-protocol", "http", "--otlp-metrics", "--jsonl", str(jsonl),
                            "--quiet"],
                           capture_output=True, text=True, timeout=120)
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == 0, r.stderr
    spans = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert sum(len(ss.spans) for t in srv.traces for rs in t.resource_spans
               for ss in rs.scope_spans) == len(spans) == 7
    latest: dict[tuple[Any, ...], Any] = {}  # cumulative temporality: the last point wins
    agent: dict[tuple[str, tuple[Any, ...]], Any] = {}  # the agent's health, its own resource
    services = set()
    for req in srv.metrics:
        for rm in req.resource_metrics:
            res = {kv.key: kv.value.string_value for kv in rm.resource.attributes}
            for sm in rm.scope_metrics:
                if sm.scope.name == "tokentrace.agent":
                    assert res["service.name"] == "tokentrace"
                    for metric in sm.metrics:
                        for p in metric.sum.data_points or metric.gauge.data_points:
                            attrs = tuple((kv.key, kv.value.string_value)
                                          for kv in p.attributes)
                            agent[(metric.name, attrs)] = p
                    continue
                services.add(res["service.name"])
                for metric in sm.metrics:
                    assert metric.unit == "s"
                    for p in metric.histogram.data_points:
                        attrs = tuple(sorted((kv.key, kv.value.string_value)
                                             for kv in p.attributes))
                        latest[(res["service.instance.id"], metric.name, attrs)] = p
    points: dict[str, list[Any]] = defaultdict(list)
    for (_, name, _), p in latest.items():
        points[name].append(p)
    assert services == {s["resource"]["service.name"] for s in spans
                        if "gen_ai.operation.name" in s["attributes"]}
    assert set(points) == {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
                           "gen_ai.server.time_per_output_token"}
    per = expected_from_spans(spans)
    for model, m in per.items():
        def of(name: str) -> list[Any]:
            return [p for p in points[name]
                    if {kv.key: kv.value.string_value for kv in p.attributes}
                    .get("gen_ai.request.model") == model]
        dur = of("gen_ai.server.request.duration")
        assert sum(p.count for p in dur) == len(m["e2e"])
        assert sum(p.sum for p in dur) == pytest.approx(sum(m["e2e"]), rel=1e-6)
        ttft = of("gen_ai.server.time_to_first_token")  # successful responses only
        assert sum(p.count for p in ttft) == len(m["ttft_ok"])
        assert sum(p.sum for p in ttft) == pytest.approx(sum(m["ttft_ok"]), rel=1e-6)
        for p in ttft:
            assert list(p.explicit_bounds) == list(TTFT_BUCKETS)
            assert sum(p.bucket_counts) == p.count
            assert p.bucket_counts[0] == sum(1 for v in m["ttft_ok"] if v <= TTFT_BUCKETS[0])
    assert sum(p.count for p in points["gen_ai.server.time_to_first_token"]) > 0
    # the agent's health: every loss counter as the capture's last report counted it;
    # its overhead meter did not measure, so no probe-cost figure (not a zero)
    ctx = ExportContext()
    p = Pipeline([], ctx, TrackerOptions())
    for item in capture.CaptureReader(openai_capture):
        p.feed(item)
    from tracer.events.wire import RING_LOSS_COUNTERS
    assert ctx.drops and set(agent) == {("tokentrace.records.lost", (("counter", name),))
                                        for name in RING_LOSS_COUNTERS}
    for name in RING_LOSS_COUNTERS:
        got = agent[("tokentrace.records.lost", (("counter", name),))]
        assert got.as_int == ctx.drops.get(name, 0)


@pytest.mark.bpf
def test_prometheus_of_a_live_run_matches_its_spans(tmp_path: Path) -> None:
    """`tokentrace run --prometheus` on the sample server: scraped while it runs, the
    metrics count exactly the requests the client made and agree with the spans."""
    from samples.launch import SampleServer
    from tests.live import TimedClient, traced_cli

    prom = free_port()
    out = tmp_path / "spans.jsonl"
    with SampleServer(port=free_port(), log=tmp_path / "server.log") as server:
        client = TimedClient(server.base_url)
        with traced_cli(["--port", str(server.port), "--prometheus", f"127.0.0.1:{prom}"],
                        str(out)) as run:
            made = [client.chat(stream=i % 2 == 0, max_tokens=2 + i) for i in range(6)]
            deadline = time.monotonic() + 30
            while True:  # the last response's record lands after its last byte
                samples = scrape(prom)
                done = sum(v for (n, _), v in samples.items()
                           if n == "tokentrace_request_success_total")
                if done >= len(made) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    assert run.returncode == 0, run.stderr
    spans = jsonl_spans(out)
    assert check_prometheus(samples, spans) == len(made) == 6
    lab = (("model_name", "tiny-gpt"),)
    assert samples[("tokentrace_generation_tokens_total", lab)] == \
        sum(m["output_tokens"] for m in made)
    assert samples[("tokentrace_time_to_first_token_seconds_count", lab)] == 6


def jsonl_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_agents_lost_records_and_probe_cost_are_served_from_its_counters(
        openai_capture: Path) -> None:
    from tracer.events.wire import RING_LOSS_COUNTERS

    ctx = ExportContext()
    sink = PrometheusSink(0, "127.0.0.1", ctx=ctx)
    try:
        reader = capture.CaptureReader(openai_capture)
        p = Pipeline([sink], ctx, TrackerOptions())
        for item in reader:
            p.feed(item)
        assert ctx.drops, "the capture's counter reports reached the context"
        got = scrape(sink.port)
        for name in RING_LOSS_COUNTERS:  # every loss counter, as the capture counted it
            assert got[("tokentrace_records_lost_total", (("counter", name),))] == \
                ctx.drops.get(name, 0)
        assert not any(k[0].startswith("tokentrace_probe_cpu") for k in got)  # not measured
        # a report from an agent whose overhead meter has measured (the session replaces
        # the dict whole each second, as here)
        ctx.drops = {**ctx.drops, "lost_data": 4, "probe_cpu_estimates": 3,
                     "probe_cpu_ppm": 6_200, "probe_cpu_probe_ns": 500_000_000,
                     "probe_cpu_traced_ns": 90_000_000_000}
        got = scrape(sink.port)
        assert got[("tokentrace_records_lost_total", (("counter", "lost_data"),))] == 4
        assert got[("tokentrace_probe_cpu_ratio", ())] == pytest.approx(0.0062)
        assert got[("tokentrace_probe_cpu_seconds_total", ())] == pytest.approx(0.5)
        assert got[("tokentrace_probe_cpu_measured_seconds_total", ())] == pytest.approx(90.0)
    finally:
        sink.close()


def test_the_agents_health_reaches_a_real_otlp_endpoint() -> None:
    """`--otlp-metrics`: the same figures as the Prometheus endpoint, under the agent's
    own resource, read from the counters at each export (here the last, at close)."""
    from tracer.export.metrics import OtlpMetricsSink

    srv = OtlpReceiver()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ctx = ExportContext(capture_id="c", host="node-7")
    try:
        sink = OtlpMetricsSink(ctx, f"http://127.0.0.1:{srv.server_address[1]}", "http",
                               interval_s=3600)
        ctx.drops = {"lost_data": 4, "lost_gpu": 1, "probe_cpu_estimates": 3,
                     "probe_cpu_ppm": 6_200, "probe_cpu_probe_ns": 500_000_000,
                     "probe_cpu_traced_ns": 90_000_000_000}
        sink.close()
    finally:
        srv.shutdown()
        srv.server_close()
    [req] = srv.metrics  # no request was traced: only the agent's provider exported
    [rm] = req.resource_metrics
    res = {kv.key: kv.value.string_value for kv in rm.resource.attributes}
    assert res["service.name"] == "tokentrace" and res["host.name"] == "node-7"
    got = {}
    for sm in rm.scope_metrics:
        for m in sm.metrics:
            for p in m.sum.data_points or m.gauge.data_points:
                got[(m.name, tuple((kv.key, kv.value.string_value) for kv in p.attributes))] = \
                    (p.as_int or p.as_double, m.unit, m.sum.is_monotonic)
    assert got[("tokentrace.records.lost", (("counter", "lost_data"),))] == (4, "{record}", True)
    assert got[("tokentrace.records.lost", (("counter", "lost_gpu"),))][0] == 1
    assert got[("tokentrace.probe.cpu.ratio", ())][:2] == (pytest.approx(0.0062), "1")
    assert got[("tokentrace.probe.cpu.time", ())] == (pytest.approx(0.5), "s", True)
    assert got[("tokentrace.probe.cpu.measured_time", ())][:2] == (pytest.approx(90.0), "s")


def test_metric_flags_fail_clearly(openai_capture: Path) -> None:
    def replay_with(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tracer", "replay", str(openai_capture),
                               "--quiet", *flags], capture_output=True, text=True, timeout=60)

    r = replay_with("--otlp-metrics")
    assert r.returncode != 0 and "--otlp-metrics needs --otlp" in r.stderr
    r = replay_with("--prometheus", "not-a-port")
    assert r.returncode == 2 and "PORT or ADDR:PORT" in r.stderr
    sink = PrometheusSink(0, "127.0.0.1")  # the port is taken
    try:
        r = replay_with("--prometheus", f"127.0.0.1:{sink.port}")
    finally:
        sink.close()
    assert r.returncode != 0 and "cannot serve metrics" in r.stderr
    assert "Traceback" not in r.stderr


def test_requests_a_duty_cycle_cut_are_no_failures_and_the_share_is_served(tmp_path):
    """`run --duty-cycle`: a request open when a window closes is cut by the tracer, not
    failed by the server: out of the metrics; the share traced is a gauge to divide by."""
    from bench.streamgen import generate
    from tracer.correlate.records import DUTY_CYCLE_CUT
    from tracer.events import schema

    items, _ = generate(rate=40, tokens=20, seconds=1.0, servers=1, gpu=False)
    half = len(items) // 2
    at = max(i.ts_exit for i in (schema.decode(x) for x in items[:half] if isinstance(x, bytes))
             if isinstance(i, schema.DataEvent))
    items = ([schema.TracingPaused(ts=0, paused=False, duty=0.5)] + items[:half]
             + [schema.TracingPaused(ts=at + 1, paused=True, switch_s=0.5, duty=0.5),
                schema.TracingPaused(ts=at + 10**10, paused=False, duty=0.5)])
    path = tmp_path / "duty.ttcap"
    w = capture.CaptureWriter(path, capture.new_header(), keep_secrets=True)
    for it in items:
        w.write(it)
    w.close()
    keep, prom = Keep(), PrometheusSink(free_port())
    try:
        spans = replay(path, keep, prom)
        got = scrape(prom.port)
    finally:
        prom.close()
    cut = [r for r in keep.records if r.cut_by_duty_cycle]
    whole = [r for r in keep.records if r.is_llm and not r.error]
    assert cut and whole and all(r.error == DUTY_CYCLE_CUT for r in cut)
    assert all(r.duty_cycle == 0.5 for r in keep.records)
    assert all(s["attributes"]["tokentrace.duty_cycle"] == 0.5 for s in spans)
    assert got[("tokentrace_traced_share", ())] == 0.5
    assert not [k for k in got if k[0].startswith("tokentrace_request_failure")]
    assert sum(v for k, v in got.items()
               if k[0] == "tokentrace_request_success_total") == len(whole)
