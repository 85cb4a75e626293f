"""Real probes on the real KServe v2 gRPC sample server, driven by tritonclient[grpc].

Every test here loads the BPF program and attaches to a separate server process. The
64-stream test uses grpcio stubs compiled from tritonclient's bundled protos (one
tritonclient client holds at most one stream)."""

from __future__ import annotations

import gc
import gzip
import os
import socket
import struct
import threading
import time

import grpc
import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from samples.launch_grpc import GrpcSampleServer
from tests.conftest import free_port
from tests.kstamps import StampedSocket, drive, realtime_thread
from tests.live import off_by, traced, traced_cli
from tracer.events import capture, schema, wire

pytestmark = pytest.mark.bpf

MODEL = "tiny-gpt"
# sent as call metadata by the tritonclient calls; must never reach a capture file
GRPC_KEY = "sk-grpc-metadata-0123456789SECRET"
AUTH = {"authorization": "Bearer " + GRPC_KEY}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "grpc-server.log"
    with GrpcSampleServer(port=free_port(), log=log) as s:
        c = Client(s.target)
        c.unary(3, "warm up")
        c.stream(3, "warm up")
        c.close()
        yield s


def _inputs(prompt: str, max_tokens: int) -> list[tc.InferInput]:
    t = tc.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    m = tc.InferInput("max_tokens", [1], "INT32")
    m.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    return [t, m]


class Client:
    """tritonclient's gRPC client, timing each call from just before it is issued to
    the moment the first response with text is in the caller's hands."""

    def __init__(self, target: str) -> None:
        self.c = tc.InferenceServerClient(target)
        self.n = 0

    def unary(self, max_tokens: int, prompt: str = "Hello there, tiny model",
              counts: bool = False, compression: str | None = None) -> dict:
        self.n += 1
        rid = f"u{self.n}-{time.monotonic_ns()}"
        inputs = _inputs(prompt, max_tokens)
        outs = [tc.InferRequestedOutput("text_output")]
        if counts:
            outs.append(tc.InferRequestedOutput("num_output_tokens"))
        t0 = time.monotonic()
        r = self.c.infer(MODEL, inputs, request_id=rid, outputs=outs,
                         compression_algorithm=compression, headers=AUTH)
        t1 = time.monotonic()
        n = int(r.as_numpy("num_output_tokens")[0]) if counts else None
        return {"id": rid, "ttft": t1 - t0, "output_tokens": n, "stream": False,
                "text": r.as_numpy("text_output")[0]}

    def stream(self, max_tokens: int, prompt: str = "Hello there, tiny model",
               compression: str | None = None) -> dict:
        self.n += 1
        rid = f"s{self.n}-{time.monotonic_ns()}"
        inputs = _inputs(prompt, max_tokens)
        got: list[float] = []
        done = threading.Event()
        errors: list = []

        def callback(result, error):
            now = time.monotonic()
            if error is not None:
                errors.append(error)
                done.set()
                return
            if result.as_numpy("text_output") is not None:
                got.append(now)
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()

        self.c.start_stream(callback=callback, compression_algorithm=compression,
                            headers=AUTH)
        t0 = time.monotonic()
        self.c.async_stream_infer(MODEL, inputs, request_id=rid)
        assert done.wait(30), "stream finished"
        self.c.stop_stream()
        assert not errors, errors
        return {"id": rid, "ttft": got[0] - t0, "output_tokens": len(got), "stream": True}

    def close(self) -> None:
        self.c.close()


class WireClient:
    """A gRPC client on hyper-h2 over a plain socket (messages from tritonclient's
    bundled protos), without tritonclient's (or grpcio's) threads and request building,
    timed by its socket's kernel stamps (``tests/kstamps.py``): from the departure of
    the request's bytes to the arrival of the segment holding the end of the frame that
    completed the first response message with output. The server's bytes are fed to
    hyper-h2 one whole frame at a time, peeked before they are read, so that frame's
    place in the stream is known; the client's own waits for a CPU (its clock after
    recv() minus the arrival) are kept apart in ``client_wait``.

    A client that read its own clock around send() and recv() timed those waits too:
    on the 2-vCPU CI VM 3 calls in 100 came out 2.9-3.5 ms longer than the tracer's
    TTFT, all of it the client's wait for a CPU after the bytes had arrived.

    ``begin`` sends a call and ``step`` handles what the socket has (call it when it is
    readable; it returns the call's result once it ends), so that one thread can drive
    many connections (``tests/kstamps.drive``); ``call`` does both."""

    PATH = "/inference.GRPCInferenceService/"

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.ssock = StampedSocket(sock)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.ssock.send(self.conn.data_to_send())
        self.n = 0
        self.partial = b""  # read, not yet a whole frame
        self.cur: dict | None = None
        # the HTTP/2 handshake: the server's ACK of our SETTINGS says it has read our
        # preface, so a first call is not read together with it (whose arrival it would
        # then take: docs/netwait.md, limits)
        acked = False
        while not acked:
            data = self.sock.recv(65536)
            assert data, "server closed the connection"
            acked = any(isinstance(ev, h2.events.SettingsAcknowledged)
                        for ev in self.conn.receive_data(data))
            pending = self.conn.data_to_send()
            if pending:
                self.ssock.send(pending)

    def _request(self, max_tokens: int, prompt: bytes = b"Hello there, tiny model"
                 ) -> tuple[str, bytes]:
        self.n += 1
        rid = f"w{self.n}-{time.monotonic_ns()}"
        req = service_pb2.ModelInferRequest(model_name=MODEL, id=rid)
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
        req.raw_input_contents.extend([len(prompt).to_bytes(4, "little") + prompt,
                                       max_tokens.to_bytes(4, "little")])
        return rid, req.SerializeToString()

    def begin(self, max_tokens: int, stream: bool) -> None:
        rid, req = self._request(max_tokens)
        sid = self.conn.get_next_available_stream_id()
        method = "ModelStreamInfer" if stream else "ModelInfer"
        self.conn.send_headers(sid, [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", (self.PATH + method).encode()),
            (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
            (b"te", b"trailers")])
        self.conn.send_data(sid, struct.pack(">BI", 0, len(req)) + req, end_stream=True)
        sent, _ = self.ssock.send(self.conn.data_to_send())
        self.cur = {"id": rid, "sid": sid, "stream": stream, "sent": sent, "buf": bytearray(),
                    "first": None, "n": 0, "status": None, "waits": []}

    def step(self) -> dict | None:
        c = self.cur
        assert c is not None
        peeked, _ = self.ssock.peek()
        assert peeked, "server closed the connection"
        data = self.partial + peeked
        at = 0
        while len(data) - at >= 9 and len(data) - at >= 9 + int.from_bytes(data[at:at + 3], "big"):
            end = at + 9 + int.from_bytes(data[at:at + 3], "big")
            for ev in self.conn.receive_data(data[at:end]):
                if isinstance(ev, h2.events.DataReceived) and ev.stream_id == c["sid"]:
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, c["sid"])
                    buf = c["buf"]
                    buf += ev.data
                    while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                        size = int.from_bytes(buf[1:5], "big")
                        msg = bytes(buf[5:5 + size])
                        del buf[:5 + size]
                        out = (service_pb2.ModelStreamInferResponse.FromString(msg).infer_response
                               if c["stream"] else service_pb2.ModelInferResponse.FromString(msg))
                        if out.raw_output_contents:
                            c["n"] += 1
                            if c["first"] is None:  # the segment holding this frame's end
                                c["first"] = self.ssock.peek(end - len(self.partial))[1]
                elif isinstance(ev, h2.events.TrailersReceived) and ev.stream_id == c["sid"]:
                    c["status"] = int(dict(ev.headers)[b"grpc-status"])
            at = end
        got, last, user = self.ssock.recv_exactly(len(peeked))  # a read may come back short
        assert got == peeked and last is not None, "server closed the connection"
        c["waits"].append(user - last)
        self.partial = data[at:]
        pending = self.conn.data_to_send()
        if pending:
            self.ssock.send(pending)
        if c["status"] is None:
            return None
        assert c["status"] == 0 and c["first"] is not None
        self.cur = None
        return {"id": c["id"], "ttft": (c["first"] - c["sent"]) / 1e9, "sent": c["sent"],
                "output_tokens": c["n"] if c["stream"] else None, "stream": c["stream"],
                "client_wait": max(c["waits"]) / 1e9}

    def call(self, max_tokens: int, stream: bool) -> dict:
        self.begin(max_tokens, stream)
        while (r := self.step()) is None:
            pass
        return r

    def unary(self, max_tokens: int) -> dict:
        return self.call(max_tokens, stream=False)

    def stream(self, max_tokens: int) -> dict:
        return self.call(max_tokens, stream=True)

    def close(self) -> None:
        self.conn.close_connection()
        self.ssock.send(self.conn.data_to_send())
        self.sock.close()


def request_waits(capture_path, pid: int, sent: dict[str, int]) -> dict[str, int]:
    """Per request id, ns from the client's send to the exit of the server's read
    syscall that carried the id's first byte, from a `tokentrace run --record`
    capture (each connection's inbound bytes joined, as a read may split a request)."""
    conns: dict[tuple, tuple[bytearray, list[tuple[int, int]]]] = {}
    for item in capture.CaptureReader(capture_path):
        if not isinstance(item, bytes) or wire.kind_of(item) != wire.CONSTANTS["KIND_DATA"]:
            continue
        ev = schema.decode(item)
        if ev.pid == pid and ev.inbound and ev.payload:
            buf, reads = conns.setdefault(ev.key, (bytearray(), []))
            reads.append((len(buf), ev.ts_exit))
            buf += ev.payload
    out: dict[str, int] = {}
    for buf, reads in conns.values():
        for rid, t in sent.items():
            at = buf.find(rid.encode())
            if at >= 0:
                out[rid] = max(ts for start, ts in reads if start <= at) - t
    assert set(out) == set(sent), set(sent) - set(out)
    return out


def spans_by_request_id(spans):
    out = {}
    for s in spans:
        rid = s["attributes"].get("tokentrace.kserve.request_id")
        if rid:
            assert rid not in out, f"two spans for {rid}"
            out[rid] = s
    return out


def test_unary_and_streaming_calls_one_span_each_with_tokens_and_ttft(server, tmp_path):
    """The tracer runs as its own process, as in production: `tokentrace run --pid`
    (in this process its thread would hold the GIL the client's clock reads need)."""
    triton, raw = Client(server.target), WireClient(server.target)
    calls = []
    gc.collect()
    gc.disable()  # a collection between the response and the clock read is not TTFT
    try:
        with traced_cli(["--pid", str(server.pid), "--record", str(tmp_path / "cap.ttcap")],
                        str(tmp_path / "spans.jsonl")) as got, realtime_thread():
            # the raw connection was opened before attach: its stream offsets are tied
            # to sequence numbers at the first ACK that finds nothing in flight after a
            # server write, so one exchange goes first (its own span is not compared:
            # its response may leave before that ACK, and then it is syscall-timed)
            warm = raw.unary(3)
            # calls back to back behind it can keep the connection busy past the ACK
            # the anchor waits for (measured: 3-4 exchanges late, those syscall-timed)
            time.sleep(0.2)
            for i in range(200):
                n = 3 + i % 9
                if i % 4 < 2:  # tritonclient: the SDK's view
                    c = triton.stream(n) if i % 2 else triton.unary(n, counts=i % 8 == 0)
                else:  # the wire's view, for the TTFT comparison
                    c = raw.stream(n) if i % 2 else raw.unary(n)
                calls.append((n, c))
    finally:
        gc.enable()
        triton.close()
        raw.close()
    spans = spans_by_request_id(got.spans)
    assert len(spans) == 201 and warm["id"] in spans
    # the client's stamps are realtime, the capture's monotonic
    realtime_less_monotonic = time.time_ns() - time.monotonic_ns()
    waits = request_waits(tmp_path / "cap.ttcap", server.pid,
                          {c["id"]: c["sent"] - realtime_less_monotonic
                           for _, c in calls if c["id"].startswith("w")})
    diffs, signed, sdk = [], [], []
    for n, c in calls:
        s = spans[c["id"]]
        a = s["attributes"]
        assert (a["rpc.system"], a["rpc.service"]) == ("grpc", "inference.GRPCInferenceService")
        assert a["rpc.method"] == ("ModelStreamInfer" if c["stream"] else "ModelInfer")
        assert a["rpc.grpc.status_code"] == 0 and s["status"] != "ERROR"
        assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.model"] == MODEL
        assert a["tokentrace.kserve.inputs"] == ["text_input:BYTES[1]", "max_tokens:INT32[1]"]
        if c["stream"]:
            assert a["gen_ai.usage.output_tokens"] == c["output_tokens"] == n
            assert a["tokentrace.usage.source"] == "stream_chunks"
            assert a["tokentrace.grpc.response_messages"] == n
        elif c["output_tokens"] is not None:
            assert a["gen_ai.usage.output_tokens"] == c["output_tokens"] == n
            assert a["tokentrace.usage.source"] == "num_output_tokens"
        else:
            assert "gen_ai.usage.output_tokens" not in a  # not returned: not invented
        d = a["tokentrace.time_to_first_token"] - c["ttft"]
        if c["id"].startswith("w"):
            signed.append(d)
            diffs.append(off_by(a["tokentrace.time_to_first_token"], c["ttft"], a))
        else:
            sdk.append(abs(d))
    mean = sum(diffs) / len(diffs)
    print(f"\n|tracer TTFT - client wire TTFT| over {len(diffs)} calls: max "
          f"{max(diffs) * 1e3:.3f} ms, mean {mean * 1e3:.3f} ms, p50 "
          f"{sorted(diffs)[len(diffs) // 2] * 1e3:.3f} ms, signed mean "
          f"{sum(signed) / len(signed) * 1e3:.3f} ms; against tritonclient's own timing "
          f"({len(sdk)} calls): mean {sum(sdk) / len(sdk) * 1e3:.3f} ms, p50 "
          f"{sorted(sdk)[len(sdk) // 2] * 1e3:.3f} ms")
    for kind in (False, True):
        print("stream" if kind else "unary", "signed ms:", sorted(
            round((spans[c["id"]]["attributes"]["tokentrace.time_to_first_token"] - c["ttft"]) * 1e3, 2)
            for _, c in calls if c["id"].startswith("w") and c["stream"] is kind))
    # The tracer's TTFT runs from the request bytes' arrival at the server's socket to
    # the first response message's bytes leaving it (bpf/netwait.c; the connection was
    # opened before attach, and anchored at an idle ACK); the client's from its
    # request's departure to the arrival of the first output's segment, by the kernel's
    # stamps on its socket: one clock, so the tracer's is never longer. The
    # time a request waited in the socket for grpcio's reader thread (over 2 ms in 1-8
    # calls of 100 on the shared 2-vCPU VM, docs/grpc.md) is now inside the span, so
    # the bar (98% within 2 ms, none over 10 ms, mean under 1 ms) holds on the
    # raw error. The capture's reads say how long each request waited to be read.
    own = sorted(round(c["client_wait"] * 1e3, 2) for _, c in calls
                 if c["id"].startswith("w") and c["client_wait"] > 0.002)
    print(f"the client's own waits for a CPU over 2 ms (not in its TTFT): {own} ms")
    slow = sorted(round(w / 1e6, 2) for w in waits.values() if w > 2_000_000)
    print(f"requests that waited over 2 ms in the server's socket: {slow} ms "
          f"(load average {os.getloadavg()[0]:.1f})")
    assert min(waits.values()) > 0  # one clock: no read before the client sent
    for _, c in calls:
        if c["id"].startswith("w"):
            a = spans[c["id"]]["attributes"]
            assert a["tokentrace.network.timing"] == "socket", a.get("tokentrace.network.timing_reason")
            # arrival to read, against the client's send to the read: within the
            # loopback hand-off
            assert abs(a["tokentrace.network.socket_wait"] - waits[c["id"]] / 1e9) < 0.002
    longer = sorted(signed)[-3:]
    assert longer[-1] < 0.001, f"tracer's TTFT longer than the client's: {longer}"
    within = sum(d < 0.002 for d in diffs)
    assert within >= 0.98 * len(diffs) and max(diffs) < 0.010 \
        and sum(diffs) / len(diffs) < 0.001, sorted(diffs)[-5:]
    assert got.returncode == 0 and "no events lost" in got.stderr, got.stderr
    # the calls' authorization metadata is masked in the capture (HPACK, see h2mask)
    from tracer.events.h2mask import _HUFFMAN
    raw = gzip.decompress((tmp_path / "cap.ttcap").read_bytes())
    assert GRPC_KEY.encode() not in raw and _HUFFMAN.encode(GRPC_KEY.encode()) not in raw


def test_64_concurrent_streams_on_one_connection_neither_lost_nor_merged(server):
    channel = grpc.insecure_channel(server.target)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    stub.ServerLive(service_pb2.ServerLiveRequest())  # the one connection is up
    results: dict[str, int] = {}
    errors: list = []
    start = threading.Barrier(64)

    def one(i: int) -> None:
        req = service_pb2.ModelInferRequest(model_name=MODEL, id=f"c{i}")
        t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        m = req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
        del t, m
        prompt = f"concurrent {i}".encode()
        req.raw_input_contents.extend([len(prompt).to_bytes(4, "little") + prompt,
                                       (1 + i % 8).to_bytes(4, "little")])
        start.wait()
        try:
            n = sum(1 for r in stub.ModelStreamInfer(iter([req]))
                    if r.infer_response.raw_output_contents)
            results[f"c{i}"] = n
        except grpc.RpcError as e:
            errors.append(e)

    with traced(pids=[server.pid]) as got:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    channel.close()
    assert not errors and len(results) == 64
    spans = spans_by_request_id(got.spans)
    assert set(spans) == set(results)
    # what the capture and the parser counted, should a count be off (seen once, under
    # a second test worker's load: one stream's 6 tokens counted 5)
    seen = {k: v for k, v in got.report.items() if v and any(
        w in k for w in ("lost", "cut", "resync", "trunc", "skipped", "refused", "full"))}
    for rid, n in results.items():
        a = spans[rid]["attributes"]
        assert n == 1 + int(rid[1:]) % 8
        assert a["gen_ai.usage.output_tokens"] == n, (rid, a, seen)
        assert a["tokentrace.grpc.request_messages"] == 1
        assert a["tokentrace.grpc.response_messages"] == n, (rid, a, seen)
    assert len({s["attributes"]["client.port"] for s in spans.values()}) == 1
    overlap = sum(1 for s in spans.values()
                  if any(o is not s and o["start_time_unix_nano"] < s["end_time_unix_nano"]
                         and s["start_time_unix_nano"] < o["end_time_unix_nano"]
                         for o in spans.values()))
    assert overlap >= 32, "the calls really ran at the same time"
    assert got.report.get("bytes_lost", 0) == 0


def test_attaching_to_an_open_connection_names_later_calls_by_their_messages(server):
    """tritonclient's channel (grpc-core) used before the tracer exists: every later
    call's header block refers to the table built before the attach, so neither its
    :path nor its content-type can be read. The calls are gRPC by their framing and
    KServe by their messages; the spans say both were inferred."""
    client = Client(server.target)
    for _ in range(3):
        client.unary(2, counts=True)  # connected and used before the tracer exists
    with traced(pids=[server.pid]) as got:
        later = [client.unary(3, counts=True), client.unary(4, counts=True)]
        streamed = client.stream(5)  # a method the connection never called before
    client.close()
    assert got.report.get("connections_existing", 0) >= 1
    assert got.report.get("http2_header_blocks_undecodable", 0) >= 2
    assert got.report.get("grpc_calls_by_framing", 0) == len(later)
    spans = got.spans
    assert len(spans) == 3
    by_id = {s["attributes"].get("tokentrace.kserve.request_id"): s for s in spans}
    for c in later:
        a = by_id[c["id"]]["attributes"]
        assert a["tokentrace.http2.unknown_header_fields"] > 0
        assert a["tokentrace.grpc.framing_inferred"] and a["tokentrace.grpc.method_inferred"]
        assert (a["rpc.service"], a["rpc.method"]) == ("inference.GRPCInferenceService",
                                                      "ModelInfer")
        assert a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.usage.output_tokens"] == c["output_tokens"]
    # the stream's :path was new to the table: read, not inferred
    a = by_id[streamed["id"]]["attributes"]
    assert a["rpc.method"] == "ModelStreamInfer" and "tokentrace.grpc.method_inferred" not in a
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.request.model"] == MODEL


def test_compressed_calls_still_give_model_request_id_and_tokens(tmp_path):
    """Requests compressed by tritonclient (grpcio's compression option), responses by
    the server (grpcio server compression; grpcio sends a message uncompressed when
    compressing would not shrink it, so the long completions are the compressed
    ones): the tracer inflates both directions."""
    with GrpcSampleServer(port=free_port(), args=["--compression", "gzip"],
                          log=tmp_path / "server.log") as srv:
        client = Client(srv.target)
        with traced(pids=[srv.pid]) as got:
            calls = [client.unary(200, "a compressed prompt " * 40, counts=True,
                                  compression="deflate"),
                     client.stream(5, "another one " * 40, compression="gzip"),
                     client.unary(200, counts=True)]  # request plain, response compressed
        client.close()
    spans = spans_by_request_id(got.spans)
    assert set(spans) == {c["id"] for c in calls}
    for c in calls:
        a = spans[c["id"]]["attributes"]
        assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.model"] == MODEL
        assert a["tokentrace.kserve.inputs"] == ["text_input:BYTES[1]", "max_tokens:INT32[1]"]
        assert a["gen_ai.usage.output_tokens"] == c["output_tokens"]
        assert a["rpc.grpc.status_code"] == 0
    recs = {r.llm_request.request_id: r for r in got.records}
    assert [(recs[c["id"]].request_headers.get("grpc-encoding"),
             recs[c["id"]].response_headers.get("grpc-encoding")) for c in calls] \
        == [("deflate", "gzip"), ("gzip", "gzip"), (None, "gzip")]
    compressed = [recs[c["id"]].rpc.compressed_messages for c in calls]
    assert compressed[0] == 2 and compressed[1] >= 1 and compressed[2] == 1, compressed
    # every compressed message was inflated, none failed
    assert got.report.get("grpc_messages_decompressed") == sum(compressed)
    assert not {k: v for k, v in got.report.items() if k.startswith("grpc_decompress_")}


def test_32_concurrent_wire_clients_ttft_as_the_client_sees_it(server, tmp_path):
    """Concurrency 32: 32 new connections, 3 calls each, unary and streamed, all in
    flight at once, driven by one real-time thread (``drive``: no client waits for the
    others' GIL, nor for a CPU while the server runs). The clients' truth is their
    sockets' kernel stamps; their own waits are printed apart."""
    with traced_cli(["--pid", str(server.pid)], str(tmp_path / "spans.jsonl")) as got:
        clients = [WireClient(server.target) for _ in range(32)]
        with realtime_thread():
            calls = drive(clients, lambda i, k, c: c.begin(3 + (i + k) % 9,
                                                         stream=(i + k) % 2 == 1),
                          per_client=3)
        for c in clients:
            c.close()
    spans = spans_by_request_id(got.spans)
    assert len(calls) == 96 and set(spans) >= {c["id"] for c in calls}
    diffs = []
    for c in calls:
        a = spans[c["id"]]["attributes"]
        assert a["tokentrace.network.timing"] == "socket", a.get("tokentrace.network.timing_reason")
        if c["stream"]:
            assert a["gen_ai.usage.output_tokens"] == c["output_tokens"]
        diffs.append(off_by(a["tokentrace.time_to_first_token"], c["ttft"], a))
    waits = sorted(c["client_wait"] for c in calls)
    within = sum(d < 0.002 for d in diffs)
    print(f"\n|tracer TTFT - client TTFT| over 96 calls at concurrency 32: {within}/96 within "
          f"2 ms, max {max(diffs) * 1e3:.3f} ms, mean {sum(diffs) / 96 * 1e3:.3f} ms; the "
          f"clients' own waits after arrival, apart: max {waits[-1] * 1e3:.2f} ms, "
          f"{sum(w > 0.002 for w in waits)} over 2 ms")
    # one call may be further off, not over 50 ms: a CI run on the loaded 2-core VM had
    # one of 96 at 11.3 ms (95 within 2 ms), not reproduced in five runs here (three beside
    # busy loops). The probes stamp a request's arrival when TCP processes its segment
    # (tcp_probe), which a starved softirq, or a socket backlog behind a lock-holding
    # server thread that lost its CPU, can put after the client's send; the message
    # says which side was late
    worst = sorted(range(len(diffs)), key=diffs.__getitem__)[-2:]
    late = [(calls[i]["stream"], round((spans[calls[i]["id"]]["attributes"]
                                        ["tokentrace.time_to_first_token"]
                                        - calls[i]["ttft"]) * 1e3, 3),
             {k: v for k, v in spans[calls[i]["id"]]["attributes"].items() if "network" in k})
            for i in worst]
    assert within >= 0.98 * len(diffs), late
    assert diffs[worst[0]] < 0.010 and diffs[worst[1]] < 0.050, late
    assert got.returncode == 0 and "no events lost" in got.stderr, got.stderr
