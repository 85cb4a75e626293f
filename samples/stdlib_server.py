"""An OpenAI-style chat server on Python's stdlib ``http.server``, as a new user might
write one: TCP_NODELAY left off (the stdlib default), the response head and body in
separate writes, optionally one request at a time (``--single``).

Tokens are fake ("tok0 tok1 ..."), ``--prefill-ms`` of work before the first and
``--token-ms`` between the others. Used by ``tests/test_live_netwait.py`` to show what
the kernel holds: Nagle waiting for the client's delayed ACK, and a backlog of
connections waiting for a single-threaded server. With ``--ssl-certfile`` and
``--ssl-keyfile`` it serves HTTPS through ``ssl.SSLSocket`` (OpenSSL on the socket
itself: ``SSL_set_fd``, blocking reads and writes inside SSL calls), the other way a
Python server does TLS beside asyncio's memory BIOs.
"""

from __future__ import annotations

import argparse
import http.server
import itertools
import json
import time

_ids = itertools.count()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    prefill_s = 0.0
    token_s = 0.0

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        req = json.loads(self.rfile.read(n) or b"{}")
        model = req.get("model", "stdlib-gpt")
        max_tokens = int(req.get("max_tokens", 4))
        rid = f"chatcmpl-{next(_ids)}-{time.monotonic_ns()}"
        time.sleep(self.prefill_s)
        if req.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()  # one write: the head
            for i in range(max_tokens):
                if i:
                    time.sleep(self.token_s)
                chunk = {"id": rid, "object": "chat.completion.chunk", "model": model,
                         "choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}
                self._chunk(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        text = " ".join(f"tok{i}" for i in range(max_tokens))
        body = json.dumps({
            "id": rid, "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": max_tokens,
                      "total_tokens": 5 + max_tokens}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()  # the head: one write...
        self.wfile.write(body)  # ...the body another (Nagle holds it behind the head)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--single", action="store_true",
                   help="one request at a time (HTTPServer), else a thread per connection")
    p.add_argument("--prefill-ms", type=float, default=0.0)
    p.add_argument("--token-ms", type=float, default=0.0)
    p.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", help="...and this key (PEM)")
    args = p.parse_args()
    Handler.prefill_s = args.prefill_ms / 1000
    Handler.token_s = args.token_ms / 1000
    cls = http.server.HTTPServer if args.single else http.server.ThreadingHTTPServer
    cls.request_queue_size = 64
    with cls((args.host, args.port), Handler) as srv:
        if args.ssl_certfile:
            import ssl
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
            srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        srv.serve_forever()


if __name__ == "__main__":
    main()
