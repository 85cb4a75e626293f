"""Fuzz targets shared by the short hypothesis tests (tests/test_fuzz.py) and the long
runs (bench/fuzz.py): per layer, a seed corpus of real bytes, a mutation format, and a
target that feeds mutated bytes to the layer and checks what must hold whatever a peer
sends (no exception but the layer's own documented ones, bounded buffers, sane counts).

A case is ``(seed, ops, splits)``: the seed corpus entry, the mutations applied to it
(``apply_ops``), and the sizes the bytes are cut into before feeding.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import random
import struct
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = ROOT / "samples" / "captures"
MAX_COUNT = (1 << 63) - 1

# bytes worth inserting: numbers JSON and Python disagree on, deep nesting, line ends,
# digits str.isdigit() takes and int() refuses, huge lengths, escapes, TLS, h2 preface
TOKENS = (b"Infinity", b"-Infinity", b"NaN", b"1e999", b"-1", b"1.5", b"[" * 64, b"{" * 64,
          b'{"text": 5}', b"\r\n", b"\n\n", b"\r", b"\x00", b"\xff", "²".encode(),
          "٣".encode(), b"Content-Length: 99999999999999999999\r\n",
          b"Transfer-Encoding: chunked\r\n", b"ffffffffffff\r\n", b"%2F", b"\\u0000",
          b"\x16\x03\x01\x02\x00", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"data: ",
          b"\x00\xff\xff\xff\x00\x00\x00\x00\x01", b"\x80\xff\xff\xff\x0f", b"9" * 40)

Op = tuple[int, int, bytes]  # (kind, position, bytes)


def apply_ops(data: bytes, ops: list[Op]) -> bytes:
    """Mutate ``data``: 0 flip a byte, 1 insert, 2 delete a range, 3 duplicate a range,
    4 overwrite, 5 truncate; positions wrap around the current length."""
    b = bytearray(data)
    for kind, pos, blob in ops:
        n = len(b)
        i = pos % (n + 1)
        k = kind % 6
        if k == 0 and n:
            b[i % n] ^= (blob[0] if blob else 0x20) or 1
        elif k == 1:
            b[i:i] = blob
        elif k == 2:
            del b[i:i + 1 + len(blob) * 8]
        elif k == 3:
            b[i:i] = b[i:i + 1 + len(blob) * 16]
        elif k == 4:
            b[i:i + len(blob)] = blob
        elif k == 5 and n > 1:
            del b[max(1, i):]
    return bytes(b)


def split(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` cut into pieces of ``sizes`` (cycled), the rest in one piece."""
    out, pos = [], 0
    for s in sizes:
        if pos >= len(data):
            break
        out.append(data[pos:pos + max(1, s)])
        pos += max(1, s)
    if pos < len(data):
        out.append(data[pos:])
    return out


def random_case(rng: random.Random, corpus_size: int) -> tuple[int, list[Op], list[int]]:
    """A case drawn without hypothesis (the long runs)."""
    ops = []
    for _ in range(rng.randint(0, 6)):
        blob = (rng.choice(TOKENS) if rng.random() < 0.5
                else bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 8))))
        ops.append((rng.randint(0, 5), rng.randint(0, 1 << 16), blob))
    splits = [rng.choice((1, 2, 3, 7, 64, 500, 4096)) for _ in range(rng.randint(0, 12))]
    return rng.randrange(corpus_size), ops, splits


def _count_ok(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT)


# ---- seed corpora (built once) ---------------------------------------------------------


@functools.cache
def capture_payloads(name: str) -> list[tuple[bool, bytes]]:
    """(from one connection of a committed capture) each chunk's direction and bytes."""
    from tests.conftest import capture_streams

    streams = capture_streams(CAPTURES / name)
    best = max(streams.values(), key=lambda v: sum(len(c[2]) for c in v))
    return [(inbound, data) for inbound, _, data in best]


@functools.cache
def http1_corpus() -> list[tuple[bytes, bytes]]:
    """(client bytes, server bytes) of real HTTP/1 exchanges."""
    from tests.conftest import capture_streams

    out = []
    for chunks in capture_streams(CAPTURES / "openai-http1.ttcap").values():
        c = b"".join(d for i, _, d in chunks if i)
        s = b"".join(d for i, _, d in chunks if not i)
        if c.startswith((b"GET", b"POST")):
            out.append((c, s))
    return out


@functools.cache
def h2_corpus() -> list[list[tuple[bool, bytes]]]:
    """Real HTTP/2 gRPC conversations (hyper-h2 endpoints; the KServe capture)."""
    from protocols.proto import messages
    from tests.h2wire import Wire, grpc_message

    m = messages()
    convs = []
    w = Wire()
    req = m.ModelInferRequest(model_name="tiny", id="1")
    t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"hello")
    sid = w.request("/inference.GRPCInferenceService/ModelInfer",
                    body=grpc_message(req.SerializeToString()))
    resp = m.ModelInferResponse(model_name="tiny")
    o = resp.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    o.contents.bytes_contents.append(b"world")
    w.respond(sid, [grpc_message(resp.SerializeToString())])
    sid = w.request("/pkg.Echo/Say", body=grpc_message(b"hi"), extra=[("grpc-encoding", "gzip")])
    w.respond(sid, [grpc_message(b"x")], status=13, message="boom %2F")
    convs.append(list(w.chunks))
    convs.append([(not inbound, d) for inbound, d in capture_payloads("kserve-grpc.ttcap")])
    return convs


@functools.cache
def openai_corpus() -> list[tuple[str, bytes, bool]]:
    """(operation, body, streamed) of requests and responses."""
    out: list[tuple[str, bytes, bool]] = []
    for c, s in http1_corpus():
        head, _, body = c.partition(b"\r\n\r\n")
        op = "chat" if b"/chat/" in head else "text_completion"
        out.append((op, body, False))
        shead, _, sbody = s.partition(b"\r\n\r\n")
        out.append((op, sbody, b"event-stream" in shead))
    out.append(("chat", json.dumps({"error": {"type": "x", "message": "m"},
                                    "usage": {"prompt_tokens": 3}}).encode(), False))
    return out


@functools.cache
def kserve_corpus() -> list[tuple[bool, bytes]]:
    """(is a request, message) of KServe v2 protobufs."""
    from protocols.proto import messages

    m = messages()
    req = m.ModelInferRequest(model_name="tiny", id="7")
    for name, dt, val in (("text_input", "BYTES", None), ("max_tokens", "INT32", 5)):
        t = req.inputs.add(name=name, datatype=dt, shape=[1])
        if val is None:
            t.contents.bytes_contents.append(b"hello")
        else:
            t.contents.int_contents.append(val)
    req.parameters["temperature"].double_param = 0.5
    resp = m.ModelInferResponse(model_name="tiny", id="7")
    o = resp.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    o.contents.bytes_contents.append(b"world")
    n = resp.outputs.add(name="num_output_tokens", datatype="INT32", shape=[1])
    n.contents.int_contents.append(1)
    resp.raw_output_contents.append(struct.pack("<I", 5) + b"world")
    stream = m.ModelStreamInferResponse(infer_response=resp)
    return [(True, req.SerializeToString()), (False, resp.SerializeToString()),
            (False, stream.SerializeToString())]


@functools.cache
def capture_corpus() -> list[bytes]:
    """The committed capture files, decompressed."""
    return [gzip.decompress((CAPTURES / n).read_bytes())
            for n in ("openai-http1.ttcap", "kserve-grpc.ttcap", "torch-h200.ttcap")]


@functools.cache
def capture_items() -> list[list[Any]]:
    from tracer.events import capture

    return [list(capture.CaptureReader(CAPTURES / n))
            for n in ("openai-http1.ttcap", "kserve-grpc.ttcap")]


@functools.cache
def wire_corpus() -> list[bytes]:
    return [i for items in capture_items() for i in items if isinstance(i, bytes)][:200]


# ---- targets ---------------------------------------------------------------------------


def fuzz_http1(seed: int, ops: list[Op], splits: list[int]) -> None:
    from protocols import http1

    c, s = http1_corpus()[seed % len(http1_corpus())]
    c, s = apply_ops(c, ops), apply_ops(s, ops[::-1])
    conn = http1.HTTP1Connection(synced=bool(seed & 1))
    pieces = [(True, p) for p in split(c, splits)] + [(False, p) for p in split(s, splits)]
    random.Random(seed).shuffle(pieces)  # client and server interleaved any way
    for i, (fc, p) in enumerate(pieces):
        if splits and i % 5 == 4:
            conn.lost(splits[i % len(splits)] * 1000, i, fc)
        for e in conn.receive(p, i, fc):
            assert isinstance(e, http1.Event.__args__)  # type: ignore[attr-defined]
        for d in (conn._client, conn._server):
            assert len(d.hunt_buf) <= http1.HUNT_KEEP + len(p)
            assert len(d.head_buf) <= 65536 + len(p)
    conn.close(len(pieces))
    assert len(conn.unanswered) <= http1.MAX_UNANSWERED


def fuzz_sse(seed: int, ops: list[Op], splits: list[int]) -> None:
    from protocols import sse

    bodies = [b for op, b, streamed in openai_corpus() if streamed]
    body = bodies[seed % len(bodies)]
    p = sse.SSEParser()
    for piece in split(apply_ops(body, ops), splits):
        for ev in p.feed(piece, 1):
            assert isinstance(ev.data, str)
        assert len(p._buf) + p._held <= sse.MAX_PENDING + len(piece)


HOSTILE_VALUES: tuple[Any, ...] = (
    float("inf"), float("-inf"), float("nan"), 1e308, -1, 2**70, 1.5, True, None, "",
    "x" * 300, [[[[[]]]]], {"text": 5}, [{"text": 5}, {"text": {"a": 1}}], {"a": [1, {"b": 2}]},
    ["a", 1, [2, 3], None], {"type": [], "message": {"m": 1}, "code": 7})


def _replace_values(doc: Any, rng: random.Random, n: int) -> Any:
    """``doc`` with ``n`` values (anywhere in it) replaced by hostile ones."""
    for _ in range(n):
        node, key = doc, None
        path = []
        while isinstance(node, (dict, list)) and node and rng.random() < 0.8:
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            path.append((node, key))
            node = node[key]
        if path:
            parent, key = path[-1]
            parent[key] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
        elif isinstance(doc, dict):
            doc[rng.choice(("usage", "max_tokens", "choices", "messages", "error"))] = \
                copy.deepcopy(rng.choice(HOSTILE_VALUES))
    return doc


def _structural(body: bytes, rng: random.Random) -> bytes:
    """A JSON body (or each SSE data line) with values replaced by hostile ones."""
    def one(text: bytes) -> bytes:
        try:
            doc = json.loads(text)
        except ValueError:
            return text
        return json.dumps(_replace_values(doc, rng, rng.randint(1, 4))).encode()

    if body.lstrip().startswith(b"{"):
        return one(body)
    return b"\n".join(b"data: " + one(line[6:]) if line.startswith(b"data: {") else line
                      for line in body.split(b"\n"))


def fuzz_openai(seed: int, ops: list[Op], splits: list[int]) -> None:
    from protocols import openai

    op, body, streamed = openai_corpus()[seed % len(openai_corpus())]
    if seed & 16:  # valid JSON with hostile values, or else hostile bytes
        body = _structural(_dechunk(body), random.Random(seed))
    else:
        body = apply_ops(body, ops)
    q = openai.parse_request(op, body, complete=bool(seed & 2), keep_prompt=bool(seed & 4))
    for v in (q.max_tokens, q.n):
        assert _count_ok(v)
    assert q.temperature is None or q.temperature == q.temperature  # not NaN
    f = openai.ResponseFollower(op, keep_text=bool(seed & 4))
    headers = {"content-type": "text/event-stream" if streamed else "application/json"}
    if seed & 8:
        headers["content-encoding"] = "gzip"
        body = apply_ops(gzip.compress(body), ops[:1])
    f.head(1, 200, headers)
    for i, piece in enumerate(split(body, splits)):
        f.data(2 + i, piece)
    r = f.end(10**6)
    for v in (r.input_tokens, r.output_tokens):
        assert _count_ok(v)
    assert len(r.token_ts) <= openai.MAX_TOKEN_TS
    assert r.error_message is None or len(r.error_message) <= openai.MAX_ERROR_TEXT


def _dechunk(body: bytes) -> bytes:
    """A chunked body's data (or the body itself if it does not parse as chunked)."""
    out, pos = bytearray(), 0
    while True:
        eol = body.find(b"\r\n", pos)
        try:
            n = int(body[pos:eol], 16)
        except ValueError:
            return body
        if n == 0:
            return bytes(out)
        out += body[eol + 2:eol + 2 + n]
        pos = eol + 4 + n


def fuzz_http2(seed: int, ops: list[Op], splits: list[int]) -> None:
    from protocols import http2

    conv = h2_corpus()[seed % len(h2_corpus())]
    obs = http2.H2Observer(synced=not seed & 1)
    stream = [(fc, apply_ops(d, ops) if i == seed % len(conv) else d)
              for i, (fc, d) in enumerate(conv)]
    for i, (fc, d) in enumerate(stream):
        for piece in split(d, splits):
            obs.receive(piece, i, fc)
            side = obs.sides[fc]
            assert len(side.buf) <= max(side.max_frame + 9, http2.UNSYNCED_KEEP) + len(piece)
        if i % 4 == 3 and splits:
            obs.lost(splits[0], i, fc)


HOSTILE_HEADER_VALUES = ("/pkg.S%2Fx/M", "/a/b/c", "/%2F/%2F", "//", "/pkg.S/M%00", "²",
                         "1²", "٣", "9" * 5000, " 0 ", "-1", "", "%", "%zz", "é", "\x7f")


def _hostile_conversation(rng: random.Random) -> list[tuple[bool, bytes]]:
    """A well-formed gRPC exchange whose :path, :status, grpc-status and grpc-message
    are hostile (HPACK-coded by a real encoder, so the values reach the call layer)."""
    from tests.h2wire import Wire, grpc_message

    pick = lambda: rng.choice(HOSTILE_HEADER_VALUES)  # noqa: E731
    w = Wire()
    for end in (w.client, w.server):  # let the endpoints say what a hostile peer would
        end.config.validate_outbound_headers = end.config.validate_inbound_headers = False
        end.config.normalize_outbound_headers = False
    path = pick() if rng.random() < 0.7 else "/pkg.S/M"
    sid = w.request(path, body=grpc_message(b"q"), extra=[("grpc-encoding", pick())])
    w.server.send_headers(sid, [(b":status", pick().encode() if rng.random() < 0.5 else b"200"),
                                (b"content-type", b"application/grpc")])
    w.server.send_headers(sid, [(b"grpc-status", pick().encode()),
                                (b"grpc-message", pick().encode())], end_stream=True)
    w.pump()
    return w.chunks


def fuzz_grpc(seed: int, ops: list[Op], splits: list[int]) -> None:
    from protocols import grpc

    if seed & 4:
        conv = _hostile_conversation(random.Random(seed))
    else:
        conv = h2_corpus()[seed % len(h2_corpus())]
    conn = grpc.GrpcConnection(synced=not seed & 1)
    for i, (fc, d) in enumerate(conv):
        if i == seed % len(conv):
            d = apply_ops(d, ops)
        for piece in split(d, splits):
            for e in conn.receive(piece, i, fc):
                call = e.call
                call.service_method  # noqa: B018  (a property that parsed :path)
                assert call.grpc_status is None or 0 <= call.grpc_status < 10**10
                assert call.http_status is None or 0 <= call.http_status < 1000
        assert len(conn.streams) <= grpc.MAX_STREAMS
    for e in conn.close(10**6):
        assert e.call.end_ns == 10**6


HOSTILE_NUMBERS = (float("inf"), float("-inf"), float("nan"), 1e308, -1.0, 2.5, 0.0, 2**62)


def _hostile_kserve(rng: random.Random) -> tuple[bool, bytes]:
    """A valid KServe request or response whose numbers (parameters, count outputs,
    shapes) are hostile."""
    from protocols.proto import messages

    m = messages()
    num = lambda: rng.choice(HOSTILE_NUMBERS)  # noqa: E731
    if rng.random() < 0.5:
        req = m.ModelInferRequest(model_name="tiny")
        for name in ("max_tokens", "temperature", "top_p"):
            v = num()
            if isinstance(v, float):
                req.parameters[name].double_param = v
            else:
                req.parameters[name].int64_param = v
        t = req.inputs.add(name="max_tokens", datatype="FP64", shape=[1])
        t.contents.fp64_contents.append(float(num()))
        return True, req.SerializeToString()
    resp = m.ModelInferResponse(model_name="tiny")
    for name in ("num_output_tokens", "num_input_tokens", "text_output"):
        t = resp.outputs.add(name=name, datatype="FP32",
                             shape=[rng.choice((1, 0, -1, 1 << 62))] * rng.randint(1, 50))
        t.contents.fp32_contents.append(float(num()))
    return False, resp.SerializeToString()


def fuzz_kserve(seed: int, ops: list[Op], splits: list[int]) -> None:
    from protocols import kserve

    if seed & 4:
        is_req, msg = _hostile_kserve(random.Random(seed))
    else:
        is_req, msg = kserve_corpus()[seed % len(kserve_corpus())]
        msg = apply_ops(msg, ops)
    f = kserve.KServeFollower("ModelStreamInfer" if seed & 1 else "ModelInfer",
                              keep_content=bool(seed & 2))
    if is_req:
        f.request_message(1, msg)
    f.response_message(2, msg)
    q, r = f.end(3)
    for v in (q.max_tokens, r.input_tokens, r.output_tokens):
        assert _count_ok(v)


def fuzz_capture(seed: int, ops: list[Op], splits: list[int]) -> None:
    from tracer.events import capture

    raw = capture_corpus()[seed % len(capture_corpus())]
    # mutate the frames (then gzip), or the gzip stream itself
    data = gzip.compress(apply_ops(raw, ops)) if seed & 1 else apply_ops(gzip.compress(raw), ops)
    path = _scratch() / f"fuzz-{seed % 4}.ttcap"
    path.write_bytes(data)
    try:
        reader = capture.CaptureReader(path)
    except capture.CaptureError:
        return
    for item in reader:
        assert isinstance(item, bytes) or type(item).__name__ in _user_events()


def fuzz_wire(seed: int, ops: list[Op], splits: list[int]) -> None:
    from tracer.events import schema

    rec = apply_ops(wire_corpus()[seed % len(wire_corpus())], ops)
    try:
        schema.decode(rec)
    except schema.WireError:
        pass


def fuzz_tracker(seed: int, ops: list[Op], splits: list[int]) -> None:
    """A whole real capture through the pipeline, one record's payload mutated and some
    records dropped (capture gaps): no parser may fail (``parser_errors`` stays 0)."""
    from tracer.events import schema, wire
    from tracer.pipeline import Pipeline

    items = capture_items()[seed % len(capture_items())]
    rng = random.Random(seed)
    p = Pipeline([])
    target = rng.randrange(len(items))
    for i, item in enumerate(items):
        if isinstance(item, bytes) and wire.kind_of(item) == wire.CONSTANTS["KIND_DATA"]:
            if splits and rng.random() < 0.05:
                continue  # lost: a gap in that connection's stream
            if i >= target and ops:
                start = wire.DATA.header_size
                payload = apply_ops(item[start:], ops)
                f = wire.DATA.unpack(item)
                f["len"] = f["ret"] = len(payload)
                item = wire.DATA.header.pack(*(f[n] for n in wire.DATA.names)) + payload
                ops = []
        p.feed(item)
    p.close()
    report = p.report()
    assert not report.get("parser_errors"), {k: v for k, v in report.items() if "parser" in k}


@functools.cache
def _user_events() -> frozenset[str]:
    from tracer.events import schema

    return frozenset(schema.USER_EVENTS)


@functools.cache
def _scratch() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="tokentrace-fuzz-"))


TARGETS: dict[str, tuple[Callable[[int, list[Op], list[int]], None], Callable[[], list]]] = {
    "http1": (fuzz_http1, http1_corpus),
    "sse": (fuzz_sse, lambda: [0, 1]),
    "openai": (fuzz_openai, openai_corpus),
    "http2": (fuzz_http2, h2_corpus),
    "grpc": (fuzz_grpc, h2_corpus),
    "kserve": (fuzz_kserve, kserve_corpus),
    "capture": (fuzz_capture, capture_corpus),
    "wire": (fuzz_wire, wire_corpus),
    "tracker": (fuzz_tracker, capture_items),
}
