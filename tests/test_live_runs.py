"""Token runs on real probes: a streamed response's token writes staged in the kernel
(bpf/sockets.c) and sent as RUN records, on real servers and the official openai client.

Each test checks the tracer's token counts and times against what the client received,
and that the runs were really used (the kernel's counters), so a path that quietly fell
back to one record per token would fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from samples.launch import SampleServer
from tests.conftest import free_port
from tests.live import Collected, TimedClient, client_output_tokens, traced
from tracer.correlate.connections import TrackerOptions
from tracer.events import capture
from tracer.pipeline import Pipeline

pytestmark = pytest.mark.bpf


def _replay(path: str) -> tuple[list, dict]:
    reader = capture.CaptureReader(path)
    sink = Collected()
    p = Pipeline([sink], options=TrackerOptions(tenant_salt=capture.tenant_salt(reader.header)))
    for item in reader:
        p.feed(item)
    p.close()
    return sink.records, p.report()


def _by_id(records: list) -> dict:
    return {r.llm_response.response_id: r for r in records
            if r.llm_response is not None and r.llm_response.response_id}


def _same_books(live: list, replayed: list) -> None:
    """A replay of the capture says what the live run said of every request."""
    a, b = _by_id(live), _by_id(replayed)
    assert set(a) == set(b)
    for rid, r in a.items():
        s = b[rid]
        assert (r.llm_response.output_tokens, r.llm_response.token_ts, r.ttft_ns,
                r.response_bytes, r.end_ns) == (
            s.llm_response.output_tokens, s.llm_response.token_ts, s.ttft_ns,
            s.response_bytes, s.end_ns), rid


def _check_against_client(calls: list[dict], records: list) -> None:
    by = _by_id(records)
    for c in calls:
        lr = by[c["id"]].llm_response
        assert len(lr.token_ts) == lr.text_chunks == c["text_chunks"], c
        assert lr.output_tokens == client_output_tokens(c), c


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with SampleServer(port=free_port(), log=log) as s:
        TimedClient(s.base_url).chat(stream=True, max_tokens=4)  # warm up torch
        yield s


def test_openai_client_streams_are_counted_from_runs_as_from_records(server, tmp_path):
    """The same streams with token runs and without: every request's tokens as the
    client counted them either way; with runs, most token writes came in RUN records
    and none were lost; a replay of the capture gives the live books."""
    client = TimedClient(server.base_url)
    got = {}
    for runs in (True, False):
        calls = []
        with traced(pids=[server.pid], record=str(tmp_path / f"runs-{runs}.ttcap"),
                    token_runs=runs) as c:
            for i in range(24):
                calls.append(client.chat(stream=True, max_tokens=30 + 5 * i, usage=i % 2 == 0))
        _check_against_client(calls, c.records)
        got[runs] = (c, calls)
    on, off = got[True][0].report, got[False][0].report
    tokens = sum(call["text_chunks"] for call in got[True][1])
    print(f"token runs: {on['capture.run_writes']} of {tokens} token writes staged")
    assert on["capture.run_writes"] >= tokens // 2, on
    assert on["capture.lost_run"] == 0 and on.get("token_runs_unread", 0) == 0, on
    assert off["capture.run_writes"] == 0, off
    replayed, rep = _replay(str(tmp_path / "runs-True.ttcap"))
    _same_books(got[True][0].records, replayed)


def _stream_until_eof(port: int, max_tokens: int, kill_after: int, pid: int) -> int:
    """A raw streamed request; SIGKILL ``pid`` once ``kill_after`` text chunks came,
    then read until the kernel closes the dead server's socket. Returns the text
    chunks received."""
    body = json.dumps({"model": "tiny-gpt", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "tell me a long story"}]})
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    buf, killed = b"", False
    while True:
        data = s.recv(65536)
        if not data:
            break
        buf += data
        if not killed and buf.count(b'"content"') > kill_after + 1:
            os.kill(pid, signal.SIGKILL)
            killed = True
    s.close()
    assert killed, "the stream ended before the kill"
    texts = 0
    for line in buf.split(b"\n"):
        if line.startswith(b"data: {"):
            doc = json.loads(line[6:])
            if doc["choices"] and doc["choices"][0]["delta"].get("content"):
                texts += 1
    return texts


def test_a_server_killed_mid_stream_keeps_the_tokens_it_had_written(tmp_path):
    """A process that dies with token writes staged: the agent reads them from the
    kernel's map before the exit record, so the cut request counts every token the
    client received."""
    port = free_port()
    srv = SampleServer(port=port, args=["--token-rate", "40"], log=tmp_path / "server.log")
    srv.start()
    try:
        TimedClient(srv.base_url).chat(stream=True, max_tokens=4)
        with traced(pids=[srv.pid]) as got:
            texts = _stream_until_eof(port, 400, 60, srv.pid)
            time.sleep(0.5)  # the exit reaches the agent
    finally:
        srv.stop()
    assert len(got.records) == 1, got.records
    lr = got.records[0].llm_response
    read = got.report.get("capture.runs_read_from_the_map", 0)
    print(f"client got {texts} text chunks; tracer counted {lr.text_chunks}; "
          f"{read} runs read from the map")
    assert lr.text_chunks == len(lr.token_ts) == texts
    # at 40 tokens/s a run is sent when 250 ms old, at its next write, which then
    # starts the next run: the kill always finds one staged
    assert got.report["capture.run_writes"] > 0 and read >= 1, got.report


def test_hf_transformers_serve_streams_are_counted_from_runs(tmp_path):
    """A server nobody here wrote: HF ``transformers serve --continuous-batching`` (a
    tiny Llama built offline, on the CPU), streamed by the official openai client
    from four threads at once. Its random tokens carry quotes, backslashes and
    non-ASCII text, so the kernel's JSON-string check is exercised too."""
    from concurrent.futures import ThreadPoolExecutor

    from samples.hf.model import build
    from samples.hf.serve import HfServer
    model = build(tmp_path / "tiny-llama")
    srv = HfServer(model, tmp_path / "truth.jsonl", tmp_path / "hf.log", continuous=True)
    try:
        srv.wait_ready()
        srv.warm_up()
        clients = [TimedClient(f"http://127.0.0.1:{srv.port}") for _ in range(4)]

        def one(i: int) -> dict:
            return clients[i % 4].chat(stream=True, max_tokens=20 + (i * 7) % 40,
                                       usage=i % 2 == 0, model=str(model))

        with traced(pids=[srv.pid], record=str(tmp_path / "hf.ttcap")) as got:
            with ThreadPoolExecutor(4) as pool:
                calls = list(pool.map(one, range(24)))
    finally:
        srv.stop()
    _check_against_client(calls, got.records)
    tokens = sum(c["text_chunks"] for c in calls)
    print(f"HF serve: {got.report['capture.run_writes']} of {tokens} token writes staged")
    assert got.report["capture.run_writes"] >= tokens // 3, got.report
    assert got.report["capture.lost_run"] == 0, got.report
    replayed, _ = _replay(str(tmp_path / "hf.ttcap"))
    _same_books(got.records, replayed)
