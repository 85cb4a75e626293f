"""The command line on real processes: run, record, replay, capture limits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from samples.launch import SampleServer
from tests.conftest import free_port
from tests.live import TimedClient, traced, traced_cli

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with SampleServer(port=free_port(), log=tmp_path_factory.mktemp("s") / "log") as s:
        TimedClient(s.base_url).chat(stream=False, max_tokens=2)
        yield s


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "tracer", *args], capture_output=True,
                          text=True, timeout=120, **kw)


def normalised(spans):
    return sorted((json.dumps(s, sort_keys=True) for s in spans))


def test_replay_of_the_recorded_capture_gives_the_live_spans(server, tmp_path):
    live, cap, again = tmp_path / "live.jsonl", tmp_path / "cap.ttcap", tmp_path / "replay.jsonl"
    client = TimedClient(server.base_url)
    with traced_cli(["--port", str(server.port), "--record", str(cap)], str(live)) as run:
        for i in range(12):
            client.chat(stream=i % 2 == 0, max_tokens=3 + i)
    assert run.returncode == 0, run.stderr
    assert "12 requests exported" in run.stderr
    r = cli("replay", str(cap), "--jsonl", str(again), "--quiet")
    assert r.returncode == 0, r.stderr
    live_spans = [json.loads(x) for x in live.read_text().splitlines()]
    assert len(live_spans) == 12
    assert normalised(live_spans) == normalised(
        json.loads(x) for x in again.read_text().splitlines())
    for s in live_spans:  # the JSONL contract
        assert {"name", "trace_id", "span_id", "parent_span_id", "start_time_unix_nano",
                "end_time_unix_nano", "status", "attributes"} <= set(s)


def test_record_then_replay(server, tmp_path):
    cap = tmp_path / "r.ttcap"
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "record", "--pid", str(server.pid),
                             "-o", str(cap), "--duration", "6"], stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    assert "attached" in line, line
    TimedClient(server.base_url).chat(stream=True, max_tokens=5)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "wrote" in err
    r = cli("replay", str(cap))
    assert r.returncode == 0
    assert "POST /v1/chat/completions" in r.stdout and "tiny-gpt" in r.stdout
    assert "1 requests exported" in r.stderr


def test_duration_stops_and_flushes(server, tmp_path):
    out = tmp_path / "d.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--pid", str(server.pid),
                             "--duration", "5", "--jsonl", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert "attached" in proc.stderr.readline()
    TimedClient(server.base_url).chat(stream=False, max_tokens=4)
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "POST /v1/chat/completions" in stdout  # the console table
    (span,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert span["attributes"]["gen_ai.usage.output_tokens"] == 4


def test_small_capture_limit_truncates_but_keeps_requests_framed(server):
    client = TimedClient(server.base_url)
    big = "lorem ipsum " * 9000  # ~108 KB body, far over a 4 KiB capture limit
    with traced(pids=[server.pid], capture_limit=4096) as got:
        results = [client.chat(stream=i % 2 == 0, max_tokens=3, content=big) for i in range(4)]
        results.append(client.chat(stream=False, max_tokens=2))
    assert got.report["capture.truncated"] > 0
    recs = {r.llm_response.response_id: r for r in got.records}
    assert len(recs) == 5
    for res in results[:4]:
        rec = recs[res["id"]]
        assert rec.request_incomplete and rec.status == 200
        assert rec.llm_response.output_tokens == 3  # the response was still followed
    small = recs[results[4]["id"]]
    assert not small.request_incomplete and small.llm_request.model == "tiny-gpt"


def test_run_without_targets_and_missing_pid(tmp_path):
    r = cli("run")
    assert r.returncode == 2 and "nothing to trace" in r.stderr
    r = cli("run", "--pid", "999999", "--duration", "1")
    assert r.returncode == 1 and "no such process" in r.stderr


def test_prompts_only_with_capture_content(server, tmp_path):
    client = TimedClient(server.base_url)
    secret = "my very private prompt 12345"
    with traced_cli(["--pid", str(server.pid)], str(tmp_path / "a.jsonl")) as off:
        client.chat(stream=True, max_tokens=2, content=secret)
    assert secret not in (tmp_path / "a.jsonl").read_text()
    with traced_cli(["--pid", str(server.pid), "--capture-content"],
                    str(tmp_path / "b.jsonl")) as on:
        client.chat(stream=True, max_tokens=2, content=secret)
    (span,) = on.spans
    assert secret in span["attributes"]["tokentrace.prompt.text"]
    assert span["attributes"]["tokentrace.completion.text"].strip()
    assert off.returncode == on.returncode == 0
