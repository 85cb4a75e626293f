"""`tokentrace report`: spans written by the real exporter in, CSV/JSON/HTML out."""

import argparse
import csv
import json
import subprocess
import sys
from html.parser import HTMLParser

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from protocols.openai import LLMRequest, LLMResponse
from tracer.correlate.cost import GpuPricing
from tracer.correlate.records import ChildSpan, RequestRecord
from tracer.export.context import ExportContext
from tracer.export.jsonl import JsonlSpanExporter
from tracer.export.spans import SpanBuilder
from tracer.report.cli import add_parser, main
from tracer.report.rows import COLUMNS

MS = 1_000_000
H100 = GpuPricing(3.78, "NVIDIA H100 80GB HBM3", "default:h100-sxm")
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def record(i, model="tiny", tenant="t-a", ttft_ms=20, prompt=3, output=16, gpu_ms=40.0,
           launches=120, **kw):
    """Request ``i``: starts i*100 ms in; tokens 10 ms apart after the first."""
    t0 = 1_000 * MS + i * 100 * MS
    r = RequestRecord(pid=42, fd=5, conn_id=i, exchange=0, role="server", method="POST",
                      target="/v1/chat/completions", http_version="1.1", status=200,
                      start_ns=t0, end_ns=t0 + 500 * MS, family=2, local_addr="127.0.0.1",
                      local_port=8000, peer_addr="127.0.0.1", peer_port=5000 + i,
                      tids=[42], tenant=tenant)
    r.llm_request = LLMRequest("chat", model=model, stream=True, max_tokens=32)
    first = t0 + ttft_ms * MS
    r.llm_response = LLMResponse(status=200, streamed=True, model=model, input_tokens=prompt,
                                 output_tokens=output, usage_source="usage",
                                 first_chunk_ts=first, first_token_ts=first,
                                 token_ts=[first + k * 10 * MS for k in range(3)])
    if gpu_ms is not None:
        r.gpu.update({
            "gpu.kernel_launches": launches, "gpu.graph_launches": 2,
            "gpu.prefill_launches": launches // 4, "gpu.decode_launches": launches - launches // 4,
            "gpu.steps": output, "gpu.memcpy_bytes.h2d": 4096, "gpu.memcpy_bytes.d2h": 512,
            "gpu.time_ms": gpu_ms, "gpu.time_method": "step_span",
            "gpu.attribution": "step_share"})
        r.gpu.update(H100.attributes(gpu_ms))  # what the correlator will do
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def write_spans(path, records):
    b = SpanBuilder(ExportContext(capture_id="cap-report", clock_offset_ns=10**18),
                    [SimpleSpanProcessor(JsonlSpanExporter(str(path)))])
    for r in records:
        b.on_record(r)
    b.close()


@pytest.fixture
def spans(tmp_path):
    recs = [
        record(0, ttft_ms=10, prompt=100, gpu_ms=40.0),
        record(1, ttft_ms=20, prompt=200, gpu_ms=80.0,
               children=[ChildSpan("prefill", 1_100 * MS, 1_120 * MS, {"x": 1}),
                         ChildSpan("decode", 1_120 * MS, 1_600 * MS)]),
        record(2, ttft_ms=30, prompt=300, gpu_ms=120.0, tenant="t-b",
               request_headers={"traceparent": TP}),
        record(3, ttft_ms=40, prompt=400, gpu_ms=None, tenant=None),  # no GPU data
        record(4, model="big", tenant="t-b", ttft_ms=200, output=8, gpu_ms=400.0, status=503),
    ]
    recs[0].llm_request.prompt = "user: secret prompt"  # captured content (opt-in)
    recs[0].llm_response.text = "secret completion"
    path = tmp_path / "spans.jsonl"
    write_spans(path, recs)
    return path


def run_report(*argv):
    parser = argparse.ArgumentParser(prog="tokentrace")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", *map(str, argv)])
    return args.func(args)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_requests_csv_and_json(spans, tmp_path, capsys):
    out = tmp_path / "rep"
    assert run_report(spans, "-o", out) == 0
    assert "5 request(s), 2 child span(s) skipped" in capsys.readouterr().err
    rows = read_csv(out / "requests.csv")
    assert list(rows[0]) == list(COLUMNS)
    assert len(rows) == 5  # the prefill/decode children are not requests
    by_port = {r["span_id"]: r for r in rows}
    assert len(by_port) == 5
    first = min(rows, key=lambda r: int(r["start_time_unix_nano"]))
    assert first["model"] == "tiny" and first["tenant"] == "t-a" and first["status"] == "ok"
    assert first["protocol"] == "http/1.1" and first["api"] == "openai"
    assert first["stream"] == "true" and first["http_status"] == "200"
    assert first["prompt_tokens"] == "100" and first["output_tokens"] == "16"
    assert float(first["ttft_ms"]) == pytest.approx(10)
    assert float(first["tpot_ms"]) == pytest.approx(10)
    assert float(first["e2e_ms"]) == pytest.approx(500)
    assert first["start_time"].startswith("2001-09-09T01:46:41.000")  # 10**18 ns + 1 s
    assert first["gpu_launches"] == "120" and first["gpu_graph_launches"] == "2"
    assert first["gpu_prefill_launches"] == "30" and first["gpu_decode_launches"] == "90"
    assert first["memcpy_bytes_h2d"] == "4096" and first["memcpy_bytes_d2d"] == ""
    assert float(first["gpu_ms"]) == 40.0 and first["gpu_time_method"] == "step_span"
    assert float(first["gpu_ms_per_output_token"]) == pytest.approx(40 / 16)
    assert float(first["cost_usd"]) == pytest.approx(40 / 3.6e6 * 3.78)
    assert first["price_per_gpu_hour"] == "3.78" and first["price_source"] == "default:h100-sxm"
    assert first["gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert first["attribution"] == "step_share" and first["service"]

    failed = next(r for r in rows if r["model"] == "big")
    assert failed["status"] == "error" and failed["error"] == "503"
    caller = next(r for r in rows if r["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736")
    assert caller["prompt_tokens"] == "300"  # a request continuing a caller's trace
    # no GPU data: empty cells, not zeros
    bare = next(r for r in rows if r["prompt_tokens"] == "400")
    for col in ("gpu_launches", "gpu_ms", "gpu_ms_per_output_token", "cost_usd", "tenant",
                "attribution", "price_per_gpu_hour"):
        assert bare[col] == "", col

    doc = json.loads((out / "requests.json").read_text())
    assert [d["span_id"] for d in doc] == [r["span_id"] for r in rows]
    bare_json = next(d for d in doc if d["prompt_tokens"] == 400)
    assert bare_json["gpu_ms"] is None and bare_json["cost_usd"] is None
    assert bare_json["tenant"] is None and bare_json["stream"] is True


def test_summaries_by_model_and_tenant(spans, tmp_path):
    out = tmp_path / "rep"
    assert run_report(spans, "-o", out, "--format", "csv,json") == 0
    models = {r["model"]: r for r in read_csv(out / "by_model.csv")}
    tiny = models["tiny"]
    assert tiny["requests"] == "4" and tiny["errors"] == "0"
    assert float(tiny["ttft_p50_ms"]) == pytest.approx(25)  # 10, 20, 30, 40
    assert float(tiny["ttft_p95_ms"]) == pytest.approx(38.5)
    # GPU-ms per output token over the requests that have both: (40+80+120) / 48
    assert float(tiny["gpu_ms_per_output_token"]) == pytest.approx(240 / 48)
    assert float(tiny["cost_usd_total"]) == pytest.approx(240 / 3.6e6 * 3.78)
    assert float(tiny["cost_usd_mean"]) == pytest.approx(80 / 3.6e6 * 3.78)
    assert tiny["priced_requests"] == "3" and tiny["prompt_tokens"] == "1000"
    assert models["big"]["errors"] == "1"
    assert list(models) == ["big", "tiny"]  # most expensive first
    tenants = {r["tenant"]: r for r in read_csv(out / "by_tenant.csv")}
    assert set(tenants) == {"t-a", "t-b", ""}  # "" is requests without a tenant
    assert float(tenants["t-b"]["cost_usd_total"]) == pytest.approx(520 / 3.6e6 * 3.78)
    assert tenants[""]["cost_usd_total"] == "" and tenants[""]["requests"] == "1"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["input"]["requests"] == 5 and summary["input"]["child_spans_skipped"] == 2
    assert summary["totals"]["gpu_ms"] == pytest.approx(640)
    assert any(t["tenant"] is None for t in summary["by_tenant"])
    assert not (out / "report.html").exists()


class PageParser(HTMLParser):
    """Collects the tags of the page and the <svg>s inside each <figure>."""

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.figures, self.attrs = [], [], {}, []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend(attrs)
        if tag == "figure":
            self.figures[dict(attrs)["id"]] = 0
        if tag == "svg" and "figure" in self.stack:
            self.figures[list(self.figures)[-1]] += 1
        self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend(attrs)

    def handle_endtag(self, tag):
        assert tag in self.stack, f"</{tag}> closes nothing"
        while self.stack.pop() != tag:
            pass


def test_html_is_self_contained_with_one_svg_per_plot_and_no_prompt(spans, tmp_path):
    out = tmp_path / "rep"
    assert run_report(spans, "-o", out) == 0
    page = (out / "report.html").read_text()
    p = PageParser()
    p.feed(page)
    p.close()
    assert p.figures == {"cost-per-request": 1, "ttft-vs-prompt": 1, "gpu-ms-per-token": 1,
                         "cost-by-tenant": 1}
    assert page.count("<svg") == 4
    for tag in ("script", "link", "img", "iframe", "object", "embed"):
        assert tag not in p.tags, tag
    for name, value in p.attrs:
        assert name != "src", value
        if name.endswith("href"):
            # only references inside the page, or an embedded (rasterised) image
            assert value.startswith(("#", "data:image/png;base64,")), value[:40]
    assert "<h2>By model</h2>" in page and "<h2>By tenant</h2>" in page and "t-b" in page
    top = page[page.index("Most expensive requests"):]
    assert top.count("<tr>") == 1 + 4  # header + the 4 requests with a cost
    assert "4bf92f3577b34da6a3ce929d0e0e4736" in top  # by trace id, to find it in Jaeger
    for f in out.iterdir():  # prompts and completions never reach any report file
        assert "secret" not in f.read_text(), f.name
    assert "secret prompt" in spans.read_text()  # though the spans carried them


def test_many_points_are_embedded_as_an_image_inside_the_svg(spans, tmp_path, monkeypatch):
    from tracer.report import page

    out = tmp_path / "rep"
    assert run_report(spans, "-o", out, "--format", "html") == 0
    vector = (out / "report.html").read_text()
    monkeypatch.setattr(page, "RASTER_ABOVE", 2)
    assert run_report(spans, "-o", out, "--format", "html") == 0
    raster = (out / "report.html").read_text()
    assert "data:image/png" not in vector
    assert raster.count('href="data:image/png;base64,') == 2  # the two scatter plots
    assert raster.count("<svg") == 4


def test_malformed_lines_are_counted_and_skipped(spans, tmp_path, capsys):
    good = spans.read_text().splitlines()
    bad = ["not json", "[1, 2]", '{"name": "x"}', good[0][: len(good[0]) // 2], ""]
    spans.write_text("\n".join([bad[0], *good[:2], *bad[1:], *good[2:]]) + "\n")
    out = tmp_path / "rep"
    assert run_report(spans, "-o", out) == 0
    err = capsys.readouterr().err
    assert f"skipped 4 malformed line(s) of {len(good) + 4}" in err
    assert "line 1: not JSON" in err and "line 4: a JSON list, not a span object" in err
    assert "line 5: no 'attributes' object" in err
    assert len(read_csv(out / "requests.csv")) == 5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["input"]["bad_lines"] == 4
    assert "4 malformed line(s) skipped" in (out / "report.html").read_text()


def test_client_strings_cannot_become_spreadsheet_formulas(tmp_path):
    path = tmp_path / "s.jsonl"
    write_spans(path, [record(0, model="=HYPERLINK(\"http://x\")")])
    assert run_report(path, "-o", tmp_path / "rep", "--format", "csv,json") == 0
    (row,) = read_csv(tmp_path / "rep" / "requests.csv")
    assert row["model"] == "'=HYPERLINK(\"http://x\")"
    (doc,) = json.loads((tmp_path / "rep" / "requests.json").read_text())
    assert doc["model"] == "=HYPERLINK(\"http://x\")"  # JSON keeps the value as it was


def test_wrong_types_are_left_empty_and_counted(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    write_spans(path, [record(0)])
    span = json.loads(path.read_text())
    span["attributes"]["gen_ai.usage.output_tokens"] = "sixteen"
    span["attributes"]["tokentrace.gpu.time_ms"] = -5
    path.write_text(json.dumps(span) + "\n")
    assert run_report(path, "-o", tmp_path / "rep", "--format", "csv") == 0
    assert "2 attribute value(s) of the wrong type" in capsys.readouterr().err
    (row,) = read_csv(tmp_path / "rep" / "requests.csv")
    assert row["output_tokens"] == "" and row["gpu_ms"] == ""
    assert row["gpu_ms_per_output_token"] == "" and row["prompt_tokens"] == "3"


def test_unusable_inputs_are_clear_errors(tmp_path, capsys, openai_capture):
    assert run_report(tmp_path / "missing.jsonl", "-o", tmp_path / "r") == 1
    assert "cannot read" in capsys.readouterr().err and not (tmp_path / "r").exists()
    assert run_report(openai_capture, "-o", tmp_path / "r") == 1  # a capture, not spans
    err = capsys.readouterr().err
    assert "is a span" in err and "replay" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert run_report(empty, "-o", tmp_path / "r") == 0
    assert "no request spans" in capsys.readouterr().err
    assert read_csv(tmp_path / "r" / "requests.csv") == []
    with pytest.raises(SystemExit):
        run_report(empty, "--format", "pdf")
    with pytest.raises(SystemExit):
        run_report(empty, "--gpu-price", "-1")


def test_repricing(spans, tmp_path):
    out = tmp_path / "rep"
    assert run_report(spans, "-o", out, "--gpu-price", "7.2", "--format", "json") == 0
    doc = json.loads((out / "requests.json").read_text())
    for d in doc:
        if d["gpu_ms"] is None:
            assert d["cost_usd"] is None and d["price_per_gpu_hour"] is None
        else:
            assert d["cost_usd"] == pytest.approx(d["gpu_ms"] / 3.6e6 * 7.2)
            assert d["price_source"] == "report:explicit"
            assert d["gpu_model"] == "NVIDIA H100 80GB HBM3"  # kept from the span
    assert run_report(spans, "-o", out, "--gpu-model", "l4", "--format", "json") == 0
    doc = json.loads((out / "requests.json").read_text())
    priced = [d for d in doc if d["gpu_ms"] is not None]
    assert all(d["price_per_gpu_hour"] == 0.80 and d["gpu_model"] == "l4" for d in priced)


def test_main_takes_the_namespace_and_python_m_runs_it(spans, tmp_path):
    out = tmp_path / "rep"
    args = argparse.Namespace(spans=str(spans), output=str(out), format={"csv"},
                              gpu_price=None, gpu_model=None)
    assert main(args) == 0 and (out / "requests.csv").exists()
    r = subprocess.run([sys.executable, "-m", "tracer.report", str(spans), "-o", str(out),
                        "--format", "html"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "report.html" in r.stderr and (out / "report.html").stat().st_size > 10_000
    r = subprocess.run([sys.executable, "-m", "tracer.report", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: tokentrace report")
    assert "examples:" in r.stdout


def test_a_replayed_capture_end_to_end(openai_capture, tmp_path):
    """The committed capture of the sample server, replayed to JSONL, then reported."""
    spans = tmp_path / "s.jsonl"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(openai_capture),
                        "--jsonl", str(spans), "-q"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    expected = json.loads(openai_capture.with_name("openai-http1.expected.json").read_text())
    assert run_report(spans, "-o", tmp_path / "rep") == 0
    rows = sorted(read_csv(tmp_path / "rep" / "requests.csv"),
                  key=lambda r: int(r["start_time_unix_nano"]))
    assert len(rows) == len(expected)
    for want, row in zip(expected, rows):
        assert row["http_status"] == str(want["status"])
        assert row["output_tokens"] == ("" if want["output_tokens"] is None
                                        else str(want["output_tokens"]))
        assert row["gpu_ms"] == "" and row["cost_usd"] == ""  # no GPU in that capture
    assert (tmp_path / "rep" / "report.html").read_text().count("<svg") == 4


def test_every_column_is_documented():
    from pathlib import Path

    from tracer.report.summary import SUMMARY_COLUMNS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "report.md").read_text()
    for col in [*COLUMNS, *SUMMARY_COLUMNS]:
        assert f"`{col}`" in doc, col


def test_reconciliation_balances_on_a_real_run(tmp_path):
    """Replay of HF serve on an H100 with --summary, then `report --summary`: the
    requests' costs plus the unattributed and idle rest are the GPU's window cost."""
    from tests.conftest import CAPTURES
    spans, summary = tmp_path / "s.jsonl", tmp_path / "sum.json"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay",
                        str(CAPTURES / "hf-cb-c32-h100.ttcap"), "--quiet", "--gpu-price", "3.6",
                        "--jsonl", str(spans), "--summary", str(summary)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "launches 199705 observed = 199705.0 charged + 0.0 unattributed" in r.stderr
    out = tmp_path / "rep"
    r = subprocess.run([sys.executable, "-m", "tracer", "report", str(spans), "-o", str(out),
                        "--summary", str(summary)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads((out / "reconciliation.json").read_text())
    assert row["price_per_gpu_hour"] == 3.6
    assert row["window_usd"] == pytest.approx(row["window_s"] / 3600 * 3.6, rel=1e-6)
    assert row["requests_usd"] > 0 and row["idle_usd"] >= 0
    assert row["balance_usd"] == pytest.approx(0, abs=1e-6)
    assert row["launches_charged"] + row["launches_unattributed"] == \
        pytest.approx(row["launches_observed"])
    page = (out / "report.html").read_text()
    assert "Reconciliation with the GPU" in page and 'class="scroll"' in page
    # a span file that is only part of the run does not balance, and the page says why
    part = tmp_path / "part.jsonl"
    part.write_text("".join(spans.read_text().splitlines(keepends=True)[:100]))
    r = subprocess.run([sys.executable, "-m", "tracer", "report", str(part), "-o",
                        str(tmp_path / "rep2"), "--summary", str(summary)],
                       capture_output=True, text=True)
    (row2,) = json.loads((tmp_path / "rep2" / "reconciliation.json").read_text())
    assert row2["balance_usd"] > 1e-6


def test_streamed_and_whole_latencies_are_not_mixed():
    from tracer.report.summary import summarise
    rows = [{"stream": True, "ttft_ms": 10.0, "e2e_ms": 500.0},
            {"stream": True, "ttft_ms": 30.0, "e2e_ms": 600.0},
            {"stream": False, "ttft_ms": 900.0, "e2e_ms": 900.0}]
    s = summarise(rows)
    assert s["ttft_p50_ms"] == 20.0 and s["ttft_p95_ms"] == pytest.approx(29.0)
    assert s["whole_p50_ms"] == 900.0
