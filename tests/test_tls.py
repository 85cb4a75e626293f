"""TLS without BPF: the handshake reader on real hellos (Python's ssl on memory BIOs),
the pipeline fed the records the TLS probes send (ciphertext, BIND, plaintext), the
socket timer's mapping of plaintext writes to ciphertext writes, masking of TLS
plaintext in captures, and which libssl files are probed."""

from __future__ import annotations

import gzip
import os
import random
import shutil
import ssl
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import tls as tlsproto
from samples.tlscert import make_cert
from tests.h2wire import Wire, grpc_message
from tests.test_privacy import conn
from tests.test_tracker import BODY, HEAD, chunk
from tracer.correlate.connections import TrackerOptions
from tracer.correlate.nettiming import NetTimer
from tracer.correlate.records import RequestRecord
from tracer.events import capture, schema, wire
from tracer.events.netwait import NetTimingMode, NetWait
from tracer.pipeline import Pipeline
from tracer.probes import tls as tlsprobes

C = wire.CONSTANTS
KEY = "sk-tls-0123456789abcdefSECRET"
REQ = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
       + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    return make_cert(tmp_path_factory.mktemp("cert"))


def handshake(cert: tuple[Path, Path], max_version: ssl.TLSVersion | None = None,
              alpn: list[str] | None = None, sni: str | None = "localhost"
              ) -> list[tuple[bool, bytes]]:
    """A real TLS handshake between two ssl.SSLObjects: the bytes each side sent, in
    order, as (from_client, bytes)."""
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(*cert)
    cctx = ssl.create_default_context(cafile=str(cert[0]))
    if not sni:
        cctx.check_hostname = False
    if max_version is not None:
        cctx.maximum_version = max_version
    if alpn:
        sctx.set_alpn_protocols(alpn)
        cctx.set_alpn_protocols(alpn)
    cin, cout, sin, sout = (ssl.MemoryBIO() for _ in range(4))
    client = cctx.wrap_bio(cin, cout, server_hostname=sni)
    server = sctx.wrap_bio(sin, sout, server_side=True)
    out: list[tuple[bool, bytes]] = []
    done = [False, False]
    for _ in range(10):
        for i, (obj, src, dst, from_client) in enumerate(((client, cout, sin, True),
                                                          (server, sout, cin, False))):
            if not done[i]:
                try:
                    obj.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
            data = src.read()
            if data:
                out.append((from_client, data))
                dst.write(data)
        if all(done) and not cout.pending and not sout.pending:
            break
    assert all(done)
    return out


# ---- the handshake reader ---------------------------------------------------------------


def test_reader_names_tls13_cipher_and_server_name(cert):
    r = tlsproto.HandshakeReader()
    for from_client, data in handshake(cert):
        r.receive(data, from_client)
    assert r.client_hello and r.server_hello and not r.malformed and r.done
    s = r.session
    assert (s.protocol, s.version, s.server_name) == ("tls", "1.3", "localhost")
    assert s.cipher and s.cipher.startswith("TLS_") and s.alpn is None  # 1.3: ALPN encrypted


def test_reader_names_tls12_and_its_alpn_byte_by_byte(cert):
    r = tlsproto.HandshakeReader()
    for from_client, data in handshake(cert, ssl.TLSVersion.TLSv1_2, ["h2", "http/1.1"], None):
        for i in range(len(data)):  # records cut anywhere
            r.receive(data[i:i + 1], from_client)
    s = r.session
    assert (s.version, s.alpn, s.server_name) == ("1.2", "h2", None)
    assert s.cipher_suite is not None


def test_record_header_test():
    assert tlsproto.looks_like_record(b"\x16\x03\x01\x02\x00")
    assert tlsproto.looks_like_record(b"\x17\x03\x03\x40\x11")
    assert not tlsproto.looks_like_record(b"\x17\x03\x03\x00\x00")  # empty: never sent
    assert not tlsproto.looks_like_record(b"GET / HTTP/1.1\r\n")
    assert not tlsproto.looks_like_record(b"\x16\x03\x01")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.binary(max_size=300)), max_size=20))
def test_reader_never_raises_on_hostile_bytes(chunks):
    r = tlsproto.HandshakeReader()
    for from_client, data in chunks:
        r.receive(b"\x16\x03\x01" + data if data[:1] == b"!" else data, from_client)
    assert isinstance(r.session, tlsproto.TlsSession)


# ---- records the TLS probes send, through the pipeline --------------------------------


class Conn:
    """One accepted TLS connection's ring-buffer records, built the way bpf/tls.c and
    bpf/sockets.c make them."""

    def __init__(self, pid: int = 10, fd: int = 5, conn_id: int = 99) -> None:
        self.pid, self.fd, self.conn_id = pid, fd, conn_id
        self.ts = 100
        self.off = {(True, False): 0, (False, False): 0, (True, True): 0, (False, True): 0}
        self.items: list[bytes] = [conn(C["CONN_ACCEPT"], 1)]

    def _data(self, payload: bytes, inbound: bool, flags: int, ret: int | None = None,
              tls: bool = False) -> None:
        self.ts += 1000
        n = len(payload) if ret is None else ret
        f = dict(kind=C["KIND_DATA"], pid=self.pid, tid=11, fd=self.fd, conn_id=self.conn_id,
                 ts_enter=self.ts - 500, ts_exit=self.ts, ret=n, offset=0, len=len(payload),
                 syscall=(C["SYS_SSL_READ"] if inbound else C["SYS_SSL_WRITE"]) if tls
                 else C["SYS_RECVFROM"], direction=C["DIR_IN"] if inbound else C["DIR_OUT"],
                 flags=C["FLAG_LAST"] | flags, pad=0, stream_off=self.off[(inbound, tls)])
        self.off[(inbound, tls)] += n
        self.items.append(wire.DATA.header.pack(*(f[k] for k in wire.DATA.names)) + payload)

    def cipher_bytes(self, payload: bytes, inbound: bool) -> None:
        """Ciphertext before the handshake completed: captured whole."""
        self._data(payload, inbound, 0)

    def cipher(self, n: int, inbound: bool) -> None:
        """Ciphertext of an established object: its place, no payload."""
        self._data(b"", inbound, C["FLAG_CIPHER"], ret=n)

    def plain(self, payload: bytes, inbound: bool) -> None:
        self._data(payload, inbound, C["FLAG_TLS"], tls=True)

    def tls(self, op: str, fresh: bool = True, established: bool = False,
            failed: bool = False, ssl_ptr: int = 0x7F00AA) -> None:
        self.ts += 1000
        flags = ((C["TLS_F_FRESH"] if fresh else 0) | (C["TLS_F_ESTABLISHED"] if established else 0)
                 | (C["TLS_F_FAILED"] if failed else 0))
        self.items.append(wire.TLS.pack(
            pid=self.pid, tid=11, fd=self.fd, conn_id=self.conn_id, ts=self.ts, ssl=ssl_ptr,
            op=C[f"TLS_{op.upper()}"], via=C["TLS_VIA_BIO_IN"], flags=flags))

    def close(self) -> None:
        self.items.append(conn(C["CONN_CLOSE"], self.ts + 10))


def served(cert, requests: int = 2) -> Conn:
    """A TLS 1.3 handshake, then ``requests`` streamed chat requests in plaintext."""
    c = Conn()
    for i, (from_client, data) in enumerate(handshake(cert)):
        c.cipher_bytes(data, from_client)
        if i == 0:
            c.tls("bind")
    c.tls("established")
    for _ in range(requests):
        c.cipher(len(REQ) + 22, True)
        c.plain(REQ, True)
        for piece in (HEAD, chunk({"choices": [{"delta": {"content": " t"}}]}),
                      chunk({"choices": [{"delta": {"content": " u"}}]}),
                      b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"):
            c.plain(piece, False)
            c.cipher(len(piece) + 22, False)
    c.close()
    return c


def run(items: list, **options) -> tuple[list[RequestRecord], dict[str, int]]:
    got: list[RequestRecord] = []

    class Sink:
        def on_record(self, rec: RequestRecord) -> None:
            got.append(rec)

        def close(self) -> None:
            pass

    p = Pipeline([Sink()], options=TrackerOptions(**options))
    for i in items:
        p.feed(i)
    p.close()
    return got, p.report()


def test_plaintext_is_parsed_once_and_spans_say_tls(cert):
    recs, rep = run(served(cert).items)
    assert len(recs) == 2
    for r in recs:
        assert r.status == 200 and r.llm_response.output_tokens == 2
        assert r.tls is not None and r.tls.version == "1.3" and r.tls.server_name == "localhost"
        assert r.tenant is not None
    assert rep["tls_connections_decrypted"] == 1 and rep["connections_tls"] == 1
    assert rep["bytes_tls_ciphertext"] > 0 and not rep.get("parser_errors")
    assert not rep.get("http_protocol_errors") and not rep.get("bytes_lost")
    from tracer.export.spans import span_attributes
    a = span_attributes(recs[0])
    assert (a["tls.protocol.name"], a["tls.protocol.version"], a["url.scheme"]) == \
        ("tls", "1.3", "https")
    assert a["tls.established"] is True and a["tls.cipher"].startswith("TLS_")


def test_plaintext_of_an_object_met_mid_stream_is_hunted(cert):
    """An SSL object first seen after its handshake (a connection from before attach):
    its plaintext is parsed unsynced, from the next request line it holds."""
    c = Conn()
    c.cipher_bytes(b"\x17\x03\x03\x00\x20" + os.urandom(32), True)  # app data, mid-stream
    c.tls("bind", fresh=False, established=True)
    c.plain(REQ[7:], True)  # the middle of a request (its start was before attach)
    c.plain(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", False)
    c.plain(REQ, True)
    c.plain(HEAD, False)
    c.plain(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n", False)
    c.close()
    recs, rep = run(c.items)
    assert [r.target for r in recs] == ["/v1/chat/completions"]
    assert recs[0].tls is not None and recs[0].tls.version is None  # no hello seen
    assert not rep.get("parser_errors") and rep["tls_connections_decrypted"] == 1


def test_tls_the_probes_cannot_read_is_counted_never_parsed(cert):
    c = Conn()
    for from_client, data in handshake(cert):
        c.cipher_bytes(data, from_client)
    for _ in range(5):  # application data records, as ciphertext syscalls
        c.cipher_bytes(b"\x17\x03\x03\x01\x00" + os.urandom(256), True)
        c.cipher_bytes(b"\x17\x03\x03\x02\x00" + os.urandom(512), False)
    c.close()
    recs, rep = run(c.items)
    assert recs == [] and rep["tls_connections_unseen"] == 1
    assert not rep.get("parser_errors") and not rep.get("http_protocol_errors")
    assert not rep.get("tls_connections_decrypted")


def test_failed_handshake_is_counted(cert):
    c = Conn()
    first = handshake(cert)[0]
    c.cipher_bytes(first[1], True)
    c.tls("bind")
    c.cipher_bytes(b"\x15\x03\x03\x00\x02\x02\x30", False)  # alert: unknown_ca
    c.tls("free", failed=True)
    c.close()
    recs, rep = run(c.items)
    assert recs == [] and rep["tls_handshakes_failed"] == 1
    assert not rep.get("tls_connections_unseen") and not rep.get("parser_errors")


def test_an_open_connection_found_with_tls_records_is_not_http(cert):
    """Found open at attach (no accept seen): TLS records mid-stream are ciphertext,
    even where random bytes would spell a request line."""
    t = schema.SocketInfo(10, 5, 99, 1, 2, "127.0.0.1", 8443, "127.0.0.1", 5555,
                          existing=True)
    c = Conn()
    c.items = [t]
    c.cipher_bytes(b"\x17\x03\x03\x00\x30" + b"POST /x HTTP/1.1\r\nHost: a\r\n\r\n" + bytes(18),
                   True)
    c.close()
    recs, rep = run(c.items)
    assert recs == [] and rep["connections_tls"] == 1 and rep["tls_connections_unseen"] == 1


def test_tls_records_from_an_older_capture_version_still_read():
    """Wire v6 only added a record kind and two DATA flags: v5 captures read as before."""
    assert {5, 6} <= set(wire.READABLE_WIRE_VERSIONS) and wire.WIRE_VERSION >= 6
    raw = wire.TLS.pack(pid=1, tid=2, fd=3, conn_id=4, ts=5, ssl=6, op=C["TLS_BIND"],
                        via=C["TLS_VIA_SET_FD"], flags=C["TLS_F_FRESH"], bytes_in=7, bytes_out=8)
    ev = schema.decode(raw)
    assert (ev.op, ev.via, ev.fresh, ev.failed, ev.key) == ("bind", "set_fd", True, False,
                                                            (1, 3, 4))
    with pytest.raises(schema.WireError):
        schema.decode(wire.TLS.pack(op=9))


# ---- socket timing of TLS writes ------------------------------------------------------


def test_plaintext_writes_depart_with_the_ciphertext_that_carried_them():
    """Memory BIO: the event loop sends the ciphertext right after SSL_write returns;
    socket BIO: the write syscall happens inside SSL_write. Either way the plaintext
    write's departure is its ciphertext write's (held by Nagle here)."""
    MS = 1_000_000
    out: list[RequestRecord] = []
    t = NetTimer(out.append, Counter())
    t.mode = NetTimingMode(ts=0, mode="socket")

    def nw(op, ts, ref, off, aux=0, cause=None, first=False):
        return NetWait(pid=10, tid=11, fd=5, conn_id=99, op=op, cause=cause, first=first,
                       anchored=True, ts=ts, ref_ts=ref, stream_off=off, aux=aux)

    def data(enter, exit_, off, n, flags):
        return schema.DataEvent(pid=10, tid=11, fd=5, conn_id=99, ts_enter=enter,
                                ts_exit=exit_, ret=n, offset=0,
                                syscall=C["SYS_SSL_WRITE"] if flags & C["FLAG_TLS"]
                                else C["SYS_WRITE"], direction=C["DIR_OUT"],
                                flags=C["FLAG_LAST"] | flags, payload=b"", stream_off=off)

    t.netwait(nw("arrival", 100 * MS, 102 * MS, 0, first=True))  # the request's ciphertext
    # head: SSL_write 104.0-104.2 ms, its ciphertext sent after it (memory BIO)
    t.data(data(104 * MS, 104 * MS + 200_000, 0, 100, C["FLAG_TLS"]))
    t.data(data(104 * MS + 250_000, 104 * MS + 300_000, 2000, 122, C["FLAG_CIPHER"]))
    # token: SSL_write 105-106 ms with its write syscall inside (socket BIO), Nagle-held
    t.data(data(105 * MS + 500_000, 105 * MS + 600_000, 2122, 60, C["FLAG_CIPHER"]))
    t.data(data(105 * MS, 106 * MS, 100, 38, C["FLAG_TLS"]))
    t.netwait(nw("hold", 140 * MS, 105 * MS + 600_000, 2182, aux=2122, cause="nagle"))
    t.netwait(nw("departure", 145 * MS, 105 * MS + 600_000, 2182, aux=2122, cause="nagle"))
    r = RequestRecord(pid=10, fd=5, conn_id=99, exchange=0, role="server",
                      start_ns=103 * MS, response_start_ns=104 * MS + 200_000,
                      end_ns=106 * MS)
    t.finished(r)
    t.advance(1000 * MS)
    (r,) = out
    n = r.net
    assert n.timing == "socket" and n.arrival_ns == 100 * MS
    assert n.departures[104 * MS + 200_000] == 104 * MS + 300_000
    assert n.departures[106 * MS] == 145 * MS and n.send_hold_cause == "nagle"
    assert not t.stats.get("netwait_tls_unmapped")


# ---- captures mask credentials in TLS plaintext ----------------------------------------


def test_capture_masks_credentials_in_tls_plaintext(cert, tmp_path):
    items = served(cert).items
    live, _ = run(items, tenant_salt=b"deployment-a")
    w = capture.CaptureWriter(tmp_path / "t.ttcap", capture.new_header(tenant_salt="deployment-a"))
    for i in items:
        w.write(i)
    w.close()
    raw = gzip.decompress((tmp_path / "t.ttcap").read_bytes())
    assert KEY.encode() not in raw and b"Authorization: Bearer " in raw
    stored = [i for i in capture.CaptureReader(tmp_path / "t.ttcap")]
    again, rep = run(stored, tenant_salt=b"deployment-a", secrets_masked=True)
    assert len(again) == len(live) == 2 and not rep.get("parser_errors")
    assert [r.tenant for r in again] == [r.tenant for r in live] and live[0].tenant


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_capture_masks_grpc_metadata_inside_tls(cert, tmp_path, seed):
    """HTTP/2 over TLS: the connection's first bytes are the handshake (not HTTP/2), its
    plaintext stream is followed apart, and every HPACK credential in it is masked."""
    w = Wire()
    body = grpc_message(b"\x0a\x05hello")
    sid = w.request("/inference.GRPCInferenceService/ModelInfer", body=body,
                    extra=[("authorization", "Bearer " + KEY)])
    w.respond(sid, [grpc_message(b"\x0a\x02ok")])
    rng = random.Random(seed) if seed is not None else None
    c = Conn()
    for i, (from_client, data) in enumerate(handshake(cert, alpn=["h2"])):
        c.cipher_bytes(data, from_client)
        if i == 0:
            c.tls("bind")
    c.tls("established")
    for from_client, data in w.chunks:
        cuts = (sorted(rng.sample(range(1, len(data)), min(3, len(data) - 1)))
                if rng and len(data) > 4 else [])
        for a, b in zip([0] + cuts, cuts + [len(data)]):
            c.plain(data[a:b], from_client)
            c.cipher(b - a + 22, from_client)
    c.close()
    live, _ = run(c.items)
    assert len(live) == 1 and live[0].rpc is not None and live[0].tls.version == "1.3"
    path = tmp_path / "g.ttcap"
    writer = capture.CaptureWriter(path, capture.new_header(tenant_salt="deployment-a"))
    for i in c.items:
        writer.write(i)
    writer.close()
    from tracer.events.h2mask import _HUFFMAN
    raw = gzip.decompress(path.read_bytes())
    assert KEY.encode() not in raw and _HUFFMAN.encode(KEY.encode()) not in raw
    again, rep = run(list(capture.CaptureReader(path)), secrets_masked=True)
    assert len(again) == 1 and again[0].rpc.grpc_status == 0 and not rep.get("parser_errors")


# ---- which libraries are probed --------------------------------------------------------


def test_debian_libssl3_is_probed_with_its_libcrypto():
    lib = tlsprobes.classify_libssl("/lib/x86_64-linux-gnu/libssl.so.3")
    assert lib.status == "probed" and lib.name == "OpenSSL 3"
    assert tlsprobes.REQUIRED <= {c for s in lib.sites for c in s.covers}
    assert lib.crypto_soname == "libcrypto.so.3"
    v = tlsprobes.openssl_version("/lib/x86_64-linux-gnu/libcrypto.so.3")
    assert v is not None and v.startswith("3.") and ssl.OPENSSL_VERSION.startswith(f"OpenSSL {v}")


STUB = """
int SSL_read(void *s, void *b, int n) { return -1; }
int SSL_write(void *s, const void *b, int n) { return -1; }
int SSL_do_handshake(void *s) { return -1; }
void SSL_free(void *s) { }
"""


def _stub_libssl(tmp: Path, soname: str, version: str) -> Path:
    (tmp / "stub.c").write_text(STUB)
    (tmp / "stub.map").write_text(f"{version} {{ global: SSL_*; local: *; }};\n")
    out = tmp / soname
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(tmp / "stub.c"),
                    f"-Wl,-soname,{soname}", f"-Wl,--version-script={tmp / 'stub.map'}"],
                   check=True)
    return out


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the stand-in libraries")
def test_libssl_versions_known_and_unknown(tmp_path):
    """OpenSSL 1.1's symbol versions are probed like 3.x's; a libssl of any other
    version (OpenSSL 1.0, a fork) is reported, never probed."""
    old = _stub_libssl(tmp_path, "libssl.so.1.1", "OPENSSL_1_1_0")
    assert tlsprobes.classify_libssl(str(old)).status == "probed"
    assert tlsprobes.classify_libssl(str(old)).name == "OpenSSL 1.1"
    other = tmp_path / "o"
    other.mkdir()
    unknown = _stub_libssl(other, "libssl.so.1.0.0", "OPENSSL_1.0.0")
    lib = tlsprobes.classify_libssl(str(unknown))
    assert lib.status == "unknown_version" and "OPENSSL_1.0.0" in lib.reason
    assert tlsprobes.classify_libssl(str(tmp_path / "missing.so")).status == "error"


def test_grpcio_boringssl_is_said_not_probed():
    import grpc._cython.cygrpc as cygrpc
    why = tlsprobes.static_tls(cygrpc.__file__)
    assert why is not None and why.startswith("BoringSSL")
    assert tlsprobes.STATIC_TLS.search(cygrpc.__file__)
    assert tlsprobes.LIBSSL.search("/x/psycopg2_binary.libs/libssl-1a2b3c4d.so.1.1")
    assert not tlsprobes.LIBSSL.search("/usr/lib/x86_64-linux-gnu/libssl3.so")  # NSS's
    assert not tlsprobes.LIBSSL.search("/usr/lib/libgnutls-openssl.so.27")


def test_a_plaintext_write_no_ciphertext_carried_keeps_its_time_and_is_said():
    MS = 1_000_000
    out: list[RequestRecord] = []
    t = NetTimer(out.append, Counter())
    t.mode = NetTimingMode(ts=0, mode="socket")
    t.netwait(NetWait(pid=10, tid=11, fd=5, conn_id=99, op="arrival", cause=None, first=True,
                      anchored=True, ts=100 * MS, ref_ts=102 * MS, stream_off=0, aux=0))
    t.data(schema.DataEvent(pid=10, tid=11, fd=5, conn_id=99, ts_enter=104 * MS,
                            ts_exit=105 * MS, ret=50, offset=0, syscall=C["SYS_SSL_WRITE"],
                            direction=C["DIR_OUT"], flags=C["FLAG_LAST"] | C["FLAG_TLS"],
                            payload=b"", stream_off=0))
    t.finished(RequestRecord(pid=10, fd=5, conn_id=99, exchange=0, role="server",
                             start_ns=103 * MS, response_start_ns=105 * MS, end_ns=105 * MS))
    t.advance(2000 * MS)
    (r,) = out
    assert r.net.timing == "socket" and r.net.departures[105 * MS] == 105 * MS
    assert r.net.tls_unmapped == 1 and t.stats["netwait_tls_unmapped"] >= 1
    from tracer.export.spans import network_attributes
    assert network_attributes(r)["tokentrace.network.tls_unmapped_writes"] == 1


# ---- probes at the internal function two wrappers share ------------------------------


def test_prologue_call_accepts_only_what_leaves_the_arguments_alone():
    call = b"\xe8" + (0x100).to_bytes(4, "little", signed=True)
    # sub $8,%rsp; call
    assert tlsprobes.prologue_call(b"\x48\x83\xec\x08" + call) == 4 + 5 + 0x100
    # endbr64; push %rbp; mov %rdi,%rbp; push %rbx; mov %rdx,%rbx; sub $8,%rsp; call
    code = (b"\xf3\x0f\x1e\xfa\x55\x48\x89\xfd\x53\x48\x89\xd3\x48\x83\xec\x08"
            + call)
    assert tlsprobes.prologue_call(code) == 16 + 5 + 0x100
    assert tlsprobes.prologue_call(b"\x41\x54" + call) == 2 + 5 + 0x100  # push %r12
    # mov %rsp,%rcx (SSL_read's &readbytes) changes an argument: refused
    assert tlsprobes.prologue_call(b"\x48\x89\xe1" + call) is None
    # movslq %edx,%rdx: refused (not in the allowed set)
    assert tlsprobes.prologue_call(b"\x48\x63\xd2" + call) is None
    # mov %rdi,(%rsp): a store, not a register copy: refused
    assert tlsprobes.prologue_call(b"\x48\x89\x3c\x24" + call) is None
    # mov %fs:0x28,%rax (a stack protector): unknown, refused
    assert tlsprobes.prologue_call(b"\x64\x48\x8b\x04\x25\x28\x00\x00\x00" + call) is None
    assert tlsprobes.prologue_call(b"\x48\x83\xec\x08") is None  # no call at all


def test_debian_openssl_wrappers_are_probed_at_their_internal_functions():
    """Debian's SSL_read/SSL_read_ex, SSL_write/SSL_write_ex, BIO_write/BIO_write_ex
    and BIO_read/BIO_read_ex begin with `sub $n,%rsp` (single-stepped); each pair calls
    one internal function that begins with `push` (emulated): that is where the probe
    goes, once for both."""
    ssl_lib = tlsprobes.classify_libssl("/lib/x86_64-linux-gnu/libssl.so.3")
    crypto, fwd = tlsprobes.forwarded_sites("/lib/x86_64-linux-gnu/libcrypto.so.3",
                                            tlsprobes.CRYPTO_PROBES)
    assert ssl_lib.forwarded == ["SSL_read/SSL_read_ex", "SSL_write/SSL_write_ex"]
    assert fwd == ["BIO_write/BIO_write_ex", "BIO_read/BIO_read_ex"]
    funcs = {}
    from elftools.elf.elffile import ELFFile
    for path in ("/lib/x86_64-linux-gnu/libssl.so.3", "/lib/x86_64-linux-gnu/libcrypto.so.3"):
        with open(path, "rb") as f:
            elf = ELFFile(f)
            for name, (at, size) in tlsprobes._functions(elf).items():
                funcs[name] = (path, at, tlsprobes._code(elf, f, at, size))
    for site in [s for s in ssl_lib.sites if len(s.covers) == 2] + crypto:
        for name in site.covers:
            path, at, code = funcs[name]
            assert tlsprobes._calls(code, at, site.vaddr), (name, hex(site.vaddr))
            assert code[:3] == b"\x48\x83\xec" or code[:1] == b"\x55"
        with open(funcs[site.covers[0]][0], "rb") as f:
            elf = ELFFile(f)
            first = tlsprobes._code(elf, f, site.vaddr, 2)
        assert first[0] in range(0x50, 0x58) or (first[0] == 0x41 and first[1] in range(0x50, 0x58))
        assert site.name.endswith(f"@{site.vaddr:#x}")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the stand-in libraries")
def test_bio_read_is_probed_only_where_cheap(tmp_path):
    """A libcrypto whose BIO_read is no provable wrapper: BIO_write is probed at its
    entry, BIO_read (twice per record read, single-stepped there) not at all."""
    (tmp_path / "c.c").write_text(
        "int BIO_read(void *b, void *d, int n) { return n > 0 ? -1 : 0; }\n"
        "int BIO_read_ex(void *b, void *d, unsigned long n, unsigned long *r) { return 0; }\n"
        "int BIO_write(void *b, const void *d, int n) { return n; }\n")
    lib = tmp_path / "libcrypto.so.3"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "c.c")],
                   check=True)
    sites, fwd = tlsprobes.forwarded_sites(str(lib), tlsprobes.CRYPTO_PROBES)
    assert fwd == [] and [s.covers for s in sites] == [("BIO_write",)]


def test_tls_streams_take_the_fast_path_and_give_what_the_general_path_gives(cert):
    """A TLS response's token writes (plaintext flagged TLS) take the stream shortcut
    (issue 16's ``stream_write``) as plain ones do; ciphertext never does. Same records
    either way."""
    from tests.test_fastpaths import general_paths
    from tracer.correlate.connections import ConnectionTracker

    items = served(cert, requests=12).items  # past the process graph's writer head
    taken = {"tls": 0, "other": 0}
    real = ConnectionTracker.stream_write

    def counting(self, c, tid, ts, direction, flags, *rest):
        ok = real(self, c, tid, ts, direction, flags, *rest)
        if ok:
            taken["tls" if flags & C["FLAG_TLS"] else "other"] += 1
        return ok

    from unittest.mock import patch
    with patch.object(ConnectionTracker, "stream_write", counting):
        fast, fast_rep = run(items)
    with general_paths():
        slow, slow_rep = run(items)
    assert taken["tls"] >= 4 and taken["other"] == 0
    assert len(fast) == len(slow) == 12

    def view(r):
        q = r.llm_response
        return (r.start_ns, r.end_ns, r.status, r.response_bytes, q.output_tokens,
                q.first_token_ts, list(q.token_ts), r.tls)

    assert [view(r) for r in fast] == [view(r) for r in slow]
    assert fast_rep == slow_rep
