"""Real probes on real TLS: requests read out of OpenSSL in the traced processes.

- The sample OpenAI server over HTTPS (uvicorn on asyncio: ssl.SSLObject on memory
  BIOs) driven by the official openai client, traced by `tokentrace run` as users run
  it: spans, tokens and TTFT against the client's own wire timing, a connection opened
  before attach, failed handshakes, and a capture that keeps no key.
- HF `transformers serve` (its own FastAPI app, uvicorn on uvloop) over HTTPS: 50
  requests, streamed and not.
- In one traced stretch: stdlib http.server on ssl.SSLSocket (SSL_set_fd, syscalls
  inside SSL calls), a gRPC client on hyper-h2 over ssl (HTTP/2 and gRPC out of TLS, at
  the client's end), the async openai client (a memory-BIO client: it writes first),
  and tritonclient against the gRPC sample's TLS, which is grpcio's BoringSSL: counted,
  never parsed.
"""

from __future__ import annotations

import gc
import gzip
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from samples.launch import SampleServer
from samples.launch_grpc import GrpcSampleServer
from samples.tlscert import make_cert
from tests.conftest import ROOT, free_port
from tests.live import (TimedClient, bounded, client_output_tokens, off_by,
                        spans_by_response_id, timing_rows, traced, traced_cli)
from tests.test_live_grpc import realtime_thread

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    return make_cert(tmp_path_factory.mktemp("cert"))


@pytest.fixture(scope="module")
def trust(cert) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert[0]))


@pytest.fixture(scope="module")
def https_server(tmp_path_factory, cert, trust):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with SampleServer(port=free_port(), log=log, tls=cert, args=["--loop", "asyncio"]) as s:
        c = TimedClient(s.base_url, verify=trust)
        for stream in (True, False):  # warm up torch and the server
            c.chat(stream=stream, max_tokens=4)
        yield s


def check_ttft(diffs: list[float], label: str, rows: Callable[[], str] = str) -> None:
    """The same bar as over plain HTTP (tests/test_live_openai.py): nearly all within
    2 ms of the client's own wire timing, none off by 10 ms, the mean under 1 ms. The
    client's truth is its socket's kernel stamps, record by record (tests/live.py's
    _StampedTLS), so its own waits for a CPU are not in it; timed by its clock around
    the calls instead, one request in eight came out 9 ms longer than the tracer's on
    the 2-vCPU CI VM, though the client ran real-time."""
    print(f"\n{label}: |tracer TTFT - client wire TTFT| over {len(diffs)} requests: "
          f"max {max(diffs) * 1e3:.3f} ms, mean {sum(diffs) / len(diffs) * 1e3:.3f} ms")
    within = sum(d < 0.002 for d in diffs)
    assert within >= 0.95 * len(diffs), f"{sorted(diffs)[-5:]}\n{rows()}"
    assert max(diffs) < 0.010 and sum(diffs) / len(diffs) < 0.001, f"{sorted(diffs)[-5:]}\n{rows()}"


def test_openai_client_over_https_sample_server(https_server, trust, tmp_path):
    """`tokentrace run --record`, as users run it: 40 requests on new connections, 3 on
    a keep-alive connection opened before attach (its SSL object's setup unseen: tied
    to its socket by the BIO it reads the ciphertext from), two failed handshakes."""
    early = TimedClient(https_server.base_url, verify=trust, keepalive_s=60)
    early.chat(stream=False, max_tokens=3)  # its TLS connection predates the tracer
    client = TimedClient(https_server.base_url, verify=trust)
    cap = tmp_path / "tls.ttcap"
    calls, late = [], []
    gc.collect()
    gc.disable()  # a collection inside the client's reads delays the next one
    try:
        with traced_cli(["--pid", str(https_server.pid), "--record", str(cap)],
                        str(tmp_path / "spans.jsonl")) as got, realtime_thread():
            for i in range(40):
                stream, usage = i % 2 == 0, i % 4 == 0
                calls.append((stream, client.chat(stream=stream, max_tokens=4 + i % 5,
                                                  usage=usage)))
            for i in range(3):  # not streamed: the openai client closes a stream's
                late.append(early.chat(stream=False, max_tokens=3 + i))  # connection
            _failed_handshakes(https_server.port)
    finally:
        gc.enable()
    assert got.returncode == 0, got.stderr
    spans = spans_by_response_id(got.spans)
    assert len(spans) == 43, got.stderr
    diffs = []
    for stream, c in calls:
        a = spans[c["id"]]["attributes"]
        assert a["tokentrace.request.stream"] is stream and a["http.response.status_code"] == 200
        if c["output_tokens"] is not None:
            assert a["gen_ai.usage.output_tokens"] == c["output_tokens"]
            assert a["gen_ai.usage.input_tokens"] == c["input_tokens"]
        else:
            assert a.get("gen_ai.usage.output_tokens") == client_output_tokens(c)
        assert (a["tls.protocol.name"], a["tls.protocol.version"], a["url.scheme"]) == \
            ("tls", "1.3", "https")
        assert a["tokentrace.network.timing"] == "socket"
        diffs.append(off_by(a["tokentrace.time_to_first_token"], c["ttft"], a))
    check_ttft(diffs, "HTTPS, asyncio memory BIOs",
               lambda: timing_rows([(c, spans[c["id"]]["attributes"]) for _, c in calls]))
    for c in late:  # opened before attach: plaintext hunted, no handshake seen
        a = spans[c["id"]]["attributes"]
        assert a["tls.protocol.name"] == "tls" and "tls.protocol.version" not in a
        assert a["gen_ai.usage.output_tokens"] == c["output_tokens"]
    assert len({spans[c["id"]]["attributes"]["client.port"] for c in late}) == 1
    err = got.stderr
    assert re.search(r"TLS probes: pid \d+ \S*libssl\.so\.3 \(OpenSSL 3\.", err), err
    m = re.search(r"TLS connections: (\d+) read through the TLS probes, (\d+) seen only as "
                  r"ciphertext \(not decrypted\), (\d+) failed their handshake", err)
    conns = {s["attributes"]["client.port"] for s in spans.values()}
    assert m and int(m[1]) == len(conns) and int(m[2]) == 0 and int(m[3]) == 2, err
    assert "on no known socket" not in err, err
    assert "no events lost" in err and "parser_errors" not in err, err
    # the capture keeps no key, and replays to the same spans
    raw = gzip.decompress(cap.read_bytes())
    assert b"sk-test" not in raw and b"Bearer " in raw
    out = tmp_path / "replay.jsonl"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(cap), "--jsonl", str(out),
                        "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    replayed = spans_by_response_id([json.loads(line) for line in out.read_text().splitlines()])
    assert replayed.keys() == spans.keys()
    for rid, s in spans.items():
        a, b = s["attributes"], replayed[rid]["attributes"]
        assert a["tokentrace.tenant"] == b["tokentrace.tenant"]
        assert a.get("tls.protocol.version") == b.get("tls.protocol.version")


def test_plaintext_http_connections_skip_the_tls_checks(https_server, trust, tmp_path):
    """A process that maps libssl pays the TLS probes' checks on each socket syscall
    unless its connection opened as plaintext HTTP: the kernel marks that connection
    (``conn_state.tls_plain``, ``is_plain_http`` in bpf/sockets.c) and skips them for
    it. The sample server, plain and over HTTPS, in one traced stretch: read while
    their keep-alive connections are open, the plain one is marked and the TLS one is
    not; every answer is a span. (A streamed answer's connection is closed by the
    client: its state is gone by then.)"""
    with SampleServer(port=free_port(), log=tmp_path / "plain.log") as plain:
        TimedClient(plain.base_url).chat(stream=False, max_tokens=2)  # warm up torch
        plain_c = TimedClient(plain.base_url, keepalive_s=60)
        tls_c = TimedClient(https_server.base_url, verify=trust, keepalive_s=60)
        with traced(pids=[plain.pid, https_server.pid]) as got:
            answers = [plain_c.chat(stream=True, max_tokens=4),
                       tls_c.chat(stream=True, max_tokens=4),
                       plain_c.chat(stream=False, max_tokens=3),
                       tls_c.chat(stream=False, max_tokens=3)]
            marks: dict[int, list[int]] = {}
            for k, v in got.run.session.bpf[b"conns"].items():
                if v.bytes_in > 0:  # a connection that moved a request
                    marks.setdefault(k.value >> 32, []).append(v.tls_plain)
    assert marks.get(plain.pid) == [1], marks
    assert marks.get(https_server.pid) == [0], marks
    spans = spans_by_response_id(got.spans)
    assert {a["id"] for a in answers} <= set(spans), (answers, list(spans))
    for a, scheme in zip(answers, ("http", "https", "http", "https")):
        assert spans[a["id"]]["attributes"]["url.scheme"] == scheme, a


def _failed_handshakes(port: int) -> None:
    """A client that does not trust the certificate (it aborts the handshake with an
    alert), and one that sends a hello that is no hello."""
    with pytest.raises(ssl.SSLCertVerificationError):
        with socket.create_connection(("127.0.0.1", port)) as raw:
            ssl.create_default_context().wrap_socket(raw, server_hostname="localhost")
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"\x16\x03\x01\x00\x30" + b"\x01\x00\x00\x2c" + os.urandom(44))
        raw.settimeout(5)
        try:
            while raw.recv(4096):
                pass
        except OSError:
            pass


# ---- HF transformers serve over HTTPS --------------------------------------------------


@pytest.fixture(scope="module")
def hf_https(tmp_path_factory, cert):
    from samples.hf.model import build
    from samples.hf.serve import HfServer
    work = tmp_path_factory.mktemp("hf")
    model = build(work / "model")
    server = HfServer(model, work / "truth.jsonl", work / "hf.log", continuous=False, tls=cert)
    try:
        server.wait_ready()
        server.chat("the model reads", 4)
        server.chat("the model reads", 4, stream=True)
        yield server
    finally:
        server.stop()


def test_hf_transformers_serve_over_https_50_requests(hf_https, trust, tmp_path):
    """`tokentrace run` in its own process: in the test's process the tracer's thread
    would hold the interpreter lock while the client reads its socket."""
    client = TimedClient(hf_https.url, verify=trust)
    model = str(hf_https.model)
    calls = []
    summary = tmp_path / "summary.json"
    gc.collect()
    gc.disable()
    try:
        with traced_cli(["--pid", str(hf_https.pid), "--summary", str(summary)],
                        str(tmp_path / "spans.jsonl")) as got, realtime_thread():
            for i in range(50):
                stream = i % 2 == 1
                calls.append((stream, client.chat(stream=stream, max_tokens=4 + i % 5,
                                                  usage=i % 4 != 1, model=model,
                                                  content="the model reads prompt")))
    finally:
        gc.enable()
    spans = spans_by_response_id(got.spans)
    assert len(spans) == 50, got.stderr
    diffs = []
    for stream, c in calls:
        a = spans[c["id"]]["attributes"]
        assert a["tokentrace.request.stream"] is stream
        assert a.get("gen_ai.usage.output_tokens") == client_output_tokens(c)
        assert a["tls.protocol.version"] == "1.3" and a["url.scheme"] == "https"
        if c["ttft"] is None:  # random weights: a reply can be all end-of-text, no text
            assert "tokentrace.time_to_first_token" not in a
            continue
        assert "tokentrace.time_to_first_token" in a, (c, a)
        diffs.append(off_by(a["tokentrace.time_to_first_token"], c["ttft"], a))
    assert len(diffs) >= 40
    check_ttft(diffs, "HF transformers serve over HTTPS, uvloop memory BIOs",
               lambda: timing_rows([(c, spans[c["id"]]["attributes"]) for _, c in calls]))
    rep = json.loads(summary.read_text())["report"]
    assert rep["tls_connections_decrypted"] >= 1 and not rep.get("parser_errors")
    assert not rep.get("capture.tls.unbound") and not rep.get("bytes_lost")


# ---- one traced stretch: socket BIOs, TLS clients, TLS the probes cannot read ------------

H2_KEY = "sk-h2-over-tls-0123456789SECRET"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, cert, trust, https_server):
    """stdlib SSLSocket server, h2 gRPC client, async openai client and the gRPC TLS
    sample, traced together by one `tokentrace run` (compiling the BPF program is most
    of a stretch; in its own process, so the stdlib client's clock reads never wait for
    the tracer's thread to let go of the interpreter lock)."""
    import tritonclient.grpc as tc
    work = tmp_path_factory.mktemp("mixed")
    out: dict = {"capture": work / "mixed.ttcap"}
    summary = work / "summary.json"
    with SampleServer("samples.stdlib_server", port=free_port(), log=work / "stdlib.log",
                      tls=cert, health="/") as stdlib, \
            GrpcSampleServer(port=free_port(), log=work / "grpc.log", tls=cert) as grpc_server:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        h2c = subprocess.Popen([sys.executable, str(ROOT / "tests/tls_h2_client.py"),
                                grpc_server.target, str(cert[0]), "8", H2_KEY],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        asc = subprocess.Popen([sys.executable, str(ROOT / "tests/tls_async_client.py"),
                                https_server.base_url, str(cert[0]), "6"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert h2c.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the clients have imported ssl: libssl is mapped
        try:
            pids = [a for p in (stdlib.pid, grpc_server.pid, h2c.pid, asc.pid)
                    for a in ("--pid", str(p))]
            with traced_cli([*pids, "--record", str(out["capture"]), "--summary",
                             str(summary)], str(work / "spans.jsonl")) as run:
                for p in (h2c, asc):
                    p.stdin.write("go\n")
                    p.stdin.flush()
                out["h2"] = _lines(h2c)
                out["async"] = _lines(asc)
                fd_client = TimedClient(stdlib.base_url, verify=trust)
                with realtime_thread():
                    out["stdlib"] = [fd_client.chat(stream=i % 2 == 0, max_tokens=3 + i % 3)
                                     for i in range(8)]
                triton = tc.InferenceServerClient(grpc_server.target, ssl=True,
                                                  root_certificates=str(cert[0]))
                for i in range(3):
                    t = tc.InferInput("text_input", [1], "BYTES")
                    t.set_data_from_numpy(np.array([b"hello"], dtype=object))
                    m = tc.InferInput("max_tokens", [1], "INT32")
                    m.set_data_from_numpy(np.array([3], dtype=np.int32))
                    triton.infer("tiny-gpt", [t, m])
                triton.close()
        finally:
            for p in (h2c, asc):
                p.stdin.close()
                p.wait(timeout=30)
        assert run.returncode == 0, run.stderr
        out.update(got=SimpleNamespace(spans=run.spans, stderr=run.stderr,
                                       report=json.loads(summary.read_text())["report"]),
                   pids={"stdlib": stdlib.pid, "grpc": grpc_server.pid, "h2": h2c.pid,
                         "async": asc.pid})
    return out


def _lines(p: subprocess.Popen) -> list[dict]:
    lines = []
    while True:
        line = p.stdout.readline()
        assert line, "the client died"
        if line.strip() == "done":
            return lines
        lines.append(json.loads(line))


def _spans_of(mixed: dict, pid_name: str) -> list[dict]:
    pid = mixed["pids"][pid_name]
    return [s for s in mixed["got"].spans if s["attributes"].get("process.pid") == pid]


def test_ssl_socket_server_requests_timed_as_its_client_sees_them(mixed):
    """ssl.SSLSocket: OpenSSL reads and writes the socket itself (SSL_set_fd). The
    server leaves Nagle on: a TLS record per write, held for the client's delayed ACK,
    inside the client's TTFT and the span's alike."""
    spans = spans_by_response_id(_spans_of(mixed, "stdlib"))
    assert len(spans) == 8
    diffs = []
    for c in mixed["stdlib"]:
        a = spans[c["id"]]["attributes"]
        assert a["tls.protocol.version"] == "1.3" and a["tokentrace.network.timing"] == "socket"
        assert a.get("gen_ai.usage.output_tokens") == client_output_tokens(c)
        diffs.append(off_by(a["tokentrace.time_to_first_token"], c["ttft"], a))
    n_bounded = bounded(list(spans.values()))
    print(f"\nSSLSocket server: |tracer TTFT - client wire TTFT| max {max(diffs) * 1e3:.3f} ms"
          f" ({n_bounded} bounded by an unseen ACK)")
    rows = timing_rows([(c, spans[c["id"]]["attributes"]) for c in mixed["stdlib"]])
    print(rows)
    assert max(diffs) < 0.002, rows
    # an ACK the kernel skipped the probe for (a busy host): said, and rare
    assert n_bounded <= 2 and (not n_bounded or mixed["got"].report["capture.probe_runs_missed"])
    holds = [s["attributes"].get("tokentrace.network.send_hold.cause") for s in spans.values()]
    assert "nagle" in holds
    assert mixed["got"].report["tls_binds.set_fd"] >= 1


def test_grpc_over_tls_read_at_the_client_and_masked_in_the_capture(mixed):
    """HTTP/2 and gRPC out of TLS (the client's OpenSSL), one span per call; the
    authorization metadata never reaches the capture, in HPACK or in clear."""
    calls = [c for c in mixed["h2"] if "id" in c]
    assert len(calls) == 8
    spans = _spans_of(mixed, "h2")
    assert len(spans) == 8
    for s, c in zip(sorted(spans, key=lambda s: s["start_time_unix_nano"]), calls):
        a = s["attributes"]
        assert s["kind"] == "CLIENT" and a["rpc.system"] == "grpc"
        assert a["rpc.grpc.status_code"] == 0 == c["status"]
        assert a["tokentrace.grpc.response_messages"] == c["messages"]
        assert a["tls.protocol.version"] == "1.3" and a["tls.client.server_name"] == "localhost"
    from tracer.events.h2mask import _HUFFMAN
    raw = gzip.decompress(mixed["capture"].read_bytes())
    assert H2_KEY.encode() not in raw and _HUFFMAN.encode(H2_KEY.encode()) not in raw


def test_memory_bio_client_tied_by_the_records_it_sends(mixed):
    """httpx on asyncio (the async openai client): the client's SSL object writes its
    ClientHello before it reads anything; the record's first bytes, seen again in the
    send, tie it to the socket."""
    spans = spans_by_response_id(_spans_of(mixed, "async"))
    assert len(mixed["async"]) == 6 and len(spans) == 6
    for c in mixed["async"]:
        a = spans[c["id"]]["attributes"]
        assert a["tls.protocol.version"] == "1.3" and a["tokentrace.api"] == "openai"
        if c["output_tokens"] is not None:
            assert a["gen_ai.usage.output_tokens"] == c["output_tokens"]
    assert mixed["got"].report["tls_binds.bio_out"] >= 1


def test_grpcio_boringssl_is_counted_not_parsed(mixed):
    """grpcio links BoringSSL in, without symbols: its connections are TLS on the wire
    that nothing reads. Counted (tls_connections_unseen), never parsed, and said."""
    rep = mixed["got"].report
    assert _spans_of(mixed, "grpc") == []
    assert rep["tls_connections_unseen"] >= 1
    assert rep["tls_libraries_not_probed.no_symbols"] >= 1
    assert rep["tls_processes_with_two_libraries"] >= 1  # libssl (Python) and BoringSSL
    assert not rep.get("parser_errors") and not rep.get("http_protocol_errors")
