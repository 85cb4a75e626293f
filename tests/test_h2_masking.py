"""Credentials inside HTTP/2 (gRPC) header blocks are masked before a capture is
written: real HPACK from hyper-h2 (Huffman and literal values, dynamic-table name
references, never-indexed fields), reads cut anywhere, and a replay that still parses
every call as the live run did."""

from __future__ import annotations

import gzip
import random

import pytest
from hpack import Decoder

from tests.h2wire import Wire, frame, grpc_message
from tracer.correlate.connections import TrackerOptions
from tracer.events import capture, wire
from tracer.events.h2mask import H2SecretMasker
from tracer.pipeline import Pipeline
from tests.test_privacy import conn

C = wire.CONSTANTS
KEYS = ("sk-grpc-0123456789abcdefSECRET", "XKEY-first-SECRET", "XKEY-second-SECRET",
        "sessionCOOKIESECRET")
# forms a secret could take in the file: as sent, and as HPACK's Huffman code
FORMS = [k.encode() for k in KEYS]


def _huffman(s: bytes) -> bytes:
    from tracer.events.h2mask import _HUFFMAN
    return _HUFFMAN.encode(s)


def conversation() -> Wire:
    """Two gRPC calls on one connection; the second reuses x-api-key's name from the
    dynamic table with a new value."""
    w = Wire()
    body = grpc_message(b"\x0a\x05hello")
    s1 = w.request("/inference.GRPCInferenceService/ModelInfer", body=body, extra=[
        ("authorization", "Bearer " + KEYS[0]), ("x-api-key", KEYS[1]),
        ("cookie", KEYS[3])])
    w.respond(s1, [grpc_message(b"\x0a\x02ok")])
    s2 = w.request("/inference.GRPCInferenceService/ModelInfer", body=body, extra=[
        ("authorization", "Bearer " + KEYS[0]), ("x-api-key", KEYS[2])])
    w.respond(s2, [grpc_message(b"\x0a\x02ok")], extra=[("set-cookie", KEYS[3])])
    return w


def records(w: Wire, rng: random.Random | None) -> list[bytes]:
    """The conversation as the server's ring-buffer records, each read cut at random
    points when ``rng`` is given."""
    out, offs = [conn(C["CONN_ACCEPT"], 1)], {True: 0, False: 0}
    ts = 10
    for from_client, chunk in w.chunks:
        pieces = [chunk]
        if rng is not None and len(chunk) > 2:
            cuts = sorted(rng.sample(range(1, len(chunk)), min(3, len(chunk) - 1)))
            pieces = [chunk[a:b] for a, b in zip([0] + cuts, cuts + [len(chunk)])]
        for p in pieces:
            f = dict(kind=C["KIND_DATA"], pid=10, tid=11, fd=5, conn_id=99, ts_enter=ts - 2,
                     ts_exit=ts, ret=len(p), offset=0, len=len(p), syscall=C["SYS_RECVFROM"],
                     direction=C["DIR_IN"] if from_client else C["DIR_OUT"],
                     flags=C["FLAG_LAST"], pad=0, stream_off=offs[from_client])
            out.append(wire.DATA.header.pack(*(f[n] for n in wire.DATA.names)) + p)
            offs[from_client] += len(p)
            ts += 10
    out.append(conn(C["CONN_CLOSE"], ts + 10))
    return out


def analyse(items: list) -> list:
    got: list = []

    class Sink:
        def on_record(self, rec):
            got.append(rec)

        def close(self):
            pass

    p = Pipeline([Sink()], options=TrackerOptions(secrets_masked=True))
    for i in items:
        p.feed(i)
    p.close()
    return got


def write(recs: list[bytes], path) -> list[bytes]:
    w = capture.CaptureWriter(path, capture.new_header(tenant_salt="deployment-a"))
    for r in recs:
        w.write(r)
    w.close()
    return [i for i in capture.CaptureReader(path) if isinstance(i, bytes)]


def headers_seen(recs: list[bytes], direction: int) -> list[tuple[bytes, bytes]]:
    """Every header field a full HPACK decoder reads from one direction's bytes."""
    stream = b"".join(r[wire.DATA.header_size:] for r in recs
                      if wire.kind_of(r) == C["KIND_DATA"] and wire.DATA.unpack(r)["direction"] == direction)
    if stream.startswith(b"PRI *"):
        stream = stream[24:]
    dec, out, i, block = Decoder(), [], 0, b""
    while i + 9 <= len(stream):
        n = int.from_bytes(stream[i:i + 3], "big")
        ftype, flags = stream[i + 3], stream[i + 4]
        payload = stream[i + 9:i + 9 + n]
        if ftype in (1, 9):
            if ftype == 1 and flags & 0x8:
                payload = payload[1:len(payload) - payload[0]]
            if ftype == 1 and flags & 0x20:
                payload = payload[5:]
            block += payload
            if flags & 0x4:
                out += dec.decode(block, raw=True)
                block = b""
        i += 9 + n
    return out


@pytest.mark.parametrize("seed", [None, 1, 2, 3, 4, 5])
def test_grpc_credentials_are_masked_and_the_replay_parses_every_call(tmp_path, seed):
    w = conversation()
    recs = records(w, random.Random(seed) if seed is not None else None)
    live = analyse(recs)
    stored = write(recs, tmp_path / "c.ttcap")
    raw = gzip.decompress((tmp_path / "c.ttcap").read_bytes())
    for k in FORMS:
        assert k not in raw and _huffman(k) not in raw, k
    # the same records, each as long as it was, in the order of their direction
    assert sorted(len(r) for r in stored) == sorted(len(r) for r in recs)
    for d in (C["DIR_IN"], C["DIR_OUT"]):
        before, after = headers_seen(recs, d), headers_seen(stored, d)
        assert [n for n, _ in before] == [n for n, _ in after]  # every block still decodes
        for (n, v0), (_, v1) in zip(before, after):
            if n in (b"authorization", b"x-api-key", b"cookie", b"set-cookie"):
                assert v1 != v0 and len(v1) == len(v0)
                assert not any(k in v1 for k in FORMS)
                if n == b"authorization":
                    assert v1.startswith(b"Bearer ")
            else:
                assert v1 == v0, n
    again = analyse(stored)
    assert len(live) == len(again) == 2
    assert [r.target for r in again] == [r.target for r in live]
    assert [r.status for r in again] == [r.status for r in live]
    # a Huffman-coded key is replaced by other characters of the same code length, so
    # the replay's tenant is not the live one, but one key is still one tenant
    assert live[0].tenant == live[1].tenant and again[0].tenant == again[1].tenant
    assert again[0].tenant is not None
    assert [r.status for r in again] == [r.status for r in live]


def test_a_block_left_open_at_close_is_zeroed_not_kept():
    """The connection closes inside a header block: the held reads are written with
    the block's bytes zeroed, and counted."""
    m = capture.SecretMasker(b"s")
    block = b"\x40\x0dauthorization\x0fBearer SECRETXX"  # literal, incremental indexing
    frames = frame(1, 0x0, 1, block[:20]) + frame(9, 0x4, 1, block[20:])
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"")
    recs = records_from([preface, frames[:25]])
    out = []
    for r in recs:
        out += m.records(r)
    assert len(out) == 2  # the accept and the preface; the cut read is held
    out += m.records(conn(C["CONN_CLOSE"], 99))
    assert len(out) == 4 and m.h2.blocks_cut == 1
    assert b"SECRET" not in b"".join(out)
    assert len(out[2]) == len(recs[2])


def records_from(chunks: list[bytes]) -> list[bytes]:
    out, off = [conn(C["CONN_ACCEPT"], 1)], 0
    for p in chunks:
        f = dict(kind=C["KIND_DATA"], pid=10, tid=11, fd=5, conn_id=99, ts_enter=1, ts_exit=2,
                 ret=len(p), offset=0, len=len(p), syscall=C["SYS_RECVFROM"],
                 direction=C["DIR_IN"], flags=C["FLAG_LAST"], pad=0, stream_off=off)
        out.append(wire.DATA.header.pack(*(f[n] for n in wire.DATA.names)) + p)
        off += len(p)
    return out


def test_lost_bytes_cut_the_open_block_and_resync_on_the_next_frames():
    m = H2SecretMasker(b"s")
    key = (1, 2, 3, 1)
    pre = bytearray(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b""))
    assert m.is_http2(key, pre, (1, 2, 3, 2))
    assert m.feed(key, pre, 0, len(pre)) == [pre]
    block = b"\x40\x09x-api-key\x0cSECRET-VALUE"
    half = bytearray(frame(1, 0x4, 1, block)[:20])
    assert m.feed(key, half, 0, len(half)) == []  # held
    later = bytearray(frame(1, 0x5, 3, b"\x40\x09x-api-key\x0bSECRET-NEXT")
                      + frame(0, 1, 3, b"x"))
    out = m.feed(key, later, 0, len(later), complete=False)
    assert out == [half, later] and m.blocks_cut == 1
    assert b"SECRET" not in b"".join(out)


def test_the_masker_follows_http1_and_opaque_connections_untouched():
    m = H2SecretMasker(b"s")
    k = (1, 2, 3, 1)
    req = bytearray(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert not m.is_http2(k, req, (1, 2, 3, 2))
    assert m.feed(k, req, 0, len(req)) == [req]
    assert bytes(req) == b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
