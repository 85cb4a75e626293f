"""End to end into Arize Phoenix: a real `phoenix serve`, spans exported by tokentrace
over OTLP (HTTP for a replay, gRPC for a live run), read back through Phoenix's REST
API and compared with the spans tokentrace wrote to JSONL in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from samples.launch import SampleServer
from tests.conftest import free_port
from tests.live import traced_cli


class Phoenix:
    """A `phoenix serve` of its own: free ports, a working directory in tmp."""

    def __init__(self, workdir: Path) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        env = {**os.environ, "PHOENIX_PORT": str(self.http_port),
               "PHOENIX_GRPC_PORT": str(self.grpc_port), "PHOENIX_HOST": "127.0.0.1",
               "PHOENIX_WORKING_DIR": str(workdir), "PHOENIX_TELEMETRY_ENABLED": "false"}
        self.log = workdir / "phoenix.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "phoenix.server.main", "serve"],
                                     env=env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_up(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("phoenix exited:\n" + self.log.read_text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("phoenix did not come up:\n" + self.log.read_text()[-3000:])

    def spans(self, project: str = "default") -> list[dict[str, Any]]:
        """Every span of a project, through Phoenix's REST API (all pages)."""
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            q = "?limit=500" + (f"&cursor={cursor}" if cursor else "")
            with urllib.request.urlopen(f"{self.url}/v1/projects/{project}/spans{q}",
                                        timeout=10) as r:
                page = json.loads(r.read())
            out.extend(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def wait_spans(self, trace_ids: set[str], count: int, timeout: float = 60.0
                   ) -> list[dict[str, Any]]:
        """The spans of ``trace_ids`` once ``count`` of them are in (ingest is async)."""
        deadline = time.monotonic() + timeout
        while True:
            got = [s for s in self.spans() if s["context"]["trace_id"] in trace_ids]
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    p = Phoenix(tmp_path_factory.mktemp("phoenix"))
    try:
        p.wait_up()
        yield p
    finally:
        p.stop()


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def same_attributes(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Phoenix keeps every attribute we sent, with its value."""
    for k, v in ours.items():
        assert k in theirs, f"Phoenix lost {k}"
        if isinstance(v, float):
            assert theirs[k] == pytest.approx(v), k
        else:
            assert theirs[k] == v, k


def test_replayed_capture_reads_back_from_phoenix(phoenix: Phoenix, openai_capture: Path,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "spans.jsonl"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(openai_capture),
                        "--otlp", f"{phoenix.url}/v1/traces", "--jsonl", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ours = {s["span_id"]: s for s in jsonl(out)}
    assert len(ours) == 7
    got = phoenix.wait_spans({s["trace_id"] for s in ours.values()}, len(ours))
    theirs = {s["context"]["span_id"]: s for s in got}
    assert set(theirs) == set(ours)
    assert sorted(s["name"] for s in got) == sorted(s["name"] for s in ours.values())
    for sid, s in ours.items():
        t = theirs[sid]
        assert t["context"]["trace_id"] == s["trace_id"]
        assert t["parent_id"] == s["parent_span_id"]  # roots: no caller's traceparent
        same_attributes(s["attributes"], t["attributes"])
        assert t["status_code"] == {"UNSET": "UNSET", "OK": "OK", "ERROR": "ERROR"}[s["status"]]
    chats = [t for t in got if t["name"] == "chat tiny-gpt"]
    assert chats and all(t["attributes"]["gen_ai.usage.output_tokens"] > 0 for t in chats)


@pytest.mark.bpf
def test_live_run_continues_the_callers_trace_in_phoenix(phoenix: Phoenix,
                                                         tmp_path: Path) -> None:
    """A client traced with the OpenTelemetry SDK calls the sample server through the
    official openai client; tokentrace, attached to the server, exports over gRPC. In
    Phoenix the server span hangs under the client's span, in the client's trace."""
    provider = TracerProvider(resource=Resource.create({"service.name": "test-client"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
        endpoint=f"{phoenix.url}/v1/traces")))
    tr = provider.get_tracer("tests")
    out = tmp_path / "live.jsonl"
    calls = []
    with SampleServer(port=free_port(), log=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-test",
                               max_retries=0)
        with traced_cli(["--port", str(server.port), "--otlp",
                         f"127.0.0.1:{phoenix.grpc_port}"], str(out)) as run:
            for stream in (False, True):
                with tr.start_as_current_span("client call", kind=otel_trace.SpanKind.CLIENT
                                              ) as span:
                    headers: dict[str, str] = {}
                    inject(headers)
                    kw: dict[str, Any] = {"stream_options": {"include_usage": True}} \
                        if stream else {}
                    resp = client.chat.completions.create(
                        model="tiny-gpt", messages=[{"role": "user", "content": "hi there"}],
                        max_tokens=6, stream=stream, extra_headers=headers, **kw)
                    usage = resp.usage if not stream else [c for c in resp if c.usage][-1].usage
                    ctx = span.get_span_context()
                    calls.append((format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"),
                                  usage.completion_tokens))
    provider.shutdown()
    assert run.returncode == 0, run.stderr
    ours = [s for s in jsonl(out) if s["attributes"].get("gen_ai.operation.name") == "chat"]
    assert len(ours) == 2
    got = phoenix.wait_spans({t for t, _, _ in calls}, 4)
    assert len(got) == 4  # two client spans, two tokentrace server spans
    by_id = {s["context"]["span_id"]: s for s in got}
    for trace_id, client_span, tokens in calls:
        in_trace = [s for s in got if s["context"]["trace_id"] == trace_id]
        assert len(in_trace) == 2
        server = next(s for s in in_trace if s["context"]["span_id"] != client_span)
        assert server["parent_id"] == client_span and by_id[client_span]["parent_id"] is None
        assert server["name"] == "chat tiny-gpt"
        assert server["attributes"]["gen_ai.usage.output_tokens"] == tokens
        mine = next(s for s in ours if s["span_id"] == server["context"]["span_id"])
        same_attributes(mine["attributes"], server["attributes"])
