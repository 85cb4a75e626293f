"""Real probes on a real OpenAI-compatible server driven by the official openai client.

Every test here loads the BPF program and attaches to a separate server process.
"""

from __future__ import annotations

import gc
import random
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from samples.launch import SampleServer
from tracer.events import wire
from tracer.export.console import ring_at_loss_text
from tests.conftest import free_port
from tests.kstamps import realtime_thread
from tests.live import TimedClient, off_by, spans_by_response_id, traced, traced_cli

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with SampleServer(port=free_port(), log=log) as s:
        c = TimedClient(s.base_url)
        for stream in (True, False):  # warm up torch and the server
            c.chat(stream=stream, max_tokens=4)
        yield s


def _worst(calls: list, spans: dict, diffs: list[float]) -> dict:
    """What the tracer and the client said of the request timed worst: which side of
    the request (its arrival, the token's departure) the difference is on."""
    i = max(range(len(diffs)), key=diffs.__getitem__)
    stream, _, _, c = calls[i]
    a = spans[c["id"]]["attributes"]
    keys = ("time_to_first_token", "server.time_to_first_token", "network.socket_wait",
            "network.send_hold", "network.send_hold.cause", "network.timing")
    return {"index": i, "stream": stream, "client_ttft": c["ttft"],
            "client_ttft_sdk": c["ttft_sdk"],
            **{k: a.get(f"tokentrace.{k}") for k in keys}}


def test_openai_client_streamed_and_plain_requests_match_usage_and_ttft(server, tmp_path):
    """The tracer runs as its own process, as in production: `tokentrace run --pid`."""
    client = TimedClient(server.base_url)
    calls = []
    # The client stamps its own socket calls in Python: a garbage collection or losing
    # the CPU between recv() and the clock read would be timed as TTFT: collect now.
    gc.collect()
    gc.disable()
    try:
        with traced_cli(["--pid", str(server.pid)], str(tmp_path / "spans.jsonl")) as got, \
                realtime_thread():  # its reads stay prompt (see tests/kstamps.py)
            for i in range(100):
                stream = i % 2 == 0
                usage = i % 4 == 0  # half the streams ask for the final usage chunk
                calls.append((stream, usage, 5 + i % 11,
                              client.chat(stream=stream, max_tokens=5 + i % 11, usage=usage)))
    finally:
        gc.enable()
    spans = spans_by_response_id(got.spans)
    assert len(got.spans) == 100 and len(spans) == 100
    diffs, sdk = [], []
    for stream, usage, max_tokens, c in calls:
        a = spans[c["id"]]["attributes"]
        assert a["tokentrace.request.stream"] is stream
        assert a["http.response.status_code"] == 200
        if c["output_tokens"] is not None:  # the client saw usage
            assert a["gen_ai.usage.output_tokens"] == c["output_tokens"]
            assert a["gen_ai.usage.input_tokens"] == c["input_tokens"]
            assert a["tokentrace.usage.source"] == "usage"
        else:
            assert a["gen_ai.usage.output_tokens"] == c["text_chunks"] == max_tokens
            assert a["tokentrace.usage.source"] == "stream_chunks"
        diffs.append(off_by(a["tokentrace.time_to_first_token"], c["ttft"], a))
        sdk.append(abs(a["tokentrace.time_to_first_token"] - c["ttft_sdk"]))
    print(f"\n|tracer TTFT - client wire TTFT| over 100 requests: max {max(diffs) * 1e3:.3f} ms,"
          f" mean {sum(diffs) / len(diffs) * 1e3:.3f} ms; against the SDK's own timing: "
          f"max {max(sdk) * 1e3:.3f} ms, mean {sum(sdk) / len(sdk) * 1e3:.3f} ms")
    # The tracer times from the request bytes' arrival at the server's socket to the
    # token's bytes leaving it; the client's wire TTFT is its socket's kernel stamps
    # of the same two moments (tests/kstamps.py), so neither side's wait for a CPU is
    # in the comparison (measured: max 0.01-0.05 ms, mean 0.005 ms). The bar:
    # 98% within 2 ms, none off by more than 10 ms, and the mean under 1 ms.
    worst = _worst(calls, spans, diffs)
    print("the request timed worst:", worst)
    within = sum(d < 0.002 for d in diffs)
    assert within >= 98 and max(diffs) < 0.010 and sum(diffs) / len(diffs) < 0.001, \
        (sorted(diffs)[-5:], worst)
    assert got.returncode == 0 and "no events lost" in got.stderr, got.stderr


def test_32_concurrent_keepalive_clients_with_100kb_prompts(server):
    rng = random.Random(7)
    words = [f"w{rng.randint(0, 99999)}" for _ in range(20000)]
    prompts = [" ".join(words[i:] + words[:i])[: 100 * 1024] for i in range(32)]

    def client_job(i):
        c = TimedClient(server.base_url)  # one keep-alive connection per client
        return [c.chat(stream=(i + k) % 2 == 0, max_tokens=3 + (i + k) % 5,
                       content=prompts[i]) for k in range(3)]

    with traced(pids=[server.pid]) as got:
        with ThreadPoolExecutor(max_workers=32) as pool:
            results = [r for rs in pool.map(client_job, range(32)) for r in rs]
    spans = spans_by_response_id(got.spans)
    assert len(results) == 96 and len(spans) == 96
    # uvloop accepts with a NULL address: the peer comes from tcp_rcv_space_adjust
    assert all(s["attributes"].get("client.port") for s in spans.values())
    # each request on the connection that carried it, kept-alive or new: the server
    # may close an idle keep-alive connection (seen on a loaded VM: every request on a
    # new one), so how many were reused is said, not required
    for r in results:
        assert spans[r["id"]]["attributes"]["client.port"] == r["client_port"], r
    conns = Counter(r["client_port"] for r in results)
    print(f"\n{len(conns)} connections carried the 96 requests "
          f"({sum(n > 1 for n in conns.values())} of them more than one)")
    for r in results:
        a = spans[r["id"]]["attributes"]
        assert a["http.request.body.size"] > 100 * 1024
        if r["input_tokens"] is not None:
            assert a["gen_ai.usage.input_tokens"] == r["input_tokens"]
            assert a["gen_ai.usage.output_tokens"] == r["output_tokens"]
        else:
            assert a["gen_ai.usage.output_tokens"] == r["text_chunks"]
        assert "tokentrace.request.incomplete" not in a
    assert got.report.get("bytes_lost", 0) == 0


def _read_responses(sock, n):
    """Read n Content-Length responses from a socket (enough for this server)."""
    import httptools

    class P:
        def __init__(self):
            self.done = []
            self.body = b""

        def on_body(self, b):
            self.body += b

        def on_message_complete(self):
            self.done.append(self.body)
            self.body = b""

    p = P()
    parser = httptools.HttpResponseParser(p)
    while len(p.done) < n:
        data = sock.recv(65536)
        assert data, "server closed early"
        parser.feed_data(data)
    return p.done


def test_pipelined_requests_are_neither_lost_nor_merged(server):
    import json

    reqs = b""
    for i in range(10):
        body = json.dumps({"model": "tiny-gpt", "max_tokens": i + 1,
                           "messages": [{"role": "user", "content": f"pipelined {i}"}]}).encode()
        reqs += (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    with traced(pids=[server.pid]) as got:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(reqs)  # all ten in one write
            bodies = _read_responses(s, 10)
    ids = [json.loads(b)["id"] for b in bodies]
    spans = spans_by_response_id(got.spans)
    assert len(got.records) == 10
    assert [spans[i]["attributes"]["gen_ai.usage.output_tokens"] for i in ids] == list(range(1, 11))
    assert len({s["attributes"]["client.port"] for s in spans.values()}) == 1


def test_malformed_and_truncated_bytes_never_break_tracing(server):
    rng = random.Random(1)
    valid = TimedClient(server.base_url)
    good = []
    with traced(pids=[server.pid]) as got:
        for k in range(20):
            with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
                junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
                if k % 3 == 0:  # a valid request cut short, then the client leaves
                    junk = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 500\r\n\r\n{\"mo"
                elif k % 3 == 1:
                    junk = b"GET / HTTP/1.1\r\n" + junk
                s.sendall(junk)
                try:
                    s.recv(4096)
                except OSError:
                    pass
            good.append(valid.chat(stream=k % 2 == 0, max_tokens=3))
    spans = spans_by_response_id(got.spans)
    assert all(g["id"] in spans for g in good)  # every valid request traced
    assert got.report.get("http_protocol_errors", 0) > 0  # and the garbage was noticed


def test_server_killed_mid_request_ends_span_with_error(tmp_path):
    srv = SampleServer(port=free_port(), args=["--token-rate", "20"], log=tmp_path / "s.log")
    srv.start()
    client = TimedClient(srv.base_url)
    client.chat(stream=False, max_tokens=1)
    errors = []

    def long_request():
        try:
            client.chat(stream=True, max_tokens=500)
        except Exception as e:  # the server dies under it
            errors.append(e)

    with traced(pids=[srv.pid]) as got:
        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)  # a few tokens are out
        srv.stop(sig=signal.SIGKILL)
        t.join(timeout=30)
    assert errors, "the client saw the server die"
    (span,) = [s for s in got.spans if s["name"].startswith("chat")]
    assert span["status"] == "ERROR"
    assert "process exited" in span["status_message"]
    assert span["attributes"]["tokentrace.time_to_first_token"] > 0  # what was seen is kept


def test_attaching_to_open_keepalive_connections(server):
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    body = json.dumps({"model": "tiny-gpt", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "before"}]})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    conn.getresponse().read()  # connected and used before the tracer exists
    with traced(pids=[server.pid]) as got:
        for n in (3, 4):
            conn.request("POST", "/v1/chat/completions",
                         body.replace('"max_tokens": 2', f'"max_tokens": {n}'),
                         {"Content-Type": "application/json"})
            conn.getresponse().read()
    conn.close()
    toks = sorted(s["attributes"]["gen_ai.usage.output_tokens"] for s in got.spans)
    assert toks == [3, 4]
    assert got.report.get("connections_existing", 0) >= 1


def test_ring_buffer_overflow_is_counted_and_reported(server):
    """A consumer that stalls: the kernel counts every record it could not queue, and
    requests whose bytes were lost say so instead of being wrong."""
    stall = threading.Event()

    class Stall:
        def on_record(self, rec):
            if not stall.is_set():
                stall.set()
                time.sleep(3)  # the poll thread is stuck; the 1 MiB ring fills up

        def close(self):
            pass

    big = "x " * 60000
    client = TimedClient(server.base_url)
    with traced(pids=[server.pid], ringbuf_mb=1, extra_sinks=[Stall()]) as got:
        client.chat(stream=False, max_tokens=1)
        stall.wait(5)
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda i: client.chat(stream=True, max_tokens=2, content=big),
                          range(24)))
    assert got.report["capture.lost_data"] > 0
    # the agent fell behind: when the kernel refused records, the ring had no room for
    # the largest (a DATA record's header and a full chunk)
    ring = got.report["capture.ring_bytes"]
    largest = 8 + wire.DATA.header_size + wire.CONSTANTS["CHUNK"]
    assert ring == 1 << 20
    assert ring - largest < got.report["capture.ring_fill_at_loss_bytes"] <= ring
    assert got.report["capture.ring_fill_peak_bytes"] >= got.report["capture.ring_fill_at_loss_bytes"]
    assert "records were lost with the ring full" in ring_at_loss_text(got.report)
    # a full ring refuses at once: the calls it refused are not taken for the lock's
    # (a vCPU held off the CPU mid-call could make one slow, hence not == 0)
    lost = sum(v for k, v in got.report.items() if k.startswith("capture.lost_"))
    assert got.report["capture.ring_refused_slow"] * 100 <= lost
    assert 0 < got.report["capture.ring_refused_ns"] < lost * wire.CONSTANTS["RING_SLOW_NS"]
    # each refused record was tried twice (it came back fast), and a full ring refused
    # the second try too: counted lost once, saved only where the consumer read between
    assert got.report["capture.ring_retry_saved"] * 100 <= lost
    lossy = [r for r in got.records if r.error or r.request_incomplete or r.response_incomplete]
    whole = [r for r in got.records if r not in lossy]
    # 25 requests were sent: each lost record either took a whole request with it or
    # left its request marked incomplete; what is reported whole is right.
    assert lossy or len(got.records) < 25, "loss is visible on the requests"
    assert len(got.records) <= 25
    # the first request was read before the stall: it is whole, so "right" is checked
    # on at least one record, and each whole one is right for what was sent with it
    assert any(not r.llm_request.stream for r in whole), "the request before the stall"
    for r in whole:
        streamed = r.llm_request.stream
        assert r.llm_response.output_tokens == (2 if streamed else 1)
        assert r.status == 200 and (r.request_bytes > 100_000) == streamed
