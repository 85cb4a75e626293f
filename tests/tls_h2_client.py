"""A KServe gRPC client on hyper-h2 over Python's ``ssl`` (OpenSSL on the socket), run as
its own process by tests/test_live_tls.py: traced, it shows HTTP/2 and gRPC read out of
TLS at the client's end (the sample server's TLS is grpcio's BoringSSL, which the
probes cannot read).

    python tests/tls_h2_client.py HOST:PORT CAFILE CALLS API_KEY

It waits for a line on stdin, so the tracer can attach first; then connects (ALPN h2),
makes CALLS calls, unary and streamed in turn, each with ``authorization: Bearer
API_KEY`` metadata, prints one JSON line per call and ``done``, and waits for stdin to
close before it exits.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import sys
import time

import h2.config
import h2.connection
import h2.events
from tritonclient.grpc import service_pb2

PATH = "/inference.GRPCInferenceService/"


def main() -> None:
    target, cafile, calls, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    host, port = target.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.set_alpn_protocols(["h2"])
    print("ready", flush=True)
    sys.stdin.readline()
    sock = ctx.wrap_socket(socket.create_connection((host, int(port))),
                           server_hostname="localhost")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                header_encoding=None))
    print(json.dumps({"alpn": sock.selected_alpn_protocol()}), flush=True)
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    for i in range(calls):
        stream = i % 2 == 1
        rid = f"tls{i}-{time.monotonic_ns()}"
        req = service_pb2.ModelInferRequest(model_name="tiny-gpt", id=rid)
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
        prompt = b"Hello there, tiny model"
        max_tokens = 3 + i % 4
        req.raw_input_contents.extend([len(prompt).to_bytes(4, "little") + prompt,
                                       max_tokens.to_bytes(4, "little")])
        body = req.SerializeToString()
        sid = conn.get_next_available_stream_id()
        method = "ModelStreamInfer" if stream else "ModelInfer"
        conn.send_headers(sid, [
            (b":method", b"POST"), (b":scheme", b"https"),
            (b":path", (PATH + method).encode()), (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"), (b"te", b"trailers"),
            (b"authorization", b"Bearer " + key.encode())])
        conn.send_data(sid, struct.pack(">BI", 0, len(body)) + body, end_stream=True)
        sock.sendall(conn.data_to_send())
        buf, n, status = bytearray(), 0, None
        while status is None:
            chunk = sock.recv(65536)
            if not chunk:
                raise SystemExit("server closed the connection")
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                    buf += ev.data
                    while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                        size = int.from_bytes(buf[1:5], "big")
                        del buf[:5 + size]
                        n += 1
                elif isinstance(ev, h2.events.TrailersReceived) and ev.stream_id == sid:
                    status = int(dict(ev.headers)[b"grpc-status"])
            pending = conn.data_to_send()
            if pending:
                sock.sendall(pending)
        print(json.dumps({"id": rid, "stream": stream, "messages": n, "status": status,
                          "max_tokens": max_tokens}), flush=True)
    print("done", flush=True)
    sys.stdin.read()
    conn.close_connection()
    sock.sendall(conn.data_to_send())
    sock.close()


if __name__ == "__main__":
    main()
